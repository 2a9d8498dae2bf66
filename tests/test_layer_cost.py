"""The performance model's one per-layer path: MoE reads the expected distinct experts, sliding
layers read at most their window, linear-attention layers their fixed state, MLA its latent; the
parts add up (and to what a simulated step would charge); dense is the case "every layer alike,
full attention" and prices as it always did."""

from __future__ import annotations

import math

import pytest
from batchsim.scheduler.plan import PrefillChunk
from batchsim.server.models.spec import zoo_spec
from batchsim.server.perf.batch_gain import batching_curve, catalog_cost
from batchsim.server.perf.layer_cost import expected_experts, paged_read_ratio
from batchsim.server.perf.stepcost import StepCost, StepTime
from batchsim.server.perf.weight_bytes import weight_bytes_per_element

from tests.sim_profile import PROFILE

NON_DENSE = ("qwen3-30b-a3b", "gpt-oss-20b", "gpt-oss-120b", "gemma-3-27b", "qwen3-next-80b-a3b",
             "deepseek-v3")
TINY = ("tiny-moe", "tiny-sliding", "tiny-hybrid", "tiny-mla")


def _layer(spec, kind):
    return next(lay for lay in spec.arch.layers if lay.attention.kind == kind)


def test_expected_distinct_experts_for_128_choose_8():
    got = [round(expected_experts(128, 8, b)) for b in (1, 4, 8, 16, 32, 64)]
    assert got == [8, 29, 52, 82, 112, 126]
    assert expected_experts(128, 8, 1) == pytest.approx(8)  # one token: exactly its top_k
    assert expected_experts(32, 4, 10_000) == pytest.approx(32)  # many tokens: every expert


def test_moe_batch_1_reads_top_k_experts_by_hand():
    cost = catalog_cost("qwen3-30b-a3b")
    spec, bpe = cost.spec, weight_bytes_per_element("q4")
    # Batch 1 streams its 8 experts' gate/up/down (768 x 2048 each) per MoE layer.
    moe_layers = sum(lay.ffn.kind == "moe" for lay in spec.arch.layers)
    nbytes = moe_layers * 8 * 3 * (768 * 2048 * bpe + (768 + 2048) * cost.act_bytes)
    # ... at the experts' share of the achievable bandwidth (gathered mat-vecs, fitted on Macs).
    rate = cost.profile.bytes_per_s * cost.profile.expert_bandwidth_efficiency
    assert cost.decode_time(1, 512).experts_s == pytest.approx(nbytes / rate)
    # 32 rows read the ~112 distinct experts they route to, not 32 x 8.
    ratio = cost.decode_time(32, 512).experts_s / cost.decode_time(1, 512).experts_s
    assert 112 / 8 * 0.95 < ratio < 32


def test_sliding_layers_read_at_most_their_window():
    cost = catalog_cost("gemma-3-27b")
    fam, spec = cost.layers, cost.spec
    sliding, full = _layer(spec, "sliding").attention, _layer(spec, "full").attention
    w = sliding.window
    assert fam.attention_decode_s(sliding, 4, 4 * w) == fam.attention_decode_s(sliding, 4, w)
    assert fam.attention_decode_s(sliding, 4, w // 2) == pytest.approx(
        fam.attention_decode_s(sliding, 4, w) / 2)
    assert fam.attention_decode_s(full, 4,
                                  4 * w) == pytest.approx(4 * fam.attention_decode_s(full, 4, w))
    # Past the window only the full layers' reads grow.
    n_full = sum(lay.attention.kind == "full" for lay in spec.arch.layers)
    grow = cost.decode_time(4, 4 * w).attention_s - cost.decode_time(4, 2 * w).attention_s
    assert grow == pytest.approx(n_full * fam.attention_decode_s(full, 4, 2 * w))


def test_linear_attention_state_is_independent_of_context():
    cost = catalog_cost("qwen3-next-80b-a3b")
    att = _layer(cost.spec, "linear").attention
    one = cost.layers.attention_decode_s(att, 8, 16)
    assert one > 0 and cost.layers.attention_decode_s(att, 8, 200_000) == one
    # Read and written every step: 2 x (conv state + float32 recurrent state) per row.
    nbytes = 2 * 8 * (att.conv_elems * 2 + att.state_elems * 4)
    assert one == pytest.approx(nbytes / cost.profile.bytes_per_s)


