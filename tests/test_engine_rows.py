"""The step's per-row terms and how each engine batches and samples its rows: each term prices
what it names and the simulator charges what `step_time` says (split from test_engines.py)."""

from __future__ import annotations

import dataclasses

import pytest
from batchsim.scheduler.plan import PrefillChunk
from batchsim.server.models.spec import zoo_spec
from batchsim.server.perf.engines import (
    ENGINES_DIR,
    TOP_P_CODES,
    load_engine,
    top_p_bytes_per_logit,
)
from batchsim.server.perf.gpu_fit import load_fit
from batchsim.server.perf.stepcost import StepCost

from tests.engine_profiles import bare_mac, host_engine


def test_per_row_terms_grow_with_the_rows_and_the_simulator_charges_them():
    from batchsim.server.executors.sim_executor import SimExecutor

    spec = zoo_spec("llama-3.2-1b")
    base = bare_mac()
    terms = {"attention_row_s": 2e-6, "token_layer_s": 1e-6, "sampling_row_s": 30e-6}
    cost = StepCost(spec, dataclasses.replace(base, **terms), "float16", 4,
                    engine=host_engine(host_step_us=500, host_token_us=100, sampler="per_row"))
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
    cost = StepCost(spec, bare_mac(), "float16", 4, engine=host_engine(host_request_us=150_000))
    plain = StepCost(spec, bare_mac(), "float16", 4)
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
    spec, base = zoo_spec("llama-3.2-1b"), bare_mac()
    slow_kv = dataclasses.replace(base, kv_bandwidth_efficiency=base.bandwidth_efficiency / 2)
    half = StepCost(spec, slow_kv, "float16", 4)
    same = StepCost(spec, base, "float16", 4)
    a, b = half.decode_time(8, 4096), same.decode_time(8, 4096)
    assert a.attention_s == pytest.approx(2 * b.attention_s)
    assert a.weights_s == b.weights_s  # the weights keep theirs


@pytest.mark.parametrize("model", ["llama-3.2-1b", "qwen3-next-80b-a3b"])
def test_an_engine_that_runs_rows_alone_prices_b_one_row_passes(model):
    spec = zoo_spec(model)
    serial = StepCost(spec, bare_mac(), "float16", 4, engine=load_engine("mlx-lm-generate"))
    batched = StepCost(spec, bare_mac(), "float16", 4)
    one = batched.decode_time(1, 512).total_s
    assert serial.decode_time(8, 512).total_s == pytest.approx(8 * one, rel=1e-12)
    assert serial.decode_forward_s(8, 512) == pytest.approx(8 * one, rel=1e-12)
    assert batched.decode_time(8, 512).total_s < 0.75 * 8 * one  # batching shares weights
    chunks = tuple(PrefillChunk(i, 0, 64, True) for i in range(3))
    assert serial.step_time(prefills=chunks).total_s == pytest.approx(
        3 * batched.prefill_time(64, 0, True).total_s, rel=1e-12)


def test_an_engine_serial_for_one_architecture_batches_the_others():
    engine = host_engine(serial_model_types=("qwen3_next",))
    hybrid = StepCost(zoo_spec("qwen3-next-80b-a3b"), bare_mac(), "float16", 4, engine=engine)
    dense = StepCost(zoo_spec("llama-3.2-1b"), bare_mac(), "float16", 4, engine=engine)
    assert hybrid.serial and not dense.serial
    one = hybrid.decode_time(1, 256).total_s
    assert hybrid.decode_time(4, 256).total_s == pytest.approx(4 * one)


@pytest.mark.parametrize("model", ["llama-3.2-1b", "qwen3-30b-a3b"])
def test_one_row_graphs_evaluated_together_share_weights_and_pay_each_fixed_cost(model):
    """mlxcel-server's per-row fallback: B one-row graphs in one eval read each layer's weights
    once (as a batch) and dispatch B forwards' fixed costs."""
    spec = zoo_spec(model)
    serial = host_engine(serial_model_types=(spec.model_type,))
    together = dataclasses.replace(serial, serial_rows_together=True)
    one_by_one = StepCost(spec, bare_mac(), "float16", 4, engine=serial)
    graphs = StepCost(spec, bare_mac(), "float16", 4, engine=together)
    batched = StepCost(spec, bare_mac(), "float16", 4)
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
    loop = StepCost(spec, bare_mac(), "float16", 4,
                    engine=host_engine(attention_loop=True, row_dispatch_forwards=0.5))
    batched = StepCost(spec, bare_mac(), "float16", 4)
    fixed_s = batched.decode_time(1, 256).fixed_s
    assert loop.decode_time(1, 256) == batched.decode_time(1, 256)  # one row: the plain forward
    extra = loop.decode_time(8, 256).total_s - batched.decode_time(8, 256).total_s
    assert extra == pytest.approx(7 * 0.5 * fixed_s)
    assert loop.decode_forward_s(8, 256) == pytest.approx(loop.decode_time(8, 256).total_s)
    unset = StepCost(spec, bare_mac(), "float16", 4, engine=host_engine(row_dispatch_forwards=0.5))
    assert unset.decode_time(8, 256) == batched.decode_time(8, 256)  # no loop declared


