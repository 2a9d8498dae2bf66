"""The real executor on real mlx-lm models: batched decode produces the tokens each request
produces alone (exactly on the CPU backend, elsewhere up to near-ties: tests/backend.py), and the
KV bytes it reports are what MLX holds."""

from __future__ import annotations

import random

import mlx.core as mx
import pytest
from batchsim.scheduler.pool_geometry import KV_STEP, round_up
from batchsim.scheduler.request import Request, SamplingParams
from batchsim.scheduler.scheduler import Scheduler
from batchsim.server.executors.kv_store import KVView
from batchsim.server.executors.mlx_executor import MLXExecutor

from tests.backend import assert_same_tokens
from tests.drivers import config, kv_per_token, run_alone, run_mlx


def _requests(vocab: int, n: int, seed: int, max_prompt: int, max_out: int):
    rng = random.Random(seed)
    specs = []
    for i in range(n):
        prompt = [rng.randrange(vocab) for _ in range(rng.randint(1, max_prompt))]
        # (arrival step, ids, out)
        specs.append((rng.randint(0, 12), prompt, rng.randint(1, max_out)))
    return specs


def _same(model, specs, got, want):
    assert_same_tokens(model, {i: ids for i, (_, ids, _) in enumerate(specs)}, got, want)


def test_batched_equals_single_tiny(tiny):
    ref, model, _ = tiny
    specs = _requests(ref.spec.vocab_size, 12, seed=1, max_prompt=700, max_out=40)
    alone = run_alone(model, kv_per_token(ref), specs)
    # Small token budget: prompts are chunked, decodes and prefills share steps, rows join and
    # leave.
    batched, _sched, trace = run_mlx(model, kv_per_token(ref), specs, max_num_seqs=6,
                                     prefill_step_size=256, max_num_batched_tokens=300)
    assert max(len(p.decode_ids) for p in trace.plans) >= 4
    assert any(p.decode_ids and p.prefills for p in trace.plans)
    _same(model, specs, batched, alone)


def test_steps_run_ahead_are_used_or_undone_and_change_no_token(tiny):
    # Prefill-first: a step that only prefills undoes the decode step run ahead of it.
    ref, model, _ = tiny
    specs = _requests(ref.spec.vocab_size, 8, seed=4, max_prompt=300, max_out=30)
    cfg = {"max_num_seqs": 4, "prefill_step_size": 256, "policy": "prefill-first"}
    ahead = run_mlx(model, kv_per_token(ref), specs, **cfg)[0]
    steps = run_mlx.executor.ahead_steps
    assert steps["used"] > 0 and steps["undone"] > 0, steps
    # Exact on every backend: the same batches in the same order, only run ahead or not.
    assert ahead == run_mlx(model, kv_per_token(ref), specs, run_ahead=False, **cfg)[0]


def test_batched_equals_single_quantized(tiny_q4):
    # 4-bit weights, float16 activations: quantized matmuls for one row and for many.
    ref, model, _ = tiny_q4
    kvt = kv_per_token(ref, "float16")
    specs = _requests(ref.spec.vocab_size, 6, seed=3, max_prompt=300, max_out=20)
    batched, _, trace = run_mlx(model, kvt, specs, max_num_seqs=6)
    assert max(len(p.decode_ids) for p in trace.plans) >= 3
    _same(model, specs, batched, run_alone(model, kvt, specs))


def test_preempted_requests_recompute_the_same_tokens(tiny):
    ref, model, _ = tiny
    specs = [(0, ids, out) for _, ids, out in _requests(ref.spec.vocab_size, 6, 2, 240, 60)]
    alone = run_alone(model, kv_per_token(ref), specs)
    batched, sched, _ = run_mlx(model, kv_per_token(ref), specs, max_num_seqs=6,
                                kv_budget_bytes=kv_per_token(ref) * 3 * KV_STEP, row_step=1)
    assert sched.num_preemptions > 0
    _same(model, specs, batched, alone)


def test_a_masking_bug_would_be_caught(tiny, monkeypatch):
    # Negative control: without the padding mask, shorter rows attend to zeros and diverge.
    ref, model, _ = tiny
    specs = [(0, ids, out) for _, ids, out in _requests(ref.spec.vocab_size, 6, 3, 500, 30)]
    alone = run_alone(model, kv_per_token(ref), specs)
    monkeypatch.setattr(KVView, "make_mask", lambda self, *a, **k: None)
    broken, _, _ = run_mlx(model, kv_per_token(ref), specs, max_num_seqs=6)
    assert broken != alone


@pytest.mark.slow
def test_batched_equals_single_smollm2(smollm2):
    ref, model, _ = smollm2
    specs = _requests(ref.spec.vocab_size, 5, seed=4, max_prompt=300, max_out=8)
    _same(model, specs, run_mlx(model, kv_per_token(ref), specs, max_num_seqs=5)[0],
          run_alone(model, kv_per_token(ref), specs))


