"""The real executor on sliding-window, hybrid linear-attention and MLA models, and on quantized
K/V: one forward pass per decode step, rows joining and leaving, the same tokens as each request
alone (and as mlx-lm's own caches; exactly on the CPU backend, elsewhere up to near-ties:
tests/backend.py), and the bytes it holds equal to the scheduler's at every step."""

from __future__ import annotations

import random

import mlx.core as mx
import pytest
from batchsim.configs import ConfigError
from batchsim.server.engine.run_config import RunConfig
from batchsim.server.engine.runner import run_workload
from batchsim.server.engine.session import open_session
from batchsim.server.executors.decode_pool import DecodePool
from batchsim.server.executors.kv_store import DecodeStep
from batchsim.server.executors.mlx_executor import MLXExecutor
from batchsim.workloads.lengths import parse_length
from batchsim.workloads.spec import WorkloadSpec
from mlx_lm.models.cache import QuantizedKVCache, make_prompt_cache

from tests.backend import assert_same_tokens
from tests.drivers import float32_model, random_specs, run_alone, run_mlx

FAMILIES = ["tiny-sliding", "tiny-hybrid", "tiny-mla"]


def _run(model, layout, specs, kv_bits=None, run_ahead=True, **cfg):
    """run_mlx on a layout's cache: (tokens, trace, scheduler); the executor as _run.executor."""
    out, sched, trace = run_mlx(model, layout.full_token_bytes, specs, run_ahead, kv_bits,
                                cache_layout=layout, **cfg)
    _run.executor = run_mlx.executor
    return out, trace, sched


def _alone(model, layout, specs, kv_bits=None):
    return run_alone(model, layout.full_token_bytes, specs, kv_bits=kv_bits, cache_layout=layout)


def _same(model, specs, got, want, make_cache=None):
    prompts = {i: ids for i, (_, ids, _) in enumerate(specs)}
    assert_same_tokens(model, prompts, got, want, make_cache)


def _greedy(model, specs, make_cache=make_prompt_cache):
    return {i: _mlx_lm_greedy(model, ids, out, make_cache) for i, (_, ids, out) in enumerate(specs)}


def _mlx_lm_greedy(model, ids: list[int], n: int, make_cache=make_prompt_cache) -> list[int]:
    """mlx-lm's own single-stream caches: the prompt in one call, then one token per call."""
    cache = make_cache(model)
    y = mx.argmax(model(mx.array(ids)[None], cache=cache)[:, -1], axis=-1)
    out = [y.item()]
    for _ in range(n - 1):
        y = mx.argmax(model(y[:, None], cache=cache)[:, -1], axis=-1)
        out.append(y.item())
    return out


# Per family: requests, prompt and output bounds (the hybrid model is slow on the CPU: few tokens).
CASES = {"tiny-sliding": (5, 300, 30), "tiny-hybrid": (3, 260, 8), "tiny-mla": (5, 300, 30)}


@pytest.mark.parametrize("name", ["tiny", "tiny-moe", *FAMILIES])
def test_the_pool_holds_the_layers_the_spec_describes(name, batchsim_home):
    # One description: what the executor reads from the model's caches is the spec's, per layer.
    ref, model = float32_model(name)
    ex = MLXExecutor(model)
    assert ex.layers == [lay.attention for lay in ref.spec.arch.layers]
    stores = {"full": "KVStore", "mla": "KVStore", "sliding": "RingStore", "linear": "StateStore"}
    assert [type(s).__name__ for s in ex.pool.stores] == [stores[a.kind] for a in ex.layers]
    refused = {a.kind for a in ex.layers} - {"full", "linear"}  # by the description's own check
    if refused:
        with pytest.raises(ConfigError, match=f"cannot run a {refused.pop()} layer on a quantized"):
            MLXExecutor(model, kv_bits=4)
    assert ex.cache_layout == ref.spec.cache_layout("float32")
    assert ex.kv_bytes_per_token == ref.spec.kv_bytes_per_token("float32")


@pytest.mark.parametrize("name", FAMILIES)
def test_batched_equals_single_per_family(name, batchsim_home):
    ref, model = float32_model(name)
    layout = ref.spec.cache_layout("float32")
    n, max_prompt, max_out = CASES[name]
    specs = random_specs(ref.spec.vocab_size, n, seed=21, max_prompt=max_prompt, max_out=max_out)
    # Chunked prefills (256-token chunks, a 1-token tail possible), joins at different steps.
    batched, trace, _ = _run(model, layout, specs, max_num_seqs=n, prefill_step_size=256,
                             max_num_batched_tokens=300)
    assert max(len(p.decode_ids) for p in trace.plans) >= 2
    assert any(p.free_ids and p.decode_ids for p in trace.plans)  # rows left, others decoded on
    alone = _alone(model, layout, specs)
    _same(model, specs, batched, alone)
    _same(model, specs, alone, _greedy(model, specs))


