"""The step's per-row and host terms, serving-engine profiles and quantized ceilings: each term
prices what it names, defaults to nothing, and the simulator charges what `step_time` says."""

from __future__ import annotations

import dataclasses
import re

import pytest
from batchsim.configs import ConfigError
from batchsim.scheduler.plan import PrefillChunk
from batchsim.server.models.spec import zoo_spec
from batchsim.server.perf import macs
from batchsim.server.perf.engines import (
    ENGINES_DIR,
    EngineProfile,
    engine_names,
    load_engine,
    top_p_bytes_per_logit,
)
from batchsim.server.perf.gpu_fit import load_fit, mac_profile
from batchsim.server.perf.stepcost import StepCost, matrix_weight_bytes

from tests.test_sim import PROFILE


def _mac(label: str = "M4 Max 40c", quantize_bits: int | None = 4):
    """A catalog Mac's profile under the shipped fit with the per-row terms and quantized
    ceilings unset (each test sets the one it checks)."""
    mac, _ = macs.load_catalog().variant(label)
    fit = dataclasses.replace(load_fit(), attention_row_us=0.0, kv_bandwidth_efficiency=0.0,
                              token_layer_us=0.0, sampling_row_us=0.0, quantized_gemm_efficiency={})
    return mac_profile(mac, fit, quantize_bits)


def _engine(**kw) -> EngineProfile:
    return EngineProfile(**{"name": "test", "host_step_us": 0.0, "host_token_us": 0.0, **kw})


def test_every_shipped_engine_loads_and_says_where_its_numbers_come_from():
    names = engine_names()
    assert {"batchsim", "mlx-lm-generate", "mlx-lm-batch", "mlx-lm-server", "vllm-mlx",
            "lm-studio"} <= set(names)
    for name in names:
        e = load_engine(name)
        assert e.name == name and e.source
    assert load_engine().name == "batchsim"
    assert not load_engine("mlx-lm-generate").batches


def test_unknown_engine_is_one_line_listing_the_known_ones():
    with pytest.raises(ConfigError, match="unknown engine 'nope'; known: batchsim, ") as exc:
        load_engine("nope")
    assert "\n" not in str(exc.value)
    with pytest.raises(ConfigError, match="unknown engine"):
        load_engine("../devices/linux-x86_64-openblas-2core")
    with pytest.raises(ConfigError, match="unknown engine ''"):  # `--engine ""` priced batchsim
        load_engine("")  # and recorded engine "" in the summary


@pytest.mark.parametrize("line", ["host_request_us: 2e15", "host_step_us: 1e300",
                                  "row_dispatch_forwards: 1e308", "host_token_us: -1",
                                  "host_step_us: .inf"])
def test_a_profile_file_with_a_host_cost_past_any_engine_is_one_line(tmp_path, monkeypatch,
                                                                     line):
    """h8: a request's 2e15 us (63 years) ran, and `report` then read every record as damage
    (completed 5 -> 0); 1e300 and 1e308 ran with numpy's overflow warnings and t=1.7e296 s.
    r3: one table of limits, one message whichever side of the range (was two formats)."""
    from batchsim.server.perf import engines

    (tmp_path / "mine.yaml").write_text(f"host_step_us: 1\nhost_token_us: 1\n{line}\n")
    monkeypatch.setattr(engines, "ENGINES_DIR", tmp_path)
    load_engine.cache_clear()
    try:
        key = line.split(":")[0]
        says = f"mine.yaml: {key} must be >= 0 and at most {engines.ENGINE_LIMITS[key]:g} ("
        with pytest.raises(ConfigError, match=re.escape(says)):
            load_engine("mine")
    finally:
        load_engine.cache_clear()


def test_a_profiles_own_check_says_the_bound_it_enforces():
    """r5: EngineProfile rejects only a negative or infinite cost (its copy scaled by a host_scale
    may pass the file's bound), but its message gave only the file's bound."""
    from batchsim.server.perf.engines import EngineProfile

    assert EngineProfile("e", 2e7, 1.0).host_step_us == 2e7  # past a file's 1e7: scaled
    with pytest.raises(ValueError, match=r"at most 1e\+07 \(finite once scaled by a device's "
                       r"host_scale\), got inf"):
        EngineProfile("e", float("inf"), 1.0)


@pytest.mark.parametrize("profile,dtype,quant", [(PROFILE, "float32", None),
                                                 (_mac(), "float16", 4)])
def test_new_terms_default_to_nothing(profile, dtype, quant):
    """Unset, the new parts are zero: a calibrated profile's prices are what they were."""
    t = StepCost(zoo_spec("smollm2-135m"), profile, dtype, quant).step_time(
        decode_rows=4, width=100, prefills=(PrefillChunk(9, 0, 64, True),))
    assert t.attention_rows_s == t.token_ops_s == t.sampling_s == 0
    assert t.host_step_s == t.host_token_s == 0


