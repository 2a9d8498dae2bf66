"""Routed experts at the batch as MLX runs them (GatherQMM::eval_gpu): below the sorted
grouped-matmul gate every (token, expert) pair is its own gather_qmv mat-vec, so a pair whose
expert another pair already streamed still dequantizes and multiplies that expert's weights (a
qmv row past the first, at the profile's qmv row rate); from the gate on (the pairs sorted, 16 or
more, pairs / experts >= 4 from MLX 0.29.2, >= 8 from 0.25.0) one grouped matmul per expert
runs and only the distinct experts' streams are priced."""

from __future__ import annotations

import dataclasses

import pytest
from batchsim.scripts.size_view import _gate_note
from batchsim.server.models.spec import zoo_spec
from batchsim.server.perf.batch_gain import catalog_cost
from batchsim.server.perf.layer_cost import (
    GATHER_MATMUL_EFFICIENCY,
    expected_experts,
    gather_rhs_batch,
    runs_gather_qmv,
)
from batchsim.server.perf.stepcost import StepCost


def _moe(cost: StepCost):
    """The model's one distinct MoE layer (qwen3-30b-a3b's) and its routed matrices."""
    assert len({lay for lay in cost.spec.arch.layers if lay.ffn.kind == "moe"}) == 1
    return _first_moe(cost)


def _first_moe(cost: StepCost):
    """The first MoE layer (gpt-oss has two: sliding and full attention) and its routed mats."""
    layer = next(lay for lay in cost.spec.arch.layers if lay.ffn.kind == "moe")
    return layer, [mat for mat in layer.mats if mat.routed]


def _repeat_rows_s(cost: StepCost, batch: int) -> float:
    """By hand: the pairs past the distinct experts, each a qmv row over every routed matrix."""
    layer, mats = _moe(cost)
    ffn = layer.ffn
    repeats = batch * ffn.top_k - expected_experts(ffn.experts, ffn.top_k, batch)
    rate = cost.profile.quantized_gemv_row_gflops * 1e9
    per_layer = sum(2 * m.in_dim * m.out_dim for m in mats) * repeats / rate  # each stack once
    return per_layer * cost.layers.moe_layers


def _routed_rows_s(cost: StepCost, batch: int) -> float:
    layer, mats = _moe(cost)
    return sum(cost.layers.routed_parts_s(m, layer, batch)[1]
               for m in mats) * cost.layers.moe_layers


def test_gate_follows_mlx_versions():
    # qwen3-30b-a3b: 128 experts, top 8. Unsorted below 64 pairs (mlx-lm / mlx-swift-lm).
    assert runs_gather_qmv(32, 128) and runs_gather_qmv(504, 128)
    assert not runs_gather_qmv(512, 128)  # B = 64: 4 pairs per expert (MLX >= 0.29.2)
    assert runs_gather_qmv(512, 128, "0.29.1") and not runs_gather_qmv(1024, 128, "0.29.1")
    assert not runs_gather_qmv(128, 32, "0.29.2")  # gpt-oss-20b at B = 32: 4 per expert
    assert runs_gather_qmv(128, 32, "0.28.0")


def test_gate_needs_sorted_pairs_and_the_kernel():
    # 60 pairs over 8 experts (7 an expert) stay unsorted below SwitchGLU's 64: gather_qmv.
    assert runs_gather_qmv(60, 8) and not runs_gather_qmv(64, 8)
    assert runs_gather_qmv(4096, 128, "0.24.2")  # no gather_qmm_rhs before v0.25.0
    assert not runs_gather_qmv(4096, 128, "0.25.0")  # 32 an expert: past the 8 gate
    # A 0.29.2 dev build predates the release: the 8 gate (4 pairs an expert still gather_qmv).
    assert runs_gather_qmv(512, 128, "0.29.2.dev") and not runs_gather_qmv(1024, 128, "0.29.2.dev")


