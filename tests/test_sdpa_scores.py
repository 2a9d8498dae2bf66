"""Decode attention on a catalog Mac grows with the context by its K/V bytes alone, on every chip
and MLX release: no per-(query head, key) score term is priced. 8496284 priced MLX's vector
kernel's scores on the M5 Pro/Max and M1 Ultra under MLX 0.30.4-0.32.1, linear in rows; review r2
reverted it (its cells are batch-1 only: an M5 Pro 20c and an M5 Max 40c take the same 0.35 ms on
one cell, so extra rows may fill idle capacity; its batch dependence is unmeasured)."""

from __future__ import annotations

import dataclasses

import pytest
from batchsim.server.perf.batch_gain import catalog_cost


def _growth(cost, batch: int) -> tuple[float, float]:
    """(attention seconds grown from 8k to 16k cached tokens, 8k more full-layer K/V bytes)."""
    full = [lay.attention for lay in cost.spec.arch.layers if lay.attention.kind == "full"]
    grow = (cost.decode_time(batch, 16384).attention_s
            - cost.decode_time(batch, 8192).attention_s)
    nbytes = len(full) * batch * 8192 * full[0].token_bytes(cost.act_bytes, cost.kv_bits)
    return grow, nbytes


@pytest.mark.parametrize("batch", [1, 8])
@pytest.mark.parametrize("model,label", [
    ("gpt-oss-20b", "M5 Max 40c"),  # 64q/8kv D64: 8496284 priced 4.6x its bytes here
    ("llama-3.1-8b", "M5 Max 40c"),
    ("qwen3-next-80b-a3b", "M1 Ultra 64c"),  # D256: 8496284's M1 Ultra cell
    ("gpt-oss-20b", "M1 Max 32c"),
    ("gpt-oss-20b", "M4 Max 40c"),
])
def test_decode_attention_grows_by_its_kv_bytes(model, label, batch):
    cost = catalog_cost(model, label)
    grow, nbytes = _growth(cost, batch)
    assert grow == pytest.approx(nbytes / cost.profile.kv_bytes_per_s)


@pytest.mark.parametrize("mlx", ["0.30.3", "0.30.4", "0.32.1", "0.32.4"])
def test_every_mlx_release_pays_the_same_bytes(mlx):
    cost = catalog_cost("gpt-oss-20b", "M5 Max 40c")
    again = type(cost)(cost.spec, dataclasses.replace(cost.profile, mlx_version=mlx), "float16",
                       4, engine=cost.base_engine, kv_bits=cost.kv_bits, paged=cost.paged)
    assert _growth(again, 1)[0] == pytest.approx(_growth(cost, 1)[0])
