"""Decode attention on a chip with MLX's vector kernel measured (layer_cost.SDPA_VECTOR_SCORE_NS:
the M5 Pro / Max, g17s, at head dims 64 and 128, and the M1 Ultra, g13d, at 256; ml-explore/mlx
#3837, #4076) pays the kernel's work per (query head, cached key) where it outlasts the K/V
stream, at the MLX releases that ran the measured kernel (v0.30.4 to v0.32.1), in the padded and
the paged layout alike; quantized K/V, other chips, head dims and releases pay their K/V bytes."""

from __future__ import annotations

import dataclasses

import pytest
from batchsim.server.perf.batch_gain import catalog_cost
from batchsim.server.perf.layer_cost import SDPA_VECTOR_SCORE_NS, paged_read_ratio


def _growth(cost, batch: int) -> tuple[float, int, float]:
    """(attention seconds grown from 8k to 16k cached tokens, full layers, their K/V bytes)."""
    full = [lay.attention for lay in cost.spec.arch.layers if lay.attention.kind == "full"]
    grow = (cost.decode_time(batch, 16384).attention_s
            - cost.decode_time(batch, 8192).attention_s)
    nbytes = len(full) * batch * 8192 * full[0].token_bytes(cost.act_bytes, cost.kv_bits)
    return grow, len(full), nbytes


def _scores_s(cost, batch: int, n_full: int) -> float:
    rate_s = SDPA_VECTOR_SCORE_NS[cost.profile.gpu_family][0] * 1e-9
    return n_full * batch * cost.spec.num_heads * 8192 * rate_s


def _again(cost, mlx_version: str | None = None, **kwargs):
    """The same model and Mac at another MLX release or layout (kv_bits, paged)."""
    profile = cost.profile if mlx_version is None else dataclasses.replace(
        cost.profile, mlx_version=mlx_version)
    args = {"kv_bits": cost.kv_bits, "paged": cost.paged, **kwargs}
    return type(cost)(cost.spec, profile, "float16", 4, engine=cost.base_engine, **args)


@pytest.mark.parametrize("batch", [1, 2])
def test_many_query_heads_per_kv_head_are_bound_by_their_scores_on_an_m5(batch):
    # gpt-oss-20b: 64 query / 8 KV heads, D 64: 4.6x more scores' time than bytes' on an M5 Max
    cost = catalog_cost("gpt-oss-20b", "M5 Max 40c")
    grow, n_full, nbytes = _growth(cost, batch)
    assert grow == pytest.approx(_scores_s(cost, batch, n_full))
    assert grow > 2 * nbytes / cost.profile.kv_bytes_per_s


def test_the_m1_ultra_pays_its_own_rate_at_the_head_dim_measured():
    # qwen3-next-80b-a3b's full layers: 16 query / 2 KV heads, D 256 (mlx#3837's D); llama-3.1-8b's
    # D 128 was not measured on it: its bytes
    cost = catalog_cost("qwen3-next-80b-a3b", "M1 Ultra 64c")
    grow, n_full, nbytes = _growth(cost, 1)
    assert grow == pytest.approx(_scores_s(cost, 1, n_full))
    assert grow > 2 * nbytes / cost.profile.kv_bytes_per_s
    cost = catalog_cost("llama-3.1-8b", "M1 Ultra 64c")
    grow, _, nbytes = _growth(cost, 1)
    assert grow == pytest.approx(nbytes / cost.profile.kv_bytes_per_s)


@pytest.mark.parametrize("label", ["M1 Max 32c", "M4 Max 40c"])
def test_a_chip_without_a_measurement_pays_its_bytes(label):
    cost = catalog_cost("gpt-oss-20b", label)
    grow, _, nbytes = _growth(cost, 1)
    assert grow == pytest.approx(nbytes / cost.profile.kv_bytes_per_s)


@pytest.mark.parametrize("mlx,scored", [("0.30.3", False), ("0.30.4", True), ("0.32.0.dev", True),
                                        ("0.32.1", True), ("0.32.2", False), ("0.32.4", False)])
def test_only_the_releases_that_ran_the_measured_kernel_pay_its_scores(mlx, scored):
    cost = _again(catalog_cost("gpt-oss-20b", "M5 Max 40c"), mlx)
    grow, n_full, nbytes = _growth(cost, 1)
    expected = _scores_s(cost, 1, n_full) if scored else nbytes / cost.profile.kv_bytes_per_s
    assert grow == pytest.approx(expected)


@pytest.mark.parametrize("batch", [1, 8])
def test_the_paged_layout_runs_the_same_kernel_after_its_gather(batch):
    cost = _again(catalog_cost("gpt-oss-20b", "M5 Max 40c"), paged=True)
    grow, n_full, _ = _growth(cost, batch)
    assert grow == pytest.approx(_scores_s(cost, batch, n_full) * paged_read_ratio(batch))


def test_quantized_kv_pays_its_bytes():
    # qwen3-30b-a3b's 8-bit K/V runs mlx-lm's quantized SDPA (matmuls), not the vector kernel
    cost = catalog_cost("qwen3-30b-a3b", "M5 Max 40c")
    grow, n_full, _ = _growth(cost, 1)
    assert grow == pytest.approx(_scores_s(cost, 1, n_full))
    grow_q, _, nbytes = _growth(_again(cost, kv_bits=8), 1)
    assert grow_q < grow / 2
    assert grow_q == pytest.approx(nbytes / cost.profile.kv_bytes_per_s, rel=0.2)
