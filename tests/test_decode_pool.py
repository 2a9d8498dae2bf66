"""The decode pool's two ways of writing a step: rows at one position write one column with a
slice update and need no mask (always at batch 1); rows at different positions are scattered and
masked. Both give each request the tokens it gets alone."""

from __future__ import annotations

import mlx.core as mx
import pytest
from batchsim.scheduler.pool_geometry import PoolGeometry
from batchsim.server.executors.decode_pool import DecodePool
from batchsim.server.models.arch_cache import Attention

from tests.drivers import kv_per_token, run_alone, run_mlx


def _pool(lengths: list[int]) -> DecodePool:
    pool = DecodePool([Attention("full", heads=2, k_dim=4, v_dim=4)] * 2, mx.float32)
    pool.resize(PoolGeometry(len(lengths), 256))
    for rid, n in enumerate(lengths):
        pool.add(rid, None, n)
    return pool


def _step(pool: DecodePool, value: float) -> list:
    views = pool.layer_views()
    b = len(pool)
    k = mx.full((b, 2, 1, 4), value)
    return [views[0], *views[0].update_and_fetch(k, k)]


@pytest.mark.parametrize("lengths, aligned", [([5], True), ([7, 7, 7], True), ([3, 7, 5], False)])
def test_a_step_writes_each_row_at_its_position_masked_only_when_rows_differ(lengths, aligned):
    pool = _pool(lengths)
    view, keys, _ = _step(pool, 2.0)
    assert (view.make_mask(1) is None) is aligned
    assert isinstance(view.offset, int) is aligned
    assert keys.shape == (len(lengths), 2, max(lengths) + 1, 4)
    for row, n in enumerate(lengths):  # the new token at position n, nothing after it
        assert keys[row, :, n].tolist() == [[2.0] * 4] * 2
        assert float(mx.abs(keys[row, :, n + 1:]).sum()) == 0.0
    assert pool.lengths == [n + 1 for n in lengths]


def test_rows_of_one_length_decode_together_as_they_do_alone(tiny):
    # Every prompt the same length, all arriving at once: every decode step takes the aligned path.
    ref, model, _ = tiny
    specs = [(0, [(7 * i + 3 * j) % ref.spec.vocab_size for j in range(40)], 24) for i in range(5)]
    batched, _, trace = run_mlx(model, kv_per_token(ref), specs, max_num_seqs=5)
    assert max(len(p.decode_ids) for p in trace.plans) == 5
    assert batched == run_alone(model, kv_per_token(ref), specs)