def test_per_row_terms_grow_with_the_rows_and_the_simulator_charges_them():
    from batchsim.server.executors.sim_executor import SimExecutor

    spec = zoo_spec("llama-3.2-1b")
    base = _mac()
    terms = {"attention_row_s": 2e-6, "token_layer_s": 1e-6, "sampling_row_s": 30e-6}
    cost = StepCost(spec, dataclasses.replace(base, **terms), "float16", 4,
                    engine=_engine(host_step_us=500, host_token_us=100, sampler="per_row"))
    plain = StepCost(spec, base, "float16", 4)
    for rows in (1, 8, 32):
        t = cost.step_time(decode_rows=rows, width=128)
        t0 = plain.step_time(decode_rows=rows, width=128)
        # Attention's fixed cost per row past the first (one row's is in the per-layer cost).
        assert t.attention_rows_s == pytest.approx((rows - 1) * spec.num_layers * 2e-6)
        assert t.token_ops_s == pytest.approx(rows * spec.num_layers * 1e-6)
        assert t.sampling_s == pytest.approx(rows * 30e-6)
        assert t.host_token_s == pytest.approx(rows * 100e-6) and t.host_step_s == 500e-6
        added = t.attention_rows_s + t.token_ops_s + t.sampling_s + t.host_token_s + t.host_step_s
        assert t.total_s == pytest.approx(t0.total_s + added, rel=1e-12)
        # The simulator's fast path charges the same step.
        charged = cost.decode_forward_s(rows, 128) + cost.step_overhead_s
        assert charged == pytest.approx(t.total_s, rel=1e-12)
    # A prefill chunk pays per-token work per token, and sampling once if it samples.
    chunk = cost.prefill_time(256, 0, True)
    assert chunk.token_ops_s == pytest.approx(256 * spec.num_layers * 1e-6)
    assert chunk.sampling_s == pytest.approx(30e-6) and chunk.host_token_s == pytest.approx(100e-6)
    assert cost.prefill_forward_s(256, 0, True) == pytest.approx(chunk.total_s, rel=1e-12)
    ex = SimExecutor(cost)
    assert ex.overhead_s == pytest.approx(500e-6)


def test_a_request_cost_is_paid_once_where_the_request_samples_its_first_token():
    """An engine's host work per request (an HTTP server's parsing, templating, tokenizing) is
    priced on the prefill chunk that samples a request's first token: once per prompt, never on
    decode steps or a long prompt's earlier chunks; the simulated run's latency grows by it."""
    from batchsim.server.perf.reference import load_published
    from batchsim.server.published import sim as ps

    spec = zoo_spec("llama-3.2-1b")
    cost = StepCost(spec, _mac(), "float16", 4, engine=_engine(host_request_us=150_000))
    plain = StepCost(spec, _mac(), "float16", 4)
    for rows in (1, 4):
        chunk = cost.prefill_time(64, 0, True, rows)
        assert chunk.host_request_s == pytest.approx(rows * 0.15)
        assert chunk.total_s == pytest.approx(plain.prefill_time(64, 0, True, rows).total_s
                                              + rows * 0.15, rel=1e-12)
        assert cost.prefill_forward_s(64, 0, True, rows) == pytest.approx(chunk.total_s)
    assert cost.prefill_time(512, 0, False).host_request_s == 0.0  # not the prompt's end
    assert cost.prefill_forward_s(512, 0, False) == plain.prefill_forward_s(512, 0, False)
    assert cost.decode_time(8, 128).host_request_s == 0.0
    assert cost.decode_forward_s(8, 128) == plain.decode_forward_s(8, 128)
    row = next(r for r in load_published().rows if r.batch == 1 and not r.decode_only)
    row = dataclasses.replace(row, model="llama-3.2-1b", weights="q4", prompt_cached=False)
    slow, fast = (ps._run(row, c).requests for c in (cost, plain))
    assert len(slow) == 1 and (slow[0].finished_s - slow[0].arrival_s) == pytest.approx(
        fast[0].finished_s - fast[0].arrival_s + 0.15, rel=1e-9)


def test_kv_read_at_its_own_efficiency():
    spec, base = zoo_spec("llama-3.2-1b"), _mac()
    slow_kv = dataclasses.replace(base, kv_bandwidth_efficiency=base.bandwidth_efficiency / 2)
    half = StepCost(spec, slow_kv, "float16", 4)
    same = StepCost(spec, base, "float16", 4)
    a, b = half.decode_time(8, 4096), same.decode_time(8, 4096)
    assert a.attention_s == pytest.approx(2 * b.attention_s)
    assert a.weights_s == b.weights_s  # the weights keep theirs


@pytest.mark.parametrize("model", ["llama-3.2-1b", "qwen3-next-80b-a3b"])
def test_an_engine_that_runs_rows_alone_prices_b_one_row_passes(model):
    spec = zoo_spec(model)
    serial = StepCost(spec, _mac(), "float16", 4, engine=load_engine("mlx-lm-generate"))
    batched = StepCost(spec, _mac(), "float16", 4)
    one = batched.decode_time(1, 512).total_s
    assert serial.decode_time(8, 512).total_s == pytest.approx(8 * one, rel=1e-12)
    assert serial.decode_forward_s(8, 512) == pytest.approx(8 * one, rel=1e-12)
    assert batched.decode_time(8, 512).total_s < 0.75 * 8 * one  # batching shares weights
    chunks = tuple(PrefillChunk(i, 0, 64, True) for i in range(3))
    assert serial.step_time(prefills=chunks).total_s == pytest.approx(
        3 * batched.prefill_time(64, 0, True).total_s, rel=1e-12)