def test_mla_reads_the_latent_and_pays_the_absorbed_flops():
    cost = catalog_cost("deepseek-v3")
    att = _layer(cost.spec, "mla").attention
    assert att.token_bytes(2) == (512 + 64) * 2
    t = cost.layers.attention_decode_s(att, 4, 4096)
    read_s = 4 * 4096 * att.token_bytes(2) / cost.profile.bytes_per_s
    flops_s = 2 * 4 * 128 * 4096 * (2 * 512 + 64) / cost.profile.flops_per_s("float16")
    assert t == pytest.approx(max(read_s, flops_s)) and flops_s > read_s  # 128 heads: compute


@pytest.mark.parametrize("name", NON_DENSE + TINY)
def test_parts_add_up_for_every_family(name):
    spec = zoo_spec(name)
    cost = (StepCost(spec, PROFILE, "float32", None) if name.startswith("tiny")
            else catalog_cost(name))
    chunks = (PrefillChunk(0, 0, 300, True), PrefillChunk(1, 700, 256, False))
    t = cost.step_time(decode_rows=3, width=900, prefills=chunks, copy_bytes=1e5)
    parts_s = sum(getattr(t, f) for f in StepTime.__dataclass_fields__)
    assert parts_s == pytest.approx(t.total_s, rel=1e-12)
    assert t.experts_s > 0 if "moe" in spec.families else t.experts_s == 0
    charged = (cost.decode_forward_s(3, 900) + cost.step_overhead_s + cost.copy_s(1e5)
               + sum(cost.prefill_forward_s(c.num_tokens, c.start, c.sample) for c in chunks))
    assert charged == pytest.approx(t.total_s, rel=1e-12)
    assert all(math.isfinite(v) and v >= 0 for v in t.as_dict().values())
    kinds = {lay.attention.kind for lay in spec.arch.layers}
    if kinds <= {"full", "mla"}:  # attention grows with the width: the simulator's fast path
        base, per_width = cost.decode_parts(3)
        assert base + per_width * 900 == pytest.approx(cost.decode_forward_s(3, 900), rel=1e-12)
    else:
        with pytest.raises(ValueError, match="decode_forward_s"):
            cost.decode_parts(3)


@pytest.mark.parametrize("name,calibrated", [("qwen3-8b", False), ("smollm2-135m", True)])
def test_dense_is_one_layer_priced_once_times_the_layer_count(name, calibrated):
    """No dense branch: a dense model's decode is its one layer's matrices and attention,
    priced once and multiplied by the layers, plus the lm head (by hand, bit for bit)."""
    spec = zoo_spec(name)
    cost = StepCost(spec, PROFILE, "float32", None) if calibrated else catalog_cost(name)
    layer, layers = spec.arch.layers[0], spec.num_layers
    assert set(spec.arch.layers) == {layer} and cost.layers.linear_in_width
    for batch, width in ((1, 100), (48, 3000)):
        t = cost.decode_time(batch, width)
        split = [cost.linear_split(batch, m.in_dim, m.out_dim) for m in layer.mats]
        head = cost.linear_split(batch, spec.hidden_size, spec.vocab_size)
        assert t.weights_s == sum(w for w, _ in split) * layers + head[0]
        assert t.matmul_s == sum(f for _, f in split) * layers + head[1]
        kv_s = cost.layers.attention_decode_s(layer.attention, batch, width, count=layers)
        assert t.attention_s == kv_s and t.experts_s == 0
        assert kv_s == pytest.approx(layers * cost.layers.attention_decode_s(layer.attention,
                                                                             batch, width))


def test_moe_batching_gain_is_well_below_dense():
    moe = batching_curve(catalog_cost("qwen3-30b-a3b"), 1024)
    dense = batching_curve(catalog_cost("qwen3-8b"), 1024)
    moe_gain, dense_gain = moe[32] / moe[1], dense[32] / dense[1]
    # More rows route to more distinct experts: MoE gains well under dense (0.72x of it since a
    # tiled matmul pays its FLOPs beside its bytes: the dense gain shrank; 0.56x with the fit of
    # per-row terms, under 0.5x before them; 0.76x once an engine sampling the batch at once pays
    # no per-row sampling; 0.93x once a layer's fixed cost is by its kernels, server.perf.kernels:
    # a qwen3_moe layer launches 27 to qwen3's 19, fixed time that batching shares out).
    assert 1 < moe_gain < 0.95 * dense_gain
    assert all(moe[a] < moe[b] for a, b in zip(sorted(moe), sorted(moe)[1:]))


