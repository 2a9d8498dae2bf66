"""Decode attention on an M5 GPU pays MLX's vector kernel's work per (query head, cached token)
where it outlasts the K/V stream (layer_cost.SDPA_VECTOR_SCORE_S: ml-explore/mlx #3837, #4076):
a model with many query heads per KV head (gpt-oss-20b: 64 / 8, D 64) is bound by its scores at
long context; quantized K/V (matmuls, not the vector kernel) and the GPUs with no measurement
(M1-M4) by their bytes."""

from __future__ import annotations

import pytest
from batchsim.server.perf.batch_gain import catalog_cost
from batchsim.server.perf.layer_cost import SDPA_VECTOR_SCORE_S


def _full_layer_growth(cost, batch: int) -> tuple[float, int, float]:
    """(attention seconds grown from 8k to 16k cached tokens, full layers, their K/V bytes)."""
    full = [lay.attention for lay in cost.spec.arch.layers if lay.attention.kind == "full"]
    grow = (cost.decode_time(batch, 16384).attention_s
            - cost.decode_time(batch, 8192).attention_s)
    nbytes = len(full) * batch * 8192 * full[0].token_bytes(cost.act_bytes, cost.kv_bits)
    return grow, len(full), nbytes


@pytest.mark.parametrize("batch", [1, 2])
def test_many_query_heads_per_kv_head_are_bound_by_their_scores_on_an_m5(batch):
    cost = catalog_cost("gpt-oss-20b", "M5 Max 40c")
    grow, n_full, nbytes = _full_layer_growth(cost, batch)
    assert grow == pytest.approx(n_full * batch * cost.spec.num_heads * 8192 * SDPA_VECTOR_SCORE_S)
    assert grow > 2 * nbytes / cost.profile.kv_bytes_per_s  # the bytes alone: under half


def test_a_gpu_without_the_measurement_is_priced_by_its_bytes():
    cost = catalog_cost("gpt-oss-20b", "M1 Max 32c")
    grow, _, nbytes = _full_layer_growth(cost, 1)
    assert grow == pytest.approx(nbytes / cost.profile.kv_bytes_per_s)


def test_quantized_kv_is_priced_by_its_bytes():
    # qwen3-30b-a3b: 32 query / 4 KV heads, D 128, every layer full: its float K/V is bound by
    # its scores on an M5 Max, its 8-bit K/V (mlx-lm's quantized SDPA: matmuls) by its bytes.
    cost = catalog_cost("qwen3-30b-a3b", "M5 Max 40c")
    grow, n_full, _ = _full_layer_growth(cost, 1)
    assert grow == pytest.approx(n_full * cost.spec.num_heads * 8192 * SDPA_VECTOR_SCORE_S)
    cost_q = type(cost)(cost.spec, cost.profile, "float16", 4, kv_bits=8, engine=cost.base_engine)
    grow_q, _, nbytes = _full_layer_growth(cost_q, 1)
    assert grow_q < grow
    assert grow_q == pytest.approx(nbytes / cost.profile.kv_bytes_per_s, rel=0.2)