def test_an_engine_serial_for_one_architecture_batches_the_others():
    engine = _engine(serial_model_types=("qwen3_next",))
    hybrid = StepCost(zoo_spec("qwen3-next-80b-a3b"), _mac(), "float16", 4, engine=engine)
    dense = StepCost(zoo_spec("llama-3.2-1b"), _mac(), "float16", 4, engine=engine)
    assert hybrid.serial and not dense.serial
    one = hybrid.decode_time(1, 256).total_s
    assert hybrid.decode_time(4, 256).total_s == pytest.approx(4 * one)


@pytest.mark.parametrize("model", ["llama-3.2-1b", "qwen3-30b-a3b"])
def test_one_row_graphs_evaluated_together_share_weights_and_pay_each_fixed_cost(model):
    """mlxcel-server's per-row fallback: B one-row graphs in one eval read each layer's weights
    once (as a batch) and dispatch B forwards' fixed costs."""
    spec = zoo_spec(model)
    serial = _engine(serial_model_types=(spec.model_type,))
    together = dataclasses.replace(serial, serial_rows_together=True)
    one_by_one = StepCost(spec, _mac(), "float16", 4, engine=serial)
    graphs = StepCost(spec, _mac(), "float16", 4, engine=together)
    batched = StepCost(spec, _mac(), "float16", 4)
    t, b = graphs.decode_time(4, 512), batched.decode_time(4, 512)
    assert t.fixed_s == pytest.approx(4 * b.fixed_s) and t.weights_s == b.weights_s
    # Each row's graph has its attention in its own fixed cost: no per-row attention term.
    assert t.attention_rows_s == 0
    assert t.total_s == pytest.approx(b.total_s + 3 * b.fixed_s - b.attention_rows_s)
    assert graphs.decode_forward_s(4, 512) == pytest.approx(t.total_s)
    assert b.total_s < t.total_s < one_by_one.decode_time(4, 512).total_s
    assert graphs.decode_time(1, 512) == batched.decode_time(1, 512)


def test_an_attention_loop_costs_each_row_past_the_first_its_dispatches():
    spec = zoo_spec("llama-3.2-1b")
    loop = StepCost(spec, _mac(), "float16", 4,
                    engine=_engine(attention_loop=True, row_dispatch_forwards=0.5))
    batched = StepCost(spec, _mac(), "float16", 4)
    fixed_s = batched.decode_time(1, 256).fixed_s
    assert loop.decode_time(1, 256) == batched.decode_time(1, 256)  # one row: the plain forward
    extra = loop.decode_time(8, 256).total_s - batched.decode_time(8, 256).total_s
    assert extra == pytest.approx(7 * 0.5 * fixed_s)
    assert loop.decode_forward_s(8, 256) == pytest.approx(loop.decode_time(8, 256).total_s)
    unset = StepCost(spec, _mac(), "float16", 4, engine=_engine(row_dispatch_forwards=0.5))
    assert unset.decode_time(8, 256) == batched.decode_time(8, 256)  # no loop declared


def test_an_attention_loop_repeats_each_layers_attention_not_its_moe_block():
    # lablup/mlxcel moe-batched-decode-m1ultra-2026-09-04.md (e75fa0e), section 4: the batched
    # qwen3_moe forward runs attention per sequence, router and experts once for all rows.
    spec, mac = zoo_spec("qwen3-30b-a3b"), _mac()
    loop = StepCost(spec, mac, "float16", 4,
                    engine=_engine(attention_loop=True, row_dispatch_forwards=0.5))
    batched = StepCost(spec, mac, "float16", 4)
    extra = loop.decode_time(8, 256).total_s - batched.decode_time(8, 256).total_s
    attention_layers_s = spec.num_layers * mac.layer_overhead_s + mac.forward_overhead_s
    assert extra == pytest.approx(7 * 0.5 * attention_layers_s)
    assert attention_layers_s < 0.8 * batched.decode_time(1, 256).fixed_s  # 27-kernel layers


def test_only_an_engine_sampling_per_row_pays_the_per_row_sampling_cost():
    spec = zoo_spec("qwen3-0.6b")
    mac = dataclasses.replace(_mac("M5 Max 40c"), sampling_row_s=200e-6)
    per_row = StepCost(spec, mac, "float16", 4, engine=_engine(sampler="per_row"))
    batched = StepCost(spec, mac, "float16", 4, engine=_engine(sampler="batched"))
    for rows in (1, 32):
        assert per_row.decode_time(rows, 256).sampling_s == pytest.approx(rows * 200e-6)
        assert batched.decode_time(rows, 256).sampling_s == 0.0
        assert per_row.decode_forward_s(rows, 256) == pytest.approx(
            batched.decode_forward_s(rows, 256) + rows * 200e-6)
    assert batched.prefill_time(128, 0, True).sampling_s == 0.0
    assert load_engine("batchsim").sampler == "batched"  # batchsim's own samples the batch at once
    with pytest.raises(ValueError, match="sampler must be one of batched, per_row"):
        _engine(sampler="per-row")


