"""Prefix caching: chained block hashes, the scheduler's cache account, and reuse."""

from __future__ import annotations

import os
import random
import subprocess
import sys

import pytest
from batchsim.scheduler.pool_geometry import KV_STEP, PAGE_TOKENS
from batchsim.scheduler.prefix_cache import (
    chain_block_hashes,
    prompt_block_hashes,
    token_block_hashes,
)
from batchsim.scheduler.request import Request, SamplingParams
from batchsim.scheduler.scheduler import Scheduler
from batchsim.server.executors.mlx_executor import MLXExecutor

from tests.drivers import config, drive


def test_block_hashes_are_chained_and_cover_full_blocks_only():
    a = list(range(3 * PAGE_TOKENS + 5))
    b = a[:PAGE_TOKENS] + [999] + a[PAGE_TOKENS + 1:]  # differs in block 1
    ha, hb = token_block_hashes(a), token_block_hashes(b)
    assert len(ha) == 3
    assert ha[0] == hb[0] and ha[1] != hb[1] and ha[2] != hb[2]  # a change reaches every child
    assert token_block_hashes(a[:PAGE_TOKENS - 1]) == ()
    # the same block after a different parent hashes differently
    assert chain_block_hashes([1, 2])[1] != chain_block_hashes([3, 2])[1]


def test_block_hashes_do_not_depend_on_the_process_hash_seed():
    code = ("from batchsim.scheduler.prefix_cache import chain_block_hashes as c; "
            "print(c([('system', 0), ('system', 1), (7, 8)]))")
    outs = {subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                           env={**os.environ, "PYTHONHASHSEED": seed}, check=True).stdout
            for seed in ("1", "2")}
    assert len(outs) == 1


def test_request_block_hashes_come_from_the_workload_or_the_tokens():
    greedy = SamplingParams(max_tokens=4)
    ids = list(range(2 * PAGE_TOKENS))
    assert prompt_block_hashes(Request(0, len(ids), greedy, 0.0, ids)) == token_block_hashes(ids)
    given = chain_block_hashes([("sys", 0)])
    assert prompt_block_hashes(Request(1, 40, greedy, 0.0, block_hashes=given)) == given
    assert prompt_block_hashes(Request(2, 40, greedy, 0.0)) == ()
    with pytest.raises(ValueError, match="block hashes cover more"):
        Request(3, PAGE_TOKENS, greedy, 0.0, block_hashes=chain_block_hashes([1, 2]))


# -- the real executor ----------------------------------------------------------------------------
def _shared_specs(vocab: int, gap: int, out: int):
    """(arrival step, ids, output tokens): six prompts of one 300-token prefix and a suffix of
    their own, arriving `gap` steps apart."""
    rng = random.Random(1)
    prefix = [rng.randrange(vocab) for _ in range(300)]
    return [(gap * i, prefix + [rng.randrange(vocab) for _ in range(rng.randint(1, 40))], out)
            for i in range(6)]


def _run(model, kvt: int, specs, **cfg):
    sched = Scheduler(config(kv_bytes_per_token=kvt, **cfg))
    arrivals = [(step, Request(i, len(ids), SamplingParams(max_tokens=out, ignore_eos=True), 0.0,
                               prompt_token_ids=list(ids)))
                for i, (step, ids, out) in enumerate(specs)]
    ex = MLXExecutor(model, kv_layout=cfg.get("kv_layout", "padded"))
    trace = drive(sched, ex, arrivals)  # checks KV bytes every step
    return {rid: r.output_token_ids for rid, r in trace.requests.items()}, sched, trace


@pytest.mark.parametrize(("gap", "out", "budget_tokens", "layout"), [
    (3, 12, None, "padded"), (4, 220, 6 * KV_STEP, "padded"), (3, 12, None, "paged"),
    (4, 220, 4 * KV_STEP, "paged")])
