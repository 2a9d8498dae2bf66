"""One row layout for both executors: the real DecodePool moves MLX arrays exactly as the
simulator's bookkeeping says, and the simulator prices exactly the bytes the arrays moved."""

from __future__ import annotations

import random
import types

import mlx.core as mx
import pytest
from batchsim.scheduler.kv_bytes import CacheLayout
from batchsim.scheduler.plan import StepPlan
from batchsim.scheduler.pool_geometry import EMPTY_POOL, PoolGeometry
from batchsim.server.executors.decode_pool import DecodePool
from batchsim.server.executors.pool_rows import PoolLayout
from batchsim.server.executors.sim_executor import SimExecutor
from batchsim.server.models.arch_cache import Attention
from batchsim.server.perf.engines import EngineProfile

LAYERS, HEADS, HEAD_DIM = 2, 2, 4
KVT = 2 * LAYERS * HEADS * HEAD_DIM * 4  # float32


class BytesCost:
    """A cost model whose 'seconds' are the bytes copied: only copies cost anything."""

    kv_bytes_per_token = KVT
    step_overhead_s = 0.0
    layers = types.SimpleNamespace(linear_in_width=True)  # dense: one decode price per width
    engine = EngineProfile("bytes-only", 0.0, 0.0)  # no host costs: only copies cost anything

    def copy_s(self, nbytes: float) -> float:
        return float(nbytes)

    def decode_parts(self, batch: int) -> tuple[float, float]:
        return 0.0, 0.0


class Cache:
    """A prefilled request's per-layer cache, every K value its tag and every V value minus it."""

    def __init__(self, tag: float, length: int):
        self.keys = mx.full((1, HEADS, length, HEAD_DIM), tag)
        self.values = -self.keys


def _tag(rid: int) -> float:
    return float(rid + 1)


def _row_tags(pool: DecodePool) -> list[float]:
    """The tag each occupied row of the arrays holds (its first token, first layer)."""
    return [pool.stores[0].parts[0][i, 0, 0, 0].item() for i in range(len(pool))]


def _check_arrays(pool: DecodePool) -> None:
    for i, (rid, n) in enumerate(zip(pool.row_ids, pool.lengths)):
        for store in pool.stores:
            keys, values = store.parts
            assert mx.all(keys[i, :, :n] == _tag(rid)).item(), (i, rid)
            assert mx.all(values[i, :, :n] == -_tag(rid)).item(), (i, rid)