def test_a_row_sampled_per_row_is_priced_with_its_harness_sampler():
    from batchsim.server.perf.reference import load_published
    from batchsim.server.published.sim import MacModel

    rows = {r.id: r for r in load_published().rows}
    pristine = rows["mlxlmbatch-m5max-qwen3-0.6b-q4-b32"]
    grouped = rows["mlxlmbatch-m5max-qwen3-0.6b-q4-b32-grouped"]
    model = MacModel(load_fit())
    assert model.engine_of(pristine).sampler == "per_row"
    assert model.engine_of(grouped).sampler == "batched"
    assert load_engine("mlx-lm-batch").sampler == "batched"


def test_a_top_p_sampler_sorts_every_sampled_rows_vocabulary_batched_or_not():
    """mlx-lm's apply_top_p argsorts each row's vocabulary, one call over the batch or one per
    row: every sampled row pays its traffic (MLX's merge sort: 2048-value blocks, ceil(log2(
    blocks)) passes), so a per-row sampler differs from a batched one by its calls alone."""
    spec = zoo_spec("qwen3-0.6b")
    assert spec.vocab_size == 151936  # 75 blocks: 7 merge passes of (value, index) pairs
    assert top_p_bytes_per_logit(spec.vocab_size, 4) == 232  # float32 logits
    assert top_p_bytes_per_logit(spec.vocab_size, 2) == 172  # the model's float16/bfloat16 ones
    assert top_p_bytes_per_logit(4096, 2) - top_p_bytes_per_logit(2048, 2) == 12  # a merge pass
    mac = dataclasses.replace(_mac("M5 Max 40c"), sampling_row_s=50e-6)
    cost = {(s, p): StepCost(spec, mac, "float16", 4, engine=_engine(sampler=s, top_p=p))
            for s in ("batched", "per_row") for p in (None, 0.95, 1.0)}
    assert cost["batched", None].act_bytes == 2  # mlx-lm samples the model's dtype, uncast
    row_s = spec.vocab_size * 172 / mac.bytes_per_s  # 26.1 MB a row
    for rows in (1, 8, 32):
        t = {k: c.decode_time(rows, 256) for k, c in cost.items()}
        for s in ("batched", "per_row"):
            assert t[s, 1.0] == t[s, None]  # top_p 1: no filter, no sort
            assert t[s, 0.95].total_s == pytest.approx(t[s, None].total_s + rows * row_s)
        assert t["per_row", 0.95].total_s == pytest.approx(t["batched", 0.95].total_s
                                                           + rows * 50e-6)
    sampled = cost["batched", 0.95].prefill_time(128, 0, True).total_s
    assert sampled == pytest.approx(cost["batched", None].prefill_time(128, 0, True).total_s
                                    + row_s)  # a prefill chunk samples one row
    with pytest.raises(ValueError, match="top_p must be in"):
        _engine(top_p=0.0)


def test_a_row_sampled_with_top_p_is_priced_with_its_harness_top_p():
    from batchsim.server.perf.reference import load_published
    from batchsim.server.published.sim import MacModel

    rows = [r for r in load_published().rows if r.src == "mlx_lm_1540"]
    assert len(rows) == 4 and all("top_p 0.95" in r.note for r in rows)  # the source's setting
    model = MacModel(load_fit())
    assert all(model.engine_of(r).top_p == 0.95 for r in rows)
    assert load_engine("mlx-lm-batch").top_p is None
    # temperature 0.7, top_p 0.95 in the source; rapid-mlx sampled with mlx-lm's make_sampler
    # until its fused sampler (0.6.83, Rapid-MLX PR #542), whose passes are not priced
    readme = {(r.engine, r.engine_version): model.engine_of(r).top_p
              for r in load_published().rows if r.src == "rapid_mlx_readme_refresh"}
    assert readme == {("rapid-mlx", "0.6.80"): 0.95, ("mlx-lm-server", "0.31.3"): 0.95,
                      ("rapid-mlx", "0.6.83"): None}


def test_each_engine_read_at_its_source_says_how_it_samples():
    # mlx_lm.server (0.30.1 on) and LM Studio's batched mlx-engine insert a sampler per request
    # (mlx-lm's GenerationBatch._step then loops over rows); vllm-mlx, rapid-mlx (its
    # same-sampler fast path) and mlxcel-server (fused [B] sampling) call one over the batch.
    read = {"mlx-lm-server": "per_row", "lm-studio": "per_row", "vllm-mlx": "batched",
            "vllm-mlx-server": "batched", "rapid-mlx": "batched", "mlxcel-server": "batched",
            "mlxcel-server-p1": "batched", "mlxcel": "batched", "mlx-lm-batch": "batched",
            "xinference": "batched"}
    for name, sampler in read.items():
        assert load_engine(name).sampler == sampler, name
        assert "\nsampler: " in (ENGINES_DIR / f"{name}.yaml").read_text(), name  # stated
    mac = dataclasses.replace(_mac("M4 Max 40c"), sampling_row_s=100e-6)
    server = StepCost(zoo_spec("qwen3-0.6b"), mac, "float16", 4,
                      engine=load_engine("mlx-lm-server"))
    assert server.decode_time(8, 256).sampling_s == pytest.approx(8 * mac.sampling_row_s)