def test_sliding_rows_wrap_their_ring(batchsim_home, monkeypatch):
    # Rows run past the 64-token window; a ring that forgot the oldest slot's position would
    # attend to the wrong tokens (negative control: writing at the position, clipped, diverges).
    ref, model = float32_model("tiny-sliding")
    layout = ref.spec.cache_layout("float32")
    specs = [(0, list(range(3, 3 + 70 + 7 * i)), 24) for i in range(3)]
    good = _run(model, layout, specs, max_num_seqs=3)[0]
    _same(model, specs, good, _greedy(model, specs))
    monkeypatch.setattr(DecodeStep, "slots",
                        lambda self, ring: mx.minimum(self.positions, ring - 1))
    assert _run(model, layout, specs, max_num_seqs=3)[0] != good


# Prompts of one length arriving together: (requests, prompt tokens, output tokens). 300-token
# prompts in 256-token chunks: the first chunks prefill as one group, the 44-token tails continue
# each request's own split cache.
GROUP_CASES = {"tiny": (4, 300, 12), "tiny-moe": (4, 300, 12), "tiny-sliding": (4, 300, 12),
               "tiny-hybrid": (3, 40, 4), "tiny-mla": (4, 300, 12)}


@pytest.mark.parametrize("name", list(GROUP_CASES))
def test_prompts_of_one_length_prefill_together_as_they_do_alone(name, batchsim_home, monkeypatch):
    from batchsim.server.executors import prefill_cache

    ref, model = float32_model(name)
    layout = ref.spec.cache_layout("float32")
    n, prompt, out = GROUP_CASES[name]
    rng = random.Random(5)
    specs = [(0, [rng.randrange(ref.spec.vocab_size) for _ in range(prompt)],
              out) for _ in range(n)]
    split = prefill_cache.split_rows
    sizes = []
    monkeypatch.setattr(prefill_cache, "split_rows",
                        lambda caches, rows: sizes.append(rows) or split(caches, rows))
    cfg = {"max_num_seqs": n, "prefill_step_size": 256, "max_num_batched_tokens": 1024}
    batched = _run(model, layout, specs, **cfg)[0]  # the driver checks the KV bytes every step
    assert sizes and max(sizes) == n
    _same(model, specs, batched, _alone(model, layout, specs))
    _same(model, specs, batched, _greedy(model, specs))
    # Negative control: every request handed the group's first row diverges.
    monkeypatch.setattr(prefill_cache, "split_rows", lambda caches,
                        rows: [split(caches, rows)[0]] * rows)
    assert _run(model, layout, specs, **cfg)[0] != batched


def test_a_step_masks_only_slots_some_row_has_not_filled():
    # Rows of 40, 77 and 84 tokens write their 41st, 78th and 85th: a full layer (85 slots) masks
    # each row past its own token; a 64-slot ring masks only the row that has not wrapped; once
    # every row has wrapped, or all rows are at one position, nothing is masked.
    step = DecodeStep([40, 77, 84])
    full = step.mask(85)[:, 0, 0]
    assert full.sum(axis=1).tolist() == [41, 78, 85]
    ring = step.mask(64)[:, 0, 0]
    assert ring.sum(axis=1).tolist() == [41, 64, 64] and not ring[0, 41:].any()
    assert DecodeStep([70, 77, 84]).mask(64) is None
    assert DecodeStep([9, 9]).mask(10) is None


@pytest.mark.parametrize("name", ["tiny-sliding", "tiny-hybrid"])
def test_steps_run_ahead_are_used_or_undone_and_change_no_token(name, batchsim_home, monkeypatch):
    # Prefill-first: a step that only prefills undoes the decode step run ahead of it.
    ref, model = float32_model(name)
    layout = ref.spec.cache_layout("float32")
    n, max_out = (5, 20) if name == "tiny-sliding" else (3, 6)
    specs = random_specs(ref.spec.vocab_size, n, seed=8, max_prompt=40, max_out=max_out)
    cfg = {"max_num_seqs": n, "policy": "prefill-first"}
    ahead = _run(model, layout, specs, **cfg)[0]
    steps = _run.executor.ahead_steps
    assert steps["used"] > 0 and steps["undone"] > 0, steps
    # Exact on every backend: the same batches in the same order, only run ahead or not.
    assert ahead == _run(model, layout, specs, run_ahead=False, **cfg)[0]
    assert _run.executor.ahead_steps == {"used": 0, "undone": 0}
    if name == "tiny-hybrid":  # negative control: an undo that keeps the advanced state diverges
        monkeypatch.setattr(DecodePool, "_restore_states", lambda self, states: None)
        assert _run(model, layout, specs, **cfg)[0] != ahead


