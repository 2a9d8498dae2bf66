"""Paged prefix caching shares blocks by reference: a cached block is one pool block however many
rows reference it, the scheduler counts it once (drive() holds its bytes to the executor's arrays
every step), and more sequences decode together at one budget with the cache than without."""

from __future__ import annotations

import itertools
import random

from batchsim.scheduler.pool_geometry import PAGE_TOKENS
from batchsim.scheduler.prefix_cache import PrefixCache, chain_block_hashes
from batchsim.scheduler.request import Request, SamplingParams
from batchsim.scheduler.scheduler import Scheduler
from batchsim.server.executors.mlx_executor import MLXExecutor

from tests.drivers import config, drive

PREFIX, SUFFIX, OUT, N = 256, 8, 48, 8  # 16 shared blocks; each row's own: 5 blocks at most


def test_a_holder_released_drops_only_its_references():
    cache = PrefixCache(block_bytes=1, shared=True)
    hashes = chain_block_hashes(range(3))
    cache.adopt(1, hashes)  # request 1 joins: its prompt blocks become cached, held by it
    assert cache.take_ops().store == ((1, 0, hashes[0]), (1, 1, hashes[1]), (1, 2, hashes[2]))
    assert cache.pin(hashes[:2], holder=2) == 0  # request 2 hits two of them
    cache.release(1)  # preempted or finished: its references go, the blocks stay
    assert set(cache.blocks) == set(hashes) and cache.num_unreferenced == 1
    cache.evict(3)  # only the block nobody references goes
    assert set(cache.blocks) == set(hashes[:2])
    cache.release(2)
    cache.evict(3)
    assert not cache.blocks and cache.take_ops().evict == (hashes[2], *hashes[:2])


class _Watch:
    """Executor wrapper: the most rows decoding together and the most references to one block."""

    def __init__(self, ex) -> None:
        self.ex, self.max_rows, self.max_refs = ex, 0, 0

    def execute(self, plan, max_elapsed_s=float("inf")):
        result = self.ex.execute(plan, max_elapsed_s)
        self.max_rows = max(self.max_rows, len(plan.decode_ids))
        blocks = getattr(getattr(self.ex, "pool", None), "blocks", None)
        if blocks is not None and blocks.refcount:
            self.max_refs = max(self.max_refs, max(blocks.refcount))
        return result