def test_an_engine_batches_an_architecture_from_the_version_that_did():
    mlxcel = load_engine("mlxcel-server")
    assert "qwen3_moe" in mlxcel.at_version("0.6.0").serial_model_types
    assert "qwen3_moe" not in mlxcel.at_version("0.7.0-beta.1").serial_model_types
    assert "qwen2" in mlxcel.at_version("0.7.0-beta.1").serial_model_types
    assert mlxcel.at_version(None) is mlxcel


def test_engine_profile_refuses_negative_costs(tmp_path):
    with pytest.raises(ValueError, match="host_token_us"):
        _engine(host_token_us=-1)


def test_size_and_sweep_price_the_engine_named_and_say_so(tmp_path, capsys):
    """`--engine` reaches both commands' one step cost: `size` at batch 1 predicts what the
    simulated sweep measures at the same context, and a serving engine's per-token host cost
    slows both; every row names its engine."""
    import argparse
    import json

    from batchsim.scripts import size
    from batchsim.scripts.cli import main

    def sweep(engine: str) -> dict:
        assert main(["sweep", "--executor", "sim", "--device-profile", "M4 Max 40c", "--model",
                     "llama-3.2-1b", "--dtype", "float16", "--quantize", "4", "--engine", engine,
                     "--batches", "1", "--prompt-len", "192", "--output-len", "64",
                     "--no-progress", "--out", str(tmp_path), "--runs-dir", str(tmp_path)]) == 0
        stdout = capsys.readouterr().out
        # the table's title names the engine, the profile and the 4-bit weights
        assert f"(float16, 4-bit weights) on sim (M4 Max 40c, engine {engine})" in stdout
        return json.loads(stdout.strip().splitlines()[-1])["rows"][0]

    def predict(engine: str) -> dict:
        parser = argparse.ArgumentParser()
        size.add_parser(parser)
        args = parser.parse_args(["--model", "llama-3.2-1b", "--quantize", "4", "--mac",
                                  "M4 Max 40c", "--memory-gb", "64", "--context", "224",
                                  "--engine", engine, "--out", str(tmp_path)])
        row = size.run(args)["rows"][0]
        assert f"engine {engine}, context 224" in capsys.readouterr().out  # the table's title
        return row

    served, plain = sweep("vllm-mlx-server"), sweep("batchsim")
    assert served["engine"] == "vllm-mlx-server" and plain["engine"] == "batchsim"
    row = predict("vllm-mlx-server")
    assert row["engine"] == "vllm-mlx-server"
    assert served["decode_tok_s"] == pytest.approx(row["decode_tok_s_b1"], rel=0.02)
    prior = load_engine("vllm-mlx-server")  # no rows of its own: its kind's pooled host costs
    host_s = 1 / served["decode_tok_s"] - 1 / plain["decode_tok_s"]  # a batch-1 step's
    assert host_s == pytest.approx((prior.host_step_us + prior.host_token_us) * 1e-6, rel=0.05)


# -- quantized ceilings (issue 36): a quantized layer's bytes at the quantized GEMV rate, its
# arithmetic at the quantized GEMM rate -----------------------------------------------------------
def test_quantized_gemm_ceiling_stops_a_quantized_batch_scaling():
    """The H200 case of issue 36: 4-bit GEMMs topping out near 5 TFLOP/s. With that ceiling,
    decode tok/s saturates near ceiling / (2 x params); without it, the float peak binds."""
    spec = zoo_spec("llama-3.1-8b")
    base = _mac()
    capped = StepCost(spec, dataclasses.replace(base, quantized_gemm_gflops={4: 5000.0}),
                      "float16", 4)
    free = StepCost(spec, base, "float16", 4)
    tok_s = {b: b / capped.step_time(decode_rows=b, width=128).total_s for b in (1, 32, 128, 512)}
    assert tok_s[512] / tok_s[128] < 1.1  # stopped scaling
    flops_per_token = 2 * sum(o * i for o, i in spec.layer_linear_shapes) * spec.num_layers
    assert tok_s[512] < 5e12 / flops_per_token
    assert capped.step_time(decode_rows=512, width=128).matmul_s > 2 * free.step_time(
        decode_rows=512, width=128).matmul_s
    # Batch 1 streams bytes: the GEMM ceiling does not touch it; a GEMV ceiling does.
    assert capped.decode_time(1, 128).total_s == free.decode_time(1, 128).total_s
    gemv = StepCost(spec, dataclasses.replace(base, quantized_gemv_gbs={4: base.bytes_per_s / 2e9}),
                    "float16", 4)
    assert gemv.decode_time(1, 128).weights_s == pytest.approx(
        2 * free.decode_time(1, 128).weights_s)
    # Another bit width, or float weights, keep the float ceilings.
    assert StepCost(spec, capped.profile, "float16", 8).matmul_rates == StepCost(
        spec, base, "float16", 8).matmul_rates
    float_rates = StepCost(spec, capped.profile, "float16", None).matmul_rates
    assert float_rates[1] == base.flops_per_s("float16")


def test_quantized_ceilings_price_routed_experts():
    spec = zoo_spec("qwen3-30b-a3b")
    base = _mac()
    capped = StepCost(spec, dataclasses.replace(base, quantized_gemm_gflops={4: 2000.0},
                                                quantized_gemv_gbs={4: 100.0}), "float16", 4)
    free = StepCost(spec, base, "float16", 4)
    assert capped.decode_time(1, 128).experts_s > 2 * free.decode_time(1, 128).experts_s
    assert capped.decode_time(256, 128).experts_s > 2 * free.decode_time(256, 128).experts_s