@pytest.mark.parametrize("name", ["tiny-sliding", "tiny-hybrid"])
def test_preempted_requests_recompute_the_same_tokens(name, batchsim_home):
    # A budget of about two rows: rows leave mid-decode and their requests prefill again.
    ref, model = float32_model(name)
    layout = ref.spec.cache_layout("float32")
    n, max_out = (4, 24) if name == "tiny-sliding" else (3, 14)
    rng = random.Random(2)  # prompts near 256 tokens: decoding crosses into a second KV step
    specs = [(0, [rng.randrange(ref.spec.vocab_size) for _ in range(rng.randint(240, 252))],
              rng.randint(8, max_out)) for _ in range(n)]
    budget = 2 * layout.seq_bytes(256) + layout.private_bytes(0, 256)
    batched, _, sched = _run(model, layout, specs, max_num_seqs=n, kv_budget_bytes=budget,
                             row_step=1)
    assert sched.num_preemptions > 0
    _same(model, specs, batched, _alone(model, layout, specs))


@pytest.mark.parametrize("name", FAMILIES)
def test_run_completes_with_an_exact_kv_account(name, batchsim_home):
    spec = WorkloadSpec(name="fam", num_prompts=4, request_rate=float("inf"),
                        input_len=parse_length("uniform:8:300"),
                        output_len=parse_length("uniform:2:12"),
                        seed=3)
    session = open_session(RunConfig(model=name, dtype="float32", workload=spec))
    outcome = run_workload(session, spec, out_dir=None, label="fam")
    assert outcome.summary["completed"] == 4
    assert outcome.summary["kv_account_mismatches"] == 0
    assert all(st.kv_bytes_measured == st.kv_bytes for st in outcome.steps)


def _tiny_llama_64(tmp_path, dtype: str):
    """A Llama of head_dim 64: the width QuantizedKVCache groups by."""
    from batchsim.server.models.build import build_model
    from batchsim.server.models.loader import ModelRef, load
    from batchsim.server.models.spec import ModelSpec

    cfg = {"model_type": "llama", "hidden_size": 128, "intermediate_size": 128,
           "num_hidden_layers": 2,
               "num_attention_heads": 2, "num_key_value_heads": 1,
               "head_dim": 64, "vocab_size": 512,
               "max_position_embeddings": 4096, "rms_norm_eps": 1e-5, "rope_theta": 10000.0,
               "tie_word_embeddings": True, "bos_token_id": 1, "eos_token_id": 2}
    spec = ModelSpec(name="tiny-llama64", config=cfg)
    path = build_model(spec, dtype, out_dir=tmp_path / "llama64")
    return spec, load(ModelRef(spec.name, path, spec, dtype, None))[0]


@pytest.mark.parametrize("bits", [4, 8])
def test_quantized_kv_batched_equals_single(bits, tmp_path, quantized_dtype):
    dtype = quantized_dtype  # quantized attention: float16 where MLX's GPU kernels need it
    spec, model = _tiny_llama_64(tmp_path, dtype)
    layout = spec.cache_layout(dtype, bits)
    specs = random_specs(spec.vocab_size, 5, seed=5, max_prompt=280, max_out=20)
    batched, trace, _ = _run(model, layout, specs, kv_bits=bits, max_num_seqs=5,
                             prefill_step_size=256, max_num_batched_tokens=300)
    assert MLXExecutor(model, kv_bits=bits).cache_layout == layout
    assert layout.full_token_bytes < spec.kv_bytes_per_token(dtype)
    assert max(len(p.decode_ids) for p in trace.plans) >= 3
    quantized = lambda m: [QuantizedKVCache(64, bits) for _ in m.layers]
    _same(model, specs, batched, _alone(model, layout, specs, bits), quantized)
    # mlx-lm's QuantizedKVCache alone gives the same tokens (prompts within one prefill chunk).
    short = [(0, ids[:200], out) for _, ids, out in specs[:2]]
    _same(model, short, _alone(model, layout, short, bits),
          _greedy(model, short, quantized), quantized)


def test_kv_bits_refusals_are_one_line(batchsim_home):
    for model, match in (("tiny", "multiple of 64"), ("tiny-sliding", "sliding layer")):
        with pytest.raises(ConfigError, match=match) as info:
            open_session(RunConfig(model=model, dtype="float32", kv_bits=4))
        assert "\n" not in str(info.value)


def test_cli_run_on_an_mla_model_keeps_the_output_contract(batchsim_home, tmp_path):
    from tests.cli_calls import batchsim, last_json

    proc = batchsim("run", "--model", "tiny-mla", "--num-prompts", "4", "--request-rate", "inf",
                    "--input-len", "uniform:8:200", "--output-len", "uniform:2:8",
                    "--out", str(tmp_path), "--no-progress", home=batchsim_home)
    summary = last_json(proc.stdout)
    assert summary["completed"] == 4 and summary["kv_account_mismatches"] == 0
