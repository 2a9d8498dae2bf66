"""Routed experts at the batch as MLX runs them (GatherQMM::eval_gpu): below the sorted
grouped-matmul gate every (token, expert) pair is its own gather_qmv mat-vec, so a pair whose
expert another pair already streamed still dequantizes and multiplies that expert's weights (a
qmv row past the first, at the profile's qmv row rate); from the gate on (the pairs sorted, 16 or
more, pairs / experts >= 4 from MLX 0.29.2, >= 8 from 0.25.0) one grouped matmul per expert
runs and only the distinct experts' streams are priced."""

from __future__ import annotations

import dataclasses

import pytest
from batchsim.server.perf.batch_gain import catalog_cost
from batchsim.server.perf.layer_cost import expected_experts, runs_gather_qmv
from batchsim.server.perf.stepcost import StepCost


def _moe(cost: StepCost):
    (layer,) = {lay for lay in cost.spec.arch.layers if lay.ffn.kind == "moe"}
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
    return sum(cost.layers.repeat_pairs_s(m, layer, batch) for m in mats) * cost.layers.moe_layers


def test_gate_follows_mlx_versions():
    # qwen3-30b-a3b: 128 experts, top 8. Unsorted below 64 pairs (mlx-lm / mlx-swift-lm).
    assert runs_gather_qmv(32, 128) and runs_gather_qmv(504, 128)
    assert not runs_gather_qmv(512, 128)  # B = 64: 4 pairs per expert (MLX >= 0.29.2)
    assert runs_gather_qmv(512, 128, "0.29.1") and not runs_gather_qmv(1024, 128, "0.29.1")
    assert not runs_gather_qmv(128, 32, "0.29.2")  # gpt-oss-20b at B = 32: 4 per expert
    assert runs_gather_qmv(128, 32, "0.28.0")


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
    dense = catalog_cost("qwen3-30b-a3b")
    dense_rows_s = sum(n * sum(dense.linear_parts(4, m.in_dim, m.out_dim)[2]
                               for m in lay.mats if not m.routed)
                       for lay, n in dense.layers.layers.items())
    dense_rows_s += dense.linear_parts(4, cost.spec.hidden_size, cost.spec.vocab_size)[2]
    assert four.gemv_rows_s == pytest.approx(dense_rows_s + _repeat_rows_s(cost, 4))
    assert one.gemv_rows_s == 0