def test_a_calibrated_profile_prices_quantized_weights_at_its_ceilings(tmp_path):
    """The CPU profile calibrated float32 only: quantized weights were an error; with measured
    quantized rates in its YAML (as `calibrate` writes them) they are priced at those rates,
    routed experts' weights included."""
    import yaml
    from batchsim.server.perf.devices import load_profile, save_profile

    with pytest.raises(ValueError, match="no GEMM calibration for q4"):
        StepCost(zoo_spec("smollm2-135m"), PROFILE, "float16", 4)
    path = save_profile(dataclasses.replace(PROFILE, quantized_gemv_gbs={4: 20.0, 8: 25.0},
                                            quantized_gemm_gflops={4: 50.0}), tmp_path / "q.yaml")
    assert yaml.safe_load(path.read_text())["quantized_gemv_gbs"] == {4: 20.0, 8: 25.0}
    profile = load_profile(path)
    assert profile.quantized_gemv_gbs == {4: 20.0, 8: 25.0}
    cost = StepCost(zoo_spec("smollm2-135m"), profile, "float16", 4)
    assert cost.matmul_rates == (20e9, 50e9)
    t = cost.decode_time(1, 64)
    assert t.matmul_s > 0 and t.weights_s == 0  # 50 GFLOP/s binds even one row here
    moe = StepCost(zoo_spec("tiny-moe"), profile, "float16", 4)  # experts_ns_per_mac is set
    assert moe.weight_stream_s(64, 128) == pytest.approx(matrix_weight_bytes("q4", 64, 128) / 20e9)
    slower = StepCost(zoo_spec("tiny-moe"), dataclasses.replace(
        profile, quantized_gemv_gbs={4: 10.0}), "float16", 4)
    assert slower.decode_time(1, 64).experts_s > moe.decode_time(1, 64).experts_s


def test_run_config_takes_an_engine_and_a_simulated_run_names_it(tmp_path, capsys):
    import json

    from batchsim.scripts.cli import main
    from batchsim.server.engine.run_config import RunConfig

    with pytest.raises(ConfigError, match="unknown engine 'nope'; known: "):
        RunConfig(engine="nope")
    rates = {}
    for engine in ("batchsim", "mlx-lm-generate"):
        assert main(["run", "--executor", "sim", "--device-profile", "M4 Max", "--model",
                     "llama-3.2-1b", "--dtype", "float16", "--engine", engine,
                     "--num-prompts", "8", "--request-rate", "inf", "--input-len", "64",
                     "--output-len", "32", "--no-progress", "--out", str(tmp_path)]) == 0
        captured = capsys.readouterr()
        summary = json.loads(captured.out.strip().splitlines()[-1])
        assert summary["engine"] == engine
        assert f"on sim (M4 Max, engine {engine}), workload" in captured.err  # the header line
        rates[engine] = summary["output_throughput"]
    assert rates["mlx-lm-generate"] < rates["batchsim"] / 2  # 8 rows at once, priced one by one


@pytest.mark.parametrize("input_len", ["64", "1"])  # 1: joins the decode pool, no prefill
def test_a_simulated_run_puts_an_engines_request_cost_in_ttft(tmp_path, capsys, monkeypatch,
                                                              input_len):
    """`run --executor sim --engine NAME` with a profile of one's own server carrying a cost per
    request: each request's TTFT grows by it, and nothing else does (before 11e4777 a one-token
    prompt, whose first token its decode row samples, paid none)."""
    import json

    import yaml
    from batchsim.scripts.cli import main
    from batchsim.server.perf import engines

    mine = tmp_path / "engines"
    mine.mkdir()
    base = yaml.safe_load((ENGINES_DIR / "batchsim.yaml").read_text())
    (mine / "batchsim.yaml").write_text(yaml.safe_dump(base))
    (mine / "my-server.yaml").write_text(yaml.safe_dump({**base, "host_request_us": 200_000}))
    monkeypatch.setattr(engines, "ENGINES_DIR", mine)
    load_engine.cache_clear()
    got = {}
    try:
        for engine in ("batchsim", "my-server"):
            out = tmp_path / engine
            assert main(["run", "--executor", "sim", "--device-profile", "M4 Max", "--model",
                         "llama-3.2-1b", "--dtype", "float16", "--engine", engine, "--num-prompts",
                         "1", "--input-len", input_len, "--output-len", "16", "--no-progress",
                         "--out", str(out)]) == 0
            capsys.readouterr()
            runs = list(out.rglob("requests.jsonl"))
            got[engine] = json.loads(runs[0].read_text().splitlines()[0])
    finally:  # no profile read from tmp_path stays cached, whatever failed
        load_engine.cache_clear()
    slow, fast = got["my-server"], got["batchsim"]
    assert slow["ttft_ms"] == pytest.approx(fast["ttft_ms"] + 200.0, rel=1e-6)
    assert slow["e2el_ms"] - slow["ttft_ms"] == pytest.approx(fast["e2el_ms"] - fast["ttft_ms"])