@pytest.mark.parametrize("name", NON_DENSE)
def test_simulated_runs_of_every_family_keep_the_kv_account(name, tmp_path):
    """The simulator runs every family on a Mac, with float16 as MLX would (dtype auto), and the
    executor's bytes equal the scheduler's at every step."""
    from batchsim.server.engine.run_config import RunConfig
    from batchsim.server.engine.run_path import run_config
    from batchsim.workloads.lengths import parse_length
    from batchsim.workloads.spec import WorkloadSpec

    spec = WorkloadSpec(name="fam", num_prompts=40, request_rate=2.0,
                        input_len=parse_length("uniform:100:3000"),
                        output_len=parse_length("uniform:20:300"))
    cfg = RunConfig(model=name, executor="sim", device_profile="M3 Ultra", quantize=4,
                    memory_gb=480, workload=spec)
    summary = run_config(cfg, tmp_path)
    assert summary["completed"] == 40 and summary["kv_account_mismatches"] == 0
    assert summary["dtype"] == "float16" and summary["num_steps"] > summary["num_plans"]


def test_simulator_prices_each_decode_step_of_a_non_dense_plan_at_its_width():
    """A sliding window or a fixed state does not grow linearly with the context: a multi-step
    plan is charged the performance model's step time at every step's own width."""
    from batchsim.scheduler.scheduler import Scheduler
    from batchsim.server.executors.sim_executor import SimExecutor

    from tests.drivers import config, make_request

    spec = zoo_spec("gpt-oss-20b")
    cost, cache = catalog_cost("gpt-oss-20b", "M4 Max 40c"), spec.cache_layout("float16")
    ex = SimExecutor(cost, max_lookahead_steps=64, cache=cache)
    s = Scheduler(config(kv_budget_bytes=1 << 34, kv_bytes_per_token=cache.full_token_bytes,
                         cache_layout=cache, max_model_len=4096, max_lookahead_steps=64))
    s.add_request(make_request(0, 300, 50))
    while True:
        plan = s.schedule()
        result = ex.execute(plan)
        s.update_from_output(plan, result)
        if plan.num_steps > 1:
            break
    width = plan.decode_positions[0] + 1
    expected = [cost.step_overhead_s + cost.decode_forward_s(1, width + i)
                for i in range(plan.num_steps)]
    # The first step also pays the join (the prefilled cache copied into the pool).
    assert result.step_durations_s[1:] == pytest.approx(expected[1:], rel=1e-12)
    assert result.step_durations_s[0] > expected[0]
    assert len(set(result.step_durations_s[1:])) > 1  # the full-attention layers still grow


def test_the_paged_layout_prices_its_gather_as_measured():
    spec = zoo_spec("tiny-sliding")  # full and sliding layers: only the full ones gather blocks
    padded = StepCost(spec, PROFILE, "float32", None)
    paged = StepCost(spec, PROFILE, "float32", None, paged=True)
    assert [paged_read_ratio(b) for b in (1, 8, 32, 64)] == [1.36, 1.41, 1.59, 1.59]
    assert 1.36 < paged_read_ratio(2) < paged_read_ratio(4) < 1.41
    for att in {lay.attention for lay in spec.arch.layers}:
        ratio = 1.0 if att.kind == "sliding" else paged_read_ratio(8)
        assert paged.layers.attention_decode_s(att, 8, 100) == pytest.approx(
            ratio * padded.layers.attention_decode_s(att, 8, 100))
    assert paged.decode_forward_s(8, 100) > padded.decode_forward_s(8, 100)
    assert paged.prefill_forward_s(64, 0, True) == padded.prefill_forward_s(64, 0, True)


def test_one_row_hides_its_flops_several_rows_pay_both():
    """A catalog Mac's matrix-vector kernel (one row) is its binding term; a tiled matmul (several
    rows) pays weight bytes plus FLOPs."""
    cost = catalog_cost("llama-3.2-1b", quantize_bits=None)
    k, n = cost.spec.hidden_size, cost.spec.intermediate_size
    for m in (1, 2, 16):
        moved_s, flops_s = cost._roofline_terms(m, k, n)
        want = max(moved_s, flops_s) if m == 1 else moved_s + flops_s
        assert cost.matrix_s(m, k, n) == pytest.approx(want)
        assert sum(cost.linear_split(m, k, n)) == pytest.approx(want)