def test_repeat_rows_pinned_by_hand():
    # qwen3-30b-a3b (48 MoE layers, 128 experts top 8, 2048 -> 768 -> 2048 experts) at B = 8, qmv
    # rows at 1000 GFLOP/s: 64 pairs - 128 (1 - (120/128)^8) = 51.6199 distinct = 12.3801 repeats,
    # each 2 (2 * 2048 * 768 + 768 * 2048) = 9437184 FLOPs a layer: 12.3801 * 9437184 * 48 / 1e12 s.
    cost = catalog_cost("qwen3-30b-a3b")
    cost = StepCost(cost.spec, dataclasses.replace(cost.profile, quantized_gemv_row_gflops=1000.0),
                    "float16", 4)
    assert _routed_rows_s(cost, 8) * 1e3 == pytest.approx(5.6080, abs=5e-4)


@pytest.mark.parametrize("batch", [2, 4, 8, 63])
def test_repeated_pairs_pay_qmv_rows_below_the_gate(batch):
    cost = catalog_cost("qwen3-30b-a3b")
    assert cost.profile.quantized_gemv_row_gflops > 0
    want = _repeat_rows_s(cost, batch)
    assert want > 0
    assert _routed_rows_s(cost, batch) == pytest.approx(want)


def test_one_token_and_the_grouped_matmul_pay_none():
    cost = catalog_cost("qwen3-30b-a3b")
    assert _routed_rows_s(cost, 1) == 0  # its top_k pairs are distinct experts
    assert _routed_rows_s(cost, 64) == 0  # gather_qmm_rhs from 4 pairs per expert
    old = StepCost(cost.spec, dataclasses.replace(cost.profile, mlx_version="0.28.0"),
                   "float16", 4)
    assert _routed_rows_s(old, 64) == pytest.approx(_repeat_rows_s(old, 64))


def test_decode_step_carries_the_rows_in_its_qmv_term():
    cost = catalog_cost("qwen3-30b-a3b")
    one, four = cost.decode_time(1, 512), cost.decode_time(4, 512)
    dense_rows_s = sum(n * sum(cost.linear_parts(4, m.in_dim, m.out_dim)[2]
                               for m in lay.mats if not m.routed)
                       for lay, n in cost.layers.layers.items())
    dense_rows_s += cost.linear_parts(4, cost.spec.hidden_size, cost.spec.vocab_size)[2]
    assert four.gemv_rows_s == pytest.approx(dense_rows_s + _repeat_rows_s(cost, 4))
    assert one.gemv_rows_s == 0


def test_size_notes_a_max_batch_across_the_gate():
    # 128 top-8 from 64 tokens (4 an expert), 32 top-4 from 32, 512 top-10 from 205 (MLX 0.32);
    # qwen3-30b-a3b on MLX 0.29.1: 8 an expert, from 128 tokens.
    gates = {m: gather_rhs_batch(zoo_spec(m)) for m in
             ("qwen3-30b-a3b", "gpt-oss-20b", "qwen3-next-80b-a3b", "llama-3.1-8b")}
    assert gates == {"qwen3-30b-a3b": 64, "gpt-oss-20b": 32, "qwen3-next-80b-a3b": 205,
                     "llama-3.1-8b": None}
    assert gather_rhs_batch(zoo_spec("qwen3-30b-a3b"), "0.29.1") == 128
    spec, meta = zoo_spec("qwen3-30b-a3b"), {"quantize_bits": 4}
    below, across = {"max_batch": 63, "best_batch": 63}, {"max_batch": 106, "best_batch": 64}
    assert _gate_note([below], meta, spec) == []
    assert "MoE from batch 64" in _gate_note([below, across], meta, spec)[0]
    assert _gate_note([across], {"quantize_bits": None}, spec) == []