def test_compare_names_the_engine_it_simulated(tmp_path, capsys):
    import json

    from batchsim.scripts.cli import main

    assert main(["compare", "--executor", "sim", "--device-profile", "M4 Max", "--model",
                 "llama-3.2-1b", "--dtype", "float16", "--quantize", "4", "--engine",
                 "mlx-lm-generate", "--batch", "4", "--num-prompts", "4", "--input-len", "64",
                 "--output-len", "8", "--out", str(tmp_path), "--runs-dir", str(tmp_path),
                 "--no-timeline"]) == 0
    captured = capsys.readouterr()
    # the table's heading names the 4-bit weights too (it said "(float16)" alone)
    assert ("(float16, 4-bit weights) on sim (M4 Max, engine mlx-lm-generate), workload"
            in captured.out)
    assert "on sim (M4 Max, engine mlx-lm-generate), workload" in captured.err  # the opening line
    result = json.loads(captured.out.strip().splitlines()[-1])
    assert result["batch1"]["engine"] == result["batched"]["engine"] == "mlx-lm-generate"


def test_the_mac_fit_carries_the_new_terms_to_every_mac():
    """GpuFit (configs/reference/mlx-fit.yaml) is where a fit sets them: each reaches a catalog
    Mac's profile and its step; an out-of-range fraction is refused."""
    mac, _ = macs.load_catalog().variant("M4 Max 40c")
    fit = dataclasses.replace(load_fit(), attention_row_us=1.5, token_layer_us=0.25,
                              sampling_row_us=40.0, kv_bandwidth_efficiency=0.5,
                              quantized_gemm_efficiency={4: 0.25})
    profile = mac_profile(mac, fit, 4)
    assert profile.quantized_gemm_gflops == {4: pytest.approx(0.25 * mac.fp16_tflops * 1e3)}
    assert profile.kv_bytes_per_s == pytest.approx(0.5 * mac.bw_gbs * 1e9)
    spec = zoo_spec("llama-3.2-1b")
    t = StepCost(spec, profile, "float16", 4, engine=_engine(sampler="per_row")).step_time(
        decode_rows=8, width=128)
    assert t.attention_rows_s == pytest.approx(7 * spec.num_layers * 1.5e-6)
    assert t.token_ops_s == pytest.approx(8 * spec.num_layers * 0.25e-6)
    assert t.sampling_s == pytest.approx(8 * 40e-6)
    assert "attention 1.50 us/row/layer" in fit.summary() and "q4 GEMM 0.25" in fit.summary()
    with pytest.raises(ValueError, match="kv_bandwidth_efficiency"):
        dataclasses.replace(fit, kv_bandwidth_efficiency=1.5)


def test_the_explain_line_says_what_the_engine_batches():
    """size --explain's engine line: mlxcel-server evaluates one-row graphs together (not one row
    at a time), an engine without that runs them one by one, mlx-lm's generate one request."""
    note = load_engine("mlxcel-server").batching_note()
    assert "qwen2, qwen3_moe as one-row graphs evaluated together" in note
    assert "one row at a time" not in note
    assert "attention one sequence at a time" in note
    assert _engine(serial_model_types=("qwen2",)).batching_note() == \
        "; qwen2 one row at a time"
    assert load_engine("mlx-lm-generate").batching_note() == "; runs one request at a time"


def test_an_engine_kind_is_server_library_or_none():
    assert _engine(kind="server").kind == "server" and _engine().kind == ""
    with pytest.raises(ValueError, match="kind must be one of"):
        _engine(kind="daemon")
    kinds = {n: load_engine(n).kind for n in engine_names()}
    assert kinds["mlx-lm-server"] == "server" and kinds["mlx-lm-batch"] == "library"
    assert kinds["batchsim"] == "" and kinds["mlx-lm-generate"] == ""


def test_a_real_run_refuses_another_engines_name(tmp_path, capsys):
    """A real in-process run measures batchsim's own engine: naming another one recorded that
    name in the summary; now it is a one-line error before anything loads (the simulator, or a
    --target server, may carry it)."""
    from batchsim.server.engine.run_config import ConfigError, RunConfig

    with pytest.raises(ConfigError, match="--executor sim"):
        RunConfig(model="smollm2-135m", engine="mlx-lm-server")
    RunConfig(model="smollm2-135m", engine="mlx-lm-server", executor="sim")
    RunConfig(model="smollm2-135m", engine="mlx-lm-server", target="http://127.0.0.1:9/v1")