def _requests(vocab: int, with_ids: bool) -> list[tuple[int, Request]]:
    """N prompts of one PREFIX-token system prompt and SUFFIX tokens of their own; the first
    arrives alone, the rest two steps later."""
    rng = random.Random(3)
    prefix = [rng.randrange(vocab) for _ in range(PREFIX)]
    shared = chain_block_hashes([("system", b) for b in range(PREFIX // PAGE_TOKENS)])
    out = []
    for i in range(N):
        ids = prefix + [rng.randrange(vocab) for _ in range(SUFFIX)]
        r = Request(i, len(ids), SamplingParams(max_tokens=OUT, ignore_eos=True), 0.0,
                    prompt_token_ids=ids if with_ids else None,
                    block_hashes=None if with_ids else shared)
        out.append((0 if i == 0 else 2, r))
    return out


def _budget(kvt: int) -> int:
    return 1536 * kvt  # 96 blocks: a row without sharing holds 20, with it 4-5 of its own


def test_real_shared_blocks_fit_more_rows_and_give_the_same_tokens(tiny):
    ref, model, _ = tiny
    kvt = ref.spec.kv_bytes_per_token("float32")
    runs = {}
    for reuse in (False, True):
        sched = Scheduler(config(kv_bytes_per_token=kvt, kv_budget_bytes=_budget(kvt),
                                 max_num_seqs=N, row_step=1, kv_layout="paged",
                                 reuse_prefixes=reuse))
        watch = _Watch(MLXExecutor(model, kv_layout="paged"))
        trace = drive(sched, watch, _requests(ref.spec.vocab_size, with_ids=True))
        runs[reuse] = (watch, sched, {rid: r.output_token_ids for rid, r in trace.requests.items()})
    (off, _, tokens_off), (on, sched, tokens_on) = runs[False], runs[True]
    assert tokens_on == tokens_off
    assert sched.num_hit_tokens >= (N - 1) * PREFIX
    assert on.max_refs >= 3  # the cache and at least two rows reference one block
    assert off.max_refs == 1
    assert on.max_rows > off.max_rows + 2, (off.max_rows, on.max_rows)


def test_simulated_shared_blocks_fit_more_rows():
    from batchsim.server.executors.sim_executor import SimExecutor
    from batchsim.server.models.spec import zoo_spec
    from batchsim.server.perf.stepcost import StepCost

    from tests.sim_profile import PROFILE

    cost = StepCost(zoo_spec("tiny"), PROFILE, "float32", None)
    kvt = cost.kv_bytes_per_token
    rows = {}
    for reuse in (False, True):
        sched = Scheduler(config(kv_bytes_per_token=kvt, kv_budget_bytes=_budget(kvt),
                                 max_num_seqs=N, row_step=1, kv_layout="paged",
                                 reuse_prefixes=reuse))
        watch = _Watch(SimExecutor(cost, max_lookahead_steps=1, paged=True))
        drive(sched, watch, _requests(1000, with_ids=False))
        rows[reuse] = watch.max_rows
    assert rows[True] > rows[False] + 2, rows


def test_a_hit_too_big_beside_its_prefill_copy_prefills_from_the_start():
    """At a budget where a hit's blocks and its prefill cache's copy of them do not fit together
    but a plain prefill does, requests run (they waited forever when admission only tried the
    hit), in both layouts."""
    from batchsim.scheduler.pool_geometry import KV_STEP
    from batchsim.server.executors.sim_executor import SimExecutor
    from batchsim.server.models.spec import zoo_spec
    from batchsim.server.perf.stepcost import StepCost

    from tests.sim_profile import PROFILE

    cost = StepCost(zoo_spec("tiny"), PROFILE, "float32", None)
    kvt = cost.kv_bytes_per_token
    shared = chain_block_hashes([("system", b) for b in range(18)])  # 288 tokens
    for layout in ("padded", "paged"):
        sched = Scheduler(config(kv_bytes_per_token=kvt, kv_budget_bytes=3 * KV_STEP * kvt,
                                 max_num_seqs=4, row_step=1, kv_layout=layout,
                                 reuse_prefixes=True))
        arrivals = [(4 * i, Request(i, 310, SamplingParams(max_tokens=120, ignore_eos=True), 0.0,
                                    block_hashes=shared)) for i in range(4)]
        trace = drive(sched, SimExecutor(cost, max_lookahead_steps=1, paged=layout == "paged"),
                      arrivals, max_steps=5000)
        assert all(r.num_output_tokens == 120 for r in trace.requests.values())


def _pool_block_changes(reuse: bool) -> tuple[int, int]:
    """(plans that change the paged pool's block count, plans): requests of their own
    prompts (nothing shared, so cached blocks fill the budget) arriving while others prefill."""
    from batchsim.server.executors.sim_executor import SimExecutor
    from batchsim.server.models.spec import zoo_spec
    from batchsim.server.perf.stepcost import StepCost

    from tests.sim_profile import PROFILE

    cost = StepCost(zoo_spec("tiny"), PROFILE, "float32", None)
    kvt = cost.kv_bytes_per_token
    sched = Scheduler(config(kv_bytes_per_token=kvt, kv_budget_bytes=8192 * kvt, max_num_seqs=4,
                             row_step=1, kv_layout="paged", reuse_prefixes=reuse,
                             max_num_batched_tokens=256, prefill_step_size=256))
    arrivals = [(6 * i, Request(i, 1024, SamplingParams(max_tokens=8, ignore_eos=True), 0.0,
                                block_hashes=chain_block_hashes([(i, b) for b in range(64)])))
                for i in range(24)]
    trace = drive(sched, SimExecutor(cost, max_lookahead_steps=1, paged=True), arrivals)
    blocks = [p.pool.blocks for p in trace.plans]
    return sum(a != b for a, b in itertools.pairwise(blocks)), len(blocks)


def test_cached_blocks_at_the_budget_do_not_resize_the_pool_every_step():
    """Paged, the cache's blocks are pool blocks: at the budget each prefill chunk and join moved
    the pool by a few blocks, a whole-pool copy nearly every step (the Mooncake replay's TTFT
    regression). The cache keeps the pool's blocks, or shrinks it with headroom."""
    on, plans = _pool_block_changes(True)
    off, _ = _pool_block_changes(False)
    assert on <= off, (on, off, plans)


def test_a_paged_resize_that_keeps_the_blocks_does_not_price_copying_them():
    """DecodePool.resize leaves the block arrays alone when only rows or capacity change; the
    simulator priced a copy of every block (0.43 s a step on a full M2 Ultra pool)."""
    from batchsim.scheduler.pool_geometry import PoolGeometry
    from batchsim.server.executors.sim_executor import SimExecutor
    from batchsim.server.models.spec import zoo_spec
    from batchsim.server.perf.stepcost import StepCost

    from tests.sim_profile import PROFILE

    cost = StepCost(zoo_spec("tiny"), PROFILE, "float32", None)
    ex = SimExecutor(cost, paged=True)
    ex._resize(PoolGeometry(2, 256, 4096))
    capacity_only = ex._resize(PoolGeometry(2, 512, 4096))
    one_more_block = ex._resize(PoolGeometry(2, 512, 4097))
    assert capacity_only < one_more_block / 100, (capacity_only, one_more_block)