def test_cached_prefixes_give_the_same_tokens(tiny, gap, out, budget_tokens, layout):
    """Later requests prefill only their suffix, and sample what they would without the cache;
    with a tight budget, under preemption and eviction too."""
    ref, model, _ = tiny
    kvt = ref.spec.kv_bytes_per_token("float32")
    specs = _shared_specs(ref.spec.vocab_size, gap, out)
    cfg = {"max_num_seqs": 4, "prefill_step_size": 256, "row_step": 1, "kv_layout": layout}
    if budget_tokens:
        cfg["kv_budget_bytes"] = budget_tokens * kvt
    off, _, _ = _run(model, kvt, specs, **cfg)
    on, sched, trace = _run(model, kvt, specs, reuse_prefixes=True, **cfg)
    assert sched.num_hit_tokens >= (288 if budget_tokens else 5 * 288)
    starts = [c.start for p in trace.plans for c in p.prefills if c.start % KV_STEP]
    assert starts and all(s % PAGE_TOKENS == 0 for s in starts)  # suffix-only prefills ran
    if budget_tokens:
        assert sched.num_preemptions > 0
        assert any(p.cache_ops and p.cache_ops.evict for p in trace.plans)
    assert on == off


# -- the simulator --------------------------------------------------------------------------------
def _simulate(shared_blocks: int) -> tuple[Scheduler, dict[int, float]]:
    """Six 600-token prompts a step apart; the first `shared_blocks` blocks named alike (as a
    workload with a shared system prompt names them). Returns each request's first-token time."""
    from batchsim.server.executors.sim_executor import SimExecutor
    from batchsim.server.models.spec import zoo_spec
    from batchsim.server.perf.stepcost import StepCost

    from tests.sim_profile import PROFILE

    spec = zoo_spec("tiny")
    cost = StepCost(spec, PROFILE, "float32", None)
    sched = Scheduler(config(kv_bytes_per_token=cost.kv_bytes_per_token, reuse_prefixes=True))
    ex = SimExecutor(cost, max_lookahead_steps=1)
    shared = chain_block_hashes([("system", b) for b in range(shared_blocks)])
    arrivals = [(i, Request(i, 600, SamplingParams(max_tokens=4, ignore_eos=True), 0.0,
                            block_hashes=shared)) for i in range(6)]
    first_s: dict[int, float] = {}
    trace = drive(sched, _Timed(ex, first_s), arrivals)  # checks KV bytes every step
    assert len(trace.requests) == 6
    return sched, first_s


class _Timed:
    """An executor wrapper noting when each request samples its first token."""

    def __init__(self, ex, first_s: dict[int, float]) -> None:
        self.ex, self.first_s, self.now_s = ex, first_s, 0.0

    def execute(self, plan, max_elapsed_s=float("inf")):
        result = self.ex.execute(plan)
        self.now_s += result.elapsed_s
        for rid in result.sampled_ids:
            self.first_s.setdefault(rid, self.now_s)
        return result


def test_the_simulator_prices_cached_prefixes_as_skipped_prefill():
    none, t_none = _simulate(0)
    shared, t_shared = _simulate(32)  # 512 of 600 tokens
    assert none.num_hit_tokens == 0 and none.kv.prefix.peak_bytes == 0
    assert shared.num_hit_tokens == 5 * 512
    assert shared.kv.prefix.peak_bytes == 32 * PAGE_TOKENS * shared.kv.cache.full_token_bytes
    # later requests prefill 88 tokens instead of 600: the last samples far sooner
    assert t_shared[5] < 0.5 * t_none[5]


def test_a_block_stored_and_evicted_in_one_step_reaches_the_executor_as_neither():
    """With room for one block, a step's second stored block evicts its first (a stored block is
    referenced by nobody): the plan carries neither for that one, since the executor evicts
    before it stores (`batchsim sweep`'s default real run raised KeyError in PrefixBlocks.evict).
    A block cached in an earlier step is evicted as before."""
    from batchsim.scheduler.prefix_cache import PrefixCache

    cache = PrefixCache(block_bytes=1)
    cache.store(0, 0, (11, 12), room_bytes=1)
    ops = cache.take_ops()
    assert ops.store == ((0, 1, 12),) and ops.evict == () and list(cache.blocks) == [12]
    cache.store(1, 0, (21,), room_bytes=1)
    ops = cache.take_ops()
    assert ops.evict == (12,) and ops.store == ((1, 0, 21),) and list(cache.blocks) == [21]