def _rows_flops_bind(model: str) -> StepCost:
    """The test's own rates, none of the shipped fit's (a refit could flip which term binds):
    4-bit weights streamed at 400 GB/s, the experts' at that full rate, qmv rows at 1 TFLOP/s,
    and the 4-bit GEMM's arithmetic where one row's FLOPs of the first routed matrix take half
    its bytes' time over GATHER_MATMUL_EFFICIENCY."""
    catalog = catalog_cost(model)
    mats = _first_moe(catalog)[1]
    own = dataclasses.replace(catalog.profile, quantized_gemv_gbs={4: 400.0},
                              quantized_gemm_gflops={4: 1000.0}, expert_bandwidth_efficiency=1.0,
                              quantized_gemv_row_gflops=1000.0, calibration=None)
    moved_s, flops_s = StepCost(catalog.spec, own, "float16", 4).linear_terms(
        1.0, mats[0].in_dim, mats[0].out_dim)
    gflops = 1000.0 * (flops_s / GATHER_MATMUL_EFFICIENCY) / (moved_s / 2)
    own = dataclasses.replace(own, quantized_gemm_gflops={4: gflops})
    return StepCost(catalog.spec, own, "float16", 4)


@pytest.mark.parametrize("model, batch", [("qwen3-30b-a3b", 63), ("gpt-oss-20b", 31)])
def test_repeat_flops_are_counted_once(model, batch):
    # Just below the gate the m*k/D rows' FLOPs at half the GEMM rate outweigh an expert's bytes
    # (r3 finding 3: here by the test's own rates); the repeats' FLOPs are their qmv rows
    # (routed_parts_s's repeats_s), so the experts keep one row's FLOPs an expert and the
    # experts' bytes bind.
    cost = _rows_flops_bind(model)
    layer, mats = _first_moe(cost)
    ffn = layer.ffn
    distinct = expected_experts(ffn.experts, ffn.top_k, batch)
    eff = cost.profile.expert_bandwidth_efficiency
    for mat in mats:
        moved_s, flops_s = cost.linear_terms(batch * ffn.top_k / distinct, mat.in_dim, mat.out_dim)
        assert flops_s / GATHER_MATMUL_EFFICIENCY > moved_s / eff  # all rows' FLOPs would bind
        one_s = cost.linear_terms(1.0, mat.in_dim, mat.out_dim)[1] / GATHER_MATMUL_EFFICIENCY
        assert one_s < moved_s / eff  # one row's do not
        experts_s, repeats_s = cost.layers.routed_parts_s(mat, layer, batch)
        assert experts_s == pytest.approx(distinct * moved_s / eff)
        assert repeats_s > 0


@pytest.mark.parametrize("unpriced", ["no row rate", "float weights"])
def test_pairs_keep_their_flops_where_qmv_rows_are_not_priced(unpriced):
    # No qmv row rate, or float weights (qmv_rows_s prices nothing): the repeat pairs are not
    # priced apart, so the experts keep every pair's FLOPs (which bind here), none dropped.
    cost = _rows_flops_bind("qwen3-30b-a3b")
    if unpriced == "no row rate":
        profile = dataclasses.replace(cost.profile, quantized_gemv_row_gflops=0.0)
        cost = StepCost(cost.spec, profile, "float16", 4)
    else:
        cost = StepCost(cost.spec, cost.profile, "float16", None)
    layer, mats = _first_moe(cost)
    ffn, batch = layer.ffn, 63
    distinct = expected_experts(ffn.experts, ffn.top_k, batch)
    for mat in mats:
        moved_s, flops_s = cost.linear_terms(batch * ffn.top_k / distinct, mat.in_dim, mat.out_dim)
        experts_s, repeats_s = cost.layers.routed_parts_s(mat, layer, batch)
        assert repeats_s == 0
        want_s = max(moved_s / cost.profile.expert_bandwidth_efficiency,
                     flops_s / GATHER_MATMUL_EFFICIENCY)
        assert experts_s == pytest.approx(distinct * want_s)