def _sim_step(sim: SimExecutor, step: int, pool: DecodePool, free=(), geometry=None) -> float:
    """The plan that makes the simulator do what the pool just did; returns its priced bytes."""
    plan = StepPlan(step, tuple(free), (), (), tuple(pool.row_ids), tuple(pool.lengths),
                    geometry or pool.geometry, 0)
    return sim.execute(plan).step_durations_s[0]


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_real_pool_and_simulator_follow_one_layout(seed):
    rng = random.Random(seed)
    pool = DecodePool([Attention("full", HEADS, HEAD_DIM, HEAD_DIM)] * LAYERS, mx.float32)
    sim = SimExecutor(BytesCost())
    assert pool.layout.kv_bytes_per_token == KVT
    sim_moves = []  # what the simulator's layout reported for each leave
    leave = sim.layout.leave
    sim.layout.leave = lambda ids: sim_moves.append(leave(ids)) or sim_moves[-1]
    next_id, seen = 0, {"leave": 0, "join": 0, "resize": 0, "moved": 0}
    for step in range(120):
        op = rng.choice(["join", "join", "leave", "resize"])
        if op == "join" and len(pool) < pool.geometry.rows:
            length = rng.randint(1, pool.geometry.capacity_tokens)
            pool.add(next_id, [Cache(_tag(next_id), length)] * LAYERS, length)
            priced = _sim_step(sim, step, pool)
            assert priced == length * KVT  # the request's tokens, every layer, K and V
            next_id += 1
        elif op == "leave" and len(pool):
            gone = set(rng.sample(pool.row_ids, rng.randint(1, len(pool))))
            gone.add(10_000 + step)  # freed while prefilling: never in the pool
            before = _row_tags(pool)
            pool.remove(gone)
            after = _row_tags(pool)
            filled = [i for i, (a, b) in enumerate(zip(before, after)) if a != b]
            priced = _sim_step(sim, step, pool, free=gone)
            moves = sim_moves[-1]
            assert filled == moves.holes  # the rows the arrays rewrote are the simulator's holes
            assert [after[h] for h in moves.holes] == [before[m] for m in moves.movers]
            row_bytes = pool.geometry.capacity_tokens * KVT  # K and V, every layer
            assert priced == 2 * len(filled) * row_bytes  # whole rows, gathered then scattered
            seen["moved"] += len(filled)
        elif op == "resize":
            longest = max(pool.lengths, default=0)
            rows = len(pool) + rng.randint(0 if len(pool) else 1, 4)
            cap = 8 * rng.randint(max(1, -(-longest // 8)), 8)
            old_shape = pool.arrays()[0].shape if pool.arrays() else (0, 0, 0, 0)
            new = EMPTY_POOL if not len(pool) and rng.random() < 0.3 else PoolGeometry(rows, cap)
            if new == pool.geometry:
                continue
            pool.resize(new)
            kept = min(old_shape[0], new.rows) * min(old_shape[2], new.capacity_tokens) * KVT
            priced = _sim_step(sim, step, pool)
            assert priced == kept + (pool.nbytes - kept) / 2  # kept bytes copied, the rest zeroed
        else:
            continue
        seen[op] += 1
        assert sim.layout.row_ids == pool.row_ids and sim.layout.geometry == pool.geometry
        assert sim.kv_bytes() == pool.nbytes
        _check_arrays(pool)
    assert min(seen.values()) > 5, seen


def test_layout_fills_holes_from_the_last_rows():
    layout = PoolLayout(CacheLayout.dense(10))
    layout.resize(PoolGeometry(8, 32))
    for rid in range(6):
        layout.join(rid, 5)
    moves = layout.leave({1, 3, 5, 99})  # 3 rows stay: row 1 is a hole, row 4 fills it
    assert (moves.holes, moves.movers, moves.moved_bytes) == ([1], [4], 1 * 32 * 10)
    assert layout.row_ids == [0, 4, 2] and layout.in_pool == {0, 2, 4}
    change = layout.resize(PoolGeometry(4, 64))
    assert (change.kept_bytes, change.new_bytes) == (4 * 32 * 10, 4 * 64 * 10)
    with pytest.raises(RuntimeError):
        layout.resize(PoolGeometry(2, 64))  # three rows do not fit in two
    with pytest.raises(RuntimeError):
        layout.join(7, 65)  # longer than a row
    layout.join(7, 64)
    with pytest.raises(RuntimeError):
        layout.join(8, 1)  # no spare row
    assert layout.leave({8, 9}).movers == [] and layout.row_ids == [0, 4, 2, 7]


@pytest.mark.parametrize("leaving", range(6))
def test_one_row_leaving_moves_as_several_do(leaving):
    """A single leave (its own shortcut) moves rows as the general rule does: the last row fills
    the hole, unless the last row is the one leaving."""
    layout = PoolLayout(CacheLayout.dense(10))
    layout.resize(PoolGeometry(8, 32))
    for rid in range(6):
        layout.join(rid, 5)
    moves = layout.leave({leaving})
    at, keep = [leaving], 5  # the general rule, by hand: holes below keep, movers above it
    holes, movers = [i for i in at if i < keep], [i for i in range(keep, 6) if i not in at]
    rows = list(range(6))
    for h, m in zip(holes, movers):
        rows[h] = rows[m]
    assert (moves.holes, moves.movers, moves.moved_bytes) == (holes, movers, len(movers) * 320)
    assert layout.row_ids == rows[:keep] and layout.in_pool == set(rows[:keep])


def test_sim_executor_joins_again_a_row_that_left_under_the_same_decode_ids():
    """The sim executor skips its join check when a plan hands it the last plan's decode_ids
    tuple (the scheduler reuses it while its rows stay); a row that left since is joined again,
    its copy priced, as a fresh tuple would have it."""
    sim = SimExecutor(BytesCost())
    ids, positions, geometry = (1, 2), (10, 20), PoolGeometry(4, 256)
    sim.execute(StepPlan(0, (), (), (), ids, positions, geometry, 0))
    again = sim.execute(StepPlan(1, (2,), (), (), ids, positions, geometry, 0))
    assert sim.layout.in_pool == {1, 2} and sim.layout.row_ids == [1, 2]
    assert again.step_durations_s[0] == CacheLayout.dense(KVT).seq_bytes(20)  # 2's copy only