@pytest.mark.parametrize("name", ["tiny", "tiny_moe"])
def test_kv_bytes_match_arrays_formula_and_active_memory(name, request):
    ref, model, _ = request.getfixturevalue(name)
    spec = ref.spec
    per_token = 2 * spec.num_layers * spec.num_kv_heads * spec.head_dim * 4
    assert per_token == kv_per_token(ref)
    sched = Scheduler(config(kv_bytes_per_token=per_token, max_num_seqs=8, prefill_step_size=256,
                             max_num_batched_tokens=512))
    mx.eval(model.parameters())
    mx.synchronize()
    ex = MLXExecutor(model, cache_limit_bytes=0)  # no buffer cache: active memory is what is held
    base = mx.get_active_memory()
    rng = random.Random(5)
    for i in range(6):
        ids = [rng.randrange(spec.vocab_size) for _ in range(rng.randint(100, 600))]
        sched.add_request(Request(i, len(ids),
                                  SamplingParams(max_tokens=30 + 20 * i, ignore_eos=True),
                                  0.0, prompt_token_ids=ids))
    seen_growth = False
    while sched.has_work():
        plan = sched.schedule()
        result = ex.execute(plan)
        sched.update_from_output(plan, result)
        arrays = sum(a.nbytes for a in ex.pool.arrays()) + sum(
            c.nbytes for s in ex.seqs.values() if s.cache for c in s.cache)
        formula = plan.pool.rows * plan.pool.capacity_tokens * per_token + sum(
            round_up(sched.requests[rid].num_computed_tokens, KV_STEP) * per_token
            for rid in sched.kv.private)
        assert result.kv_bytes == plan.kv_bytes == arrays == formula
        mx.synchronize()  # the next step, run ahead, has finished: its activations are freed
        held = mx.get_active_memory() - base
        # Besides KV, only per-step scalars (tokens, positions, masks) stay alive.
        assert abs(held - result.kv_bytes) <= 64 * 1024, (held, result.kv_bytes)
        seen_growth |= plan.pool.capacity_tokens > KV_STEP
    assert seen_growth


@pytest.mark.parametrize("model_type", ["qwen2", "qwen3"])
def test_batched_equals_single_on_other_architectures(model_type, tmp_path):
    # Tiny shapes of the Qwen2 (QKV bias, head_dim derived) and Qwen3 (q/k norms) families.
    from batchsim.server.models.build import build_model
    from batchsim.server.models.loader import ModelRef, load
    from batchsim.server.models.spec import ModelSpec

    config = {"model_type": model_type, "hidden_size": 64, "intermediate_size": 128,
              "num_hidden_layers": 2,
                  "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 512,
                  "max_position_embeddings": 4096, "rms_norm_eps": 1e-6, "rope_theta": 10000.0,
                  "tie_word_embeddings": model_type == "qwen3",
                  "bos_token_id": 1, "eos_token_id": 2}
    if model_type == "qwen3":
        config["head_dim"] = 16
    spec = ModelSpec(name=f"tiny-{model_type}", config=config)
    path = build_model(spec, "float32", out_dir=tmp_path / model_type)
    model, _ = load(ModelRef(spec.name, path, spec, "float32", None))
    kvt = spec.kv_bytes_per_token("float32")
    specs = _requests(spec.vocab_size, 6, seed=7, max_prompt=400, max_out=20)
    batched, _, trace = run_mlx(model, kvt, specs, max_num_seqs=6)
    assert max(len(p.decode_ids) for p in trace.plans) >= 3
    _same(model, specs, batched, run_alone(model, kvt, specs))


def test_moe_pool_holds_what_the_spec_prices(tiny_moe):
    # qwen3_moe: full attention in every layer, so the pool's K/V per token is the spec's.
    ref, model, _ = tiny_moe
    assert ref.spec.families == ["moe"]
    assert MLXExecutor(model).kv_bytes_per_token == kv_per_token(ref) == 2 * 2 * 2 * 16 * 4


def test_batched_equals_single_moe(tiny_moe):
    # Rows routed to different experts in one gathered matmul; chunked prefills, joins and leaves.
    # The driver checks the executor's KV bytes against the scheduler's after every step.
    ref, model, _ = tiny_moe
    specs = _requests(ref.spec.vocab_size, 10, seed=11, max_prompt=600, max_out=30)
    batched, _, trace = run_mlx(model, kv_per_token(ref), specs, max_num_seqs=6,
                                prefill_step_size=256, max_num_batched_tokens=300)
    assert max(len(p.decode_ids) for p in trace.plans) >= 4
    assert any(p.decode_ids and p.prefills for p in trace.plans)
    _same(model, specs, batched, run_alone(model, kv_per_token(ref), specs))


def test_batched_equals_single_moe_sorted_experts(tiny_moe):
    # From 32 rows (64 expert picks) SwitchGLU sorts rows by expert before the gathered matmul.
    ref, model, _ = tiny_moe
    rng = random.Random(12)
    specs = [(0, [rng.randrange(ref.spec.vocab_size) for _ in range(rng.randint(1, 40))],
              rng.randint(4, 10)) for _ in range(34)]
    batched, _, trace = run_mlx(model, kv_per_token(ref), specs, max_num_seqs=34)
    assert max(len(p.decode_ids) for p in trace.plans) >= 32
    _same(model, specs, batched, run_alone(model, kv_per_token(ref), specs))