def test_an_attention_loop_repeats_each_layers_attention_not_its_moe_block():
    # lablup/mlxcel moe-batched-decode-m1ultra-2026-09-04.md (e75fa0e), section 4: the batched
    # qwen3_moe forward runs attention per sequence, router and experts once for all rows.
    spec, mac = zoo_spec("qwen3-30b-a3b"), bare_mac()
    loop = StepCost(spec, mac, "float16", 4,
                    engine=host_engine(attention_loop=True, row_dispatch_forwards=0.5))
    batched = StepCost(spec, mac, "float16", 4)
    extra = loop.decode_time(8, 256).total_s - batched.decode_time(8, 256).total_s
    attention_layers_s = spec.num_layers * mac.layer_overhead_s + mac.forward_overhead_s
    assert extra == pytest.approx(7 * 0.5 * attention_layers_s)
    assert attention_layers_s < 0.8 * batched.decode_time(1, 256).fixed_s  # 27-kernel layers


def test_only_an_engine_sampling_per_row_pays_the_per_row_sampling_cost():
    spec = zoo_spec("qwen3-0.6b")
    mac = dataclasses.replace(bare_mac("M5 Max 40c"), sampling_row_s=200e-6)
    per_row = StepCost(spec, mac, "float16", 4, engine=host_engine(sampler="per_row"))
    batched = StepCost(spec, mac, "float16", 4, engine=host_engine(sampler="batched"))
    for rows in (1, 32):
        assert per_row.decode_time(rows, 256).sampling_s == pytest.approx(rows * 200e-6)
        assert batched.decode_time(rows, 256).sampling_s == 0.0
        assert per_row.decode_forward_s(rows, 256) == pytest.approx(
            batched.decode_forward_s(rows, 256) + rows * 200e-6)
    assert batched.prefill_time(128, 0, True).sampling_s == 0.0
    assert load_engine("batchsim").sampler == "batched"  # batchsim's own samples the batch at once
    with pytest.raises(ValueError, match="sampler must be one of batched, per_row"):
        host_engine(sampler="per-row")


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
    assert top_p_bytes_per_logit(spec.vocab_size, "float32") == 232  # float32 logits
    assert top_p_bytes_per_logit(spec.vocab_size, "float16") == 172  # the model's 2-byte ones
    assert top_p_bytes_per_logit(spec.vocab_size, "bfloat16") == 172
    merge = top_p_bytes_per_logit(4096, "float16") - top_p_bytes_per_logit(2048, "float16")
    assert merge == 12  # a merge pass
    mac = dataclasses.replace(bare_mac("M5 Max 40c"), sampling_row_s=50e-6)
    cost = {(s, p): StepCost(spec, mac, "float16", 4, engine=host_engine(sampler=s, top_p=p))
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
        host_engine(top_p=0.0)


def test_a_top_p_samplers_bytes_are_their_own_part_at_their_own_rate():
    """A top-p sampler's passes are StepTime.top_p_s, their bytes at the peak bandwidth times the
    fit's slowdown (GpuFit.top_p_slowdown; 0: at the elementwise rate, as before), and nothing
    else in the step moves."""
    spec = zoo_spec("qwen3-0.6b")
    plain = bare_mac("M5 Max 40c")
    slowed = dataclasses.replace(plain, top_p_slowdown=4.0)
    peak = plain.bandwidth_gbs * 1e9
    row_bytes = spec.vocab_size * top_p_bytes_per_logit(spec.vocab_size, "float16")
    cost = {(mac.top_p_slowdown, p): StepCost(spec, mac, "float16", 4,
                                              engine=host_engine(top_p=p))
            for mac in (plain, slowed) for p in (None, 0.95)}
    for rows in (1, 32):
        t = {k: c.decode_time(rows, 256) for k, c in cost.items()}
        assert t[0.0, None].top_p_s == t[4.0, None].top_p_s == 0.0
        assert t[0.0, 0.95].top_p_s == pytest.approx(rows * row_bytes / plain.bytes_per_s)
        assert t[4.0, 0.95].top_p_s == pytest.approx(rows * row_bytes * 4.0 / peak)
        for k in ((0.0, 0.95), (4.0, 0.95)):  # the rest of the step as without a sampler
            assert t[k].total_s - t[k].top_p_s == pytest.approx(t[k[0], None].total_s)
            assert cost[k].decode_forward_s(rows, 256) == pytest.approx(t[k].total_s)
    chunk = cost[4.0, 0.95].prefill_time(128, 0, True)  # a chunk that samples: one row's
    assert chunk.top_p_s == pytest.approx(row_bytes * 4.0 / peak)
    assert cost[4.0, 0.95].prefill_time(128, 0, False).top_p_s == 0.0
    assert cost[4.0, 0.95].prefill_forward_s(128, 0, True) == pytest.approx(chunk.total_s)
    assert load_fit().top_p_slowdown >= 1.0  # fitted (published.fit's "top_p" column)


def test_a_calibrated_device_prices_a_top_p_samplers_bytes_at_its_measured_rate():
    """A calibrated device measured its own elementwise rate: StepCost.top_p_s prices the
    sampler's bytes there, not at a fitted top_p_slowdown it also carries."""
    from tests.sim_profile import PROFILE

    spec = zoo_spec("smollm2-135m")
    slowed = dataclasses.replace(PROFILE, top_p_slowdown=4.0)
    cost = StepCost(spec, slowed, "float32", None, engine=host_engine(top_p=0.95))
    row_bytes = spec.vocab_size * top_p_bytes_per_logit(spec.vocab_size, "float32")
    ns_per_byte = PROFILE.calibration.elementwise_ns_per_byte
    for rows in (1, 8):
        assert cost.decode_time(rows, 64).top_p_s == pytest.approx(
            rows * row_bytes * ns_per_byte * 1e-9)


def test_a_row_sampled_with_top_p_is_priced_with_its_harness_top_p():
    from batchsim.server.perf.reference import load_published
    from batchsim.server.published.sim import MacModel

    rows = [r for r in load_published().rows if r.src == "mlx_lm_1540"]
    assert len(rows) == 4 and all("top_p 0.95" in r.note for r in rows)  # the source's setting
    model = MacModel(load_fit())
    assert all(model.engine_of(r).top_p == 0.95 for r in rows)
    assert load_engine("mlx-lm-batch").top_p is None
    # temperature 0.7, top_p 0.95 in the source; rapid-mlx sampled with mlx-lm's make_sampler
    # until its fused sampler (0.6.83, Rapid-MLX PR #542), priced by its own passes
    readme = {(r.engine, r.engine_version): (model.engine_of(r).top_p,
                                             model.engine_of(r).top_p_code)
              for r in load_published().rows if r.src == "rapid_mlx_readme_refresh"}
    assert readme == {("rapid-mlx", "0.6.80"): (0.95, "mlx-lm"),
                      ("mlx-lm-server", "0.31.3"): (0.95, "mlx-lm"),
                      ("rapid-mlx", "0.6.83"): (0.95, "rapid-mlx-fused")}


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
    mac = dataclasses.replace(bare_mac("M4 Max 40c"), sampling_row_s=100e-6)
    server = StepCost(zoo_spec("qwen3-0.6b"), mac, "float16", 4,
                      engine=load_engine("mlx-lm-server"))
    assert server.decode_time(8, 256).sampling_s == pytest.approx(8 * mac.sampling_row_s)


def test_an_engine_batches_an_architecture_from_the_version_that_did():
    mlxcel = load_engine("mlxcel-server")
    assert "qwen3_moe" in mlxcel.at_version("0.6.0").serial_model_types
    assert "qwen3_moe" not in mlxcel.at_version("0.7.0-beta.1").serial_model_types
    assert "qwen2" in mlxcel.at_version("0.7.0-beta.1").serial_model_types
    assert mlxcel.at_version(None) is mlxcel
    # mlx_lm.server merged qwen3_next's MambaCache wrongly until PR #842 (v0.30.6)
    server = load_engine("mlx-lm-server")
    assert "qwen3_next" in server.at_version("0.30.5").serial_model_types
    assert "qwen3_next" not in server.at_version("0.31.3").serial_model_types


def test_each_top_p_sampler_is_priced_by_its_own_code_at_the_version_run():
    """mlx-swift-lm's TopPSampler (ekryski's fork) and Rapid-MLX's fused sampler (0.6.83, PR
    #542) sort float32 (the fork casts only bfloat16 to it, Rapid-MLX every non-float32 dtype) and
    run uncompiled: more passes than mlx-lm's compiled chain, each counted
    from its source. A qwen3 row (151,936 logits: 7 merge passes) of bfloat16 logits:"""
    from batchsim.server.perf.reference import load_published
    from batchsim.server.published.sim import MacModel

    vocab = zoo_spec("qwen3-0.6b").vocab_size
    sort32 = (4 + 8) + 7 * 2 * 8 + 2 * 4  # float32 values and uint32 indices: 132 bytes
    cast = 2 + 4  # the bfloat16 logits read, float32 written
    categorical = 19 * 4 + 2 * 4  # MLX's categorical uncompiled: 84 bytes
    assert top_p_bytes_per_logit(vocab, "bfloat16") == 172  # mlx-lm's, as before
    assert top_p_bytes_per_logit(vocab, "bfloat16", TOP_P_CODES["mlx-swift-lm"]) == (
        cast + sort32 + 18 * 4 + 2 * 4 + 2 + categorical)  # 304
    assert top_p_bytes_per_logit(vocab, "bfloat16", TOP_P_CODES["rapid-mlx-fused"]) == (
        cast + sort32 + 13 * 4 + 4 * 4 + 6 + categorical)  # 296
    assert top_p_bytes_per_logit(vocab, "float32", TOP_P_CODES["rapid-mlx-fused"]) == 296 - cast
    # TopPSampler casts only bfloat16 (Evaluate.swift:328): float16 logits are sorted and worked
    # in float16, no cast; Rapid-MLX casts every non-float32 input.
    sort16 = (2 + 6) + 7 * 2 * 6 + 2 * 4
    assert top_p_bytes_per_logit(vocab, "float16", TOP_P_CODES["mlx-swift-lm"]) == (
        sort16 + 37 * 2 + 4 * 4 + 2)  # 192
    assert top_p_bytes_per_logit(vocab, "float16", TOP_P_CODES["rapid-mlx-fused"]) == 296

    # The fork's defaults (temperature 0.6, topP 1.0) sort nothing; its harness's GPT-OSS family
    # runs top-p 0.8 (ModelRegistry.swift:259): the rows carry it, priced by the fork's code.
    fork = load_engine("mlx-swift-lm-fork")
    assert (fork.top_p, fork.top_p_code) == (None, "mlx-swift-lm")
    assert fork.sampler_bytes_per_logit(vocab, "bfloat16") == 0
    model = MacModel(load_fit())
    rows = [r for r in load_published().rows if r.src == "ekryski_batched_sweep"]
    assert len(rows) == 8 and all(r.top_p == 0.8 for r in rows)
    assert all(model.engine_of(r).sampler_bytes_per_logit(vocab, "bfloat16") == 304 for r in rows)
    # their q4 model computes in its scales' float16 here (profile.compute_dtype): no cast
    assert all(model.engine_of(r).sampler_bytes_per_logit(vocab, "float16") == 192 for r in rows)
    rapid = load_engine("rapid-mlx")
    assert rapid.at_version("0.6.80").top_p_code == "mlx-lm"  # mlx-lm's chain until 0.6.82
    for version in ("0.6.83", "0.7.26", "0.10.5", None):
        assert rapid.at_version(version).top_p_code == "rapid-mlx-fused"
    assert dataclasses.replace(rapid.at_version("0.6.83"), top_p=0.95).sampler_bytes_per_logit(
        vocab, "bfloat16") == 296
    assert rapid.sampler_bytes_per_logit(vocab, "bfloat16") == 0  # no top-p stated: none priced
    with pytest.raises(ValueError, match="top_p_code must be one of"):
        host_engine(top_p_code="vllm")
    for junk in ("abc", "0.6.83x/../", "1 or later", "v0.6.83"):  # () would never gate; the
        # next two were accepted (re.match, unanchored); 'v' is not part of a version here
        with pytest.raises(ValueError, match="top_p_code_since must be a version"):
            host_engine(top_p_code="rapid-mlx-fused", top_p_code_since=junk)
    for version in ("0.6.83", "0.7.0-beta.1", "1.2+local"):
        assert host_engine(top_p_code="rapid-mlx-fused", top_p_code_since=version)