def test_host_work_scales_with_the_macs_cpu_generation():
    """GpuFit.cpu_exponent: the fixed costs per layer and per forward, per-row sampling and the
    engine's host costs take (1 / cpu_speed) ** exponent as long on a catalog Mac, cpu_speed its
    CPU generation's Geekbench 6 single-core score over the M4's (configs/macs.yaml)."""
    catalog = macs.load_catalog()
    scores = catalog.cpu_single_core.scores
    m1, _ = catalog.variant("M1 Ultra 64c")
    m4, _ = catalog.variant("M4 Max 40c")
    assert m1.cpu_speed == pytest.approx(scores["M1"] / scores["M4"]) and m4.cpu_speed == 1.0
    fit = dataclasses.replace(load_fit(), cpu_exponent=2.0, sampling_row_us=50.0,
                              ultra_layer_us=0.0)
    flat = dataclasses.replace(fit, cpu_exponent=0.0)
    slow = (scores["M4"] / scores["M1"]) ** 2
    p1, p0 = mac_profile(m1, fit, 4), mac_profile(m1, flat, 4)
    assert p1.layer_overhead_s == pytest.approx(slow * p0.layer_overhead_s)
    assert p1.sampling_row_s == pytest.approx(slow * p0.sampling_row_s)
    assert mac_profile(m4, fit, 4).layer_overhead_s == mac_profile(m4, flat, 4).layer_overhead_s
    engine = load_engine("mlx-lm-server")
    on_m1 = StepCost(zoo_spec("qwen3-0.6b"), p1, "float16", 4, engine=engine)
    assert on_m1.engine.host_token_us == pytest.approx(slow * engine.host_token_us)
    assert on_m1.step_overhead_s == pytest.approx(slow * engine.host_step_s)
    # A draft model priced beside the target runs on the same CPU: scaled once, not twice.
    from batchsim.server.perf.spec_price import model_drafter
    draft = model_drafter(on_m1, zoo_spec("qwen3-0.6b"), "float16").cost
    assert draft.engine.host_token_us == pytest.approx(on_m1.engine.host_token_us)


def test_a_preempted_request_pays_its_request_cost_once():
    """host_request_us is paid where a request samples its first token, not again when it was
    preempted and its recompute's last chunk samples (the scheduler marks that chunk not fresh),
    in step_time and the simulator's fast path alike."""
    from batchsim.scheduler.pool_geometry import KV_STEP
    from batchsim.scheduler.scheduler import Scheduler
    from batchsim.server.executors.fake_executor import FakeExecutor

    from tests.drivers import config, drive, make_request

    s = Scheduler(config(kv_budget_bytes=512 * 3 * KV_STEP, max_num_seqs=2, row_step=1))
    old, new = make_request(1, 200, 100), make_request(2, 200, 100)
    trace = drive(s, FakeExecutor(), [(0, old), (0, new)])
    assert new.num_preemptions >= 1
    sampling = [c for p in trace.plans for c in p.prefills if c.sample]
    fresh = [c.fresh for c in sampling if c.request_id == 2]
    assert fresh[0] and len(fresh) >= 2 and not any(fresh[1:])  # first, then recomputes
    spec = zoo_spec("llama-3.2-1b")
    cost = StepCost(spec, _mac(), "float16", 4, engine=_engine(host_request_us=150_000))
    plain = StepCost(spec, _mac(), "float16", 4)
    paid = sum(cost.step_time(len(p.decode_ids), 256, p.prefills).host_request_s
               for p in trace.plans)
    assert paid == pytest.approx(2 * 0.15)  # two requests, one recompute not charged
    assert cost.prefill_forward_s(64, 0, True, 1, 0) == pytest.approx(
        plain.prefill_forward_s(64, 0, True), rel=1e-12)
    assert cost.prefill_time(64, 0, True, 3, 1).host_request_s == pytest.approx(0.15)
    from batchsim.server.perf.step_time import StepTime
    from batchsim.server.published.sim import _add_prefills, _steps_of

    zero = StepTime(0.0, 0.0, 0.0, 0.0, 0.0, 0.0)
    fit = sum((_add_prefills(zero, cost, _steps_of(p, 1)) for p in trace.plans), zero)
    assert fit.host_request_s == pytest.approx(2 * 0.15)  # the fit's closed loops: as the run
    assert cost.prefill_forward_s(64, 0, True, 3, 1) == pytest.approx(
        plain.prefill_forward_s(64, 0, True, 3) + 0.15, rel=1e-12)


def test_a_one_token_prompt_pays_its_request_cost_once():
    """A one-token prompt joins the decode pool with no prefill chunk: its decode row samples its
    first token and pays host_request_us there, once, in the simulator and the fit alike."""
    from batchsim.scheduler.scheduler import Scheduler
    from batchsim.server.executors.fake_executor import FakeExecutor
    from batchsim.server.executors.sim_executor import SimExecutor
    from batchsim.server.perf.step_time import StepTime
    from batchsim.server.published.sim import _add_prefills, _steps_of

    from tests.drivers import config, drive, make_request

    trace = drive(Scheduler(config()), FakeExecutor(),
                  [(0, make_request(1, 64, 8)), (1, make_request(2, 1, 8))])
    assert not any(c.request_id == 2 for p in trace.plans for c in p.prefills)
    assert sum(p.num_joined_directly for p in trace.plans) == 1
    spec = zoo_spec("llama-3.2-1b")
    cost = StepCost(spec, _mac(), "float16", 4, engine=_engine(host_request_us=150_000))
    plain = StepCost(spec, _mac(), "float16", 4)
    slow, fast = SimExecutor(cost), SimExecutor(plain)
    extra_s = sum(slow.execute(p).elapsed_s - fast.execute(p).elapsed_s for p in trace.plans)
    assert extra_s == pytest.approx(2 * 0.15)  # two requests, each once
    zero = StepTime(0.0, 0.0, 0.0, 0.0, 0.0, 0.0)
    fit = sum((_add_prefills(zero, cost, _steps_of(p, 1)) for p in trace.plans), zero)
    assert fit.host_request_s == pytest.approx(2 * 0.15)
