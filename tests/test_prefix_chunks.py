"""Prompt blocks become cacheable as each prefill chunk completes (vLLM and mlx-lm's server cache
blocks as they fill), not only when a row joins the decode pool: a second request with the same
long prompt, arriving while the first is still prefilling it in chunks, reuses what is done."""

from __future__ import annotations

import random

import pytest
from batchsim.scheduler.pool_geometry import PAGE_TOKENS
from batchsim.scheduler.prefix_cache import chain_block_hashes
from batchsim.scheduler.request import Request, SamplingParams
from batchsim.scheduler.scheduler import Scheduler
from batchsim.server.executors.mlx_executor import MLXExecutor

from tests.drivers import config, drive

PROMPT, CHUNK, OUT = 1024, 256, 4  # four chunks; the second request arrives after the first


def _two_requests(ids: list[int] | None) -> list[tuple[int, Request]]:
    hashes = None if ids else chain_block_hashes([("doc", b) for b in range(PROMPT // PAGE_TOKENS)])
    return [(step, Request(i, PROMPT, SamplingParams(max_tokens=OUT, ignore_eos=True), 0.0,
                           prompt_token_ids=ids, block_hashes=hashes))
            for i, step in enumerate((0, 2))]


def _second_prefill_tokens(sched: Scheduler, executor, ids: list[int] | None) -> tuple[int, dict]:
    trace = drive(sched, executor, _two_requests(ids))
    computed = sum(c.num_tokens for p in trace.plans for c in p.prefills if c.request_id == 1)
    return computed, trace.requests


def _sim(layout: str):
    from batchsim.server.executors.sim_executor import SimExecutor
    from batchsim.server.models.spec import zoo_spec
    from batchsim.server.perf.stepcost import StepCost

    from tests.sim_profile import PROFILE

    cost = StepCost(zoo_spec("tiny"), PROFILE, "float32", None)
    ex = SimExecutor(cost, max_lookahead_steps=1, paged=layout == "paged")
    return ex, cost.kv_bytes_per_token


def _sched(layout: str, kvt: int, reuse: bool = True) -> Scheduler:
    return Scheduler(config(kv_bytes_per_token=kvt, kv_budget_bytes=8192 * kvt, max_num_seqs=4,
                            row_step=1, kv_layout=layout, reuse_prefixes=reuse,
                            prefill_step_size=CHUNK, max_num_batched_tokens=2 * CHUNK))


@pytest.mark.parametrize("layout", ["padded", "paged"])
def test_simulated_second_request_reuses_the_chunks_the_first_completed(layout):
    ex, kvt = _sim(layout)
    computed, _ = _second_prefill_tokens(_sched(layout, kvt), ex, None)
    # request 0's first chunks were done when request 1 arrived: it computes at most 3 of 4
    assert computed <= PROMPT - CHUNK, computed


@pytest.mark.parametrize("layout", ["padded", "paged"])
def test_real_second_request_reuses_chunks_and_samples_the_same_tokens(tiny, layout):
    ref, model, _ = tiny
    kvt = ref.spec.kv_bytes_per_token("float32")
    ids = [random.Random(5).randrange(ref.spec.vocab_size) for _ in range(PROMPT)]
    runs = {}
    for reuse in (False, True):
        computed, requests = _second_prefill_tokens(
            _sched(layout, kvt, reuse), MLXExecutor(model, kv_layout=layout), ids)
        runs[reuse] = computed, {rid: r.output_token_ids for rid, r in requests.items()}
    assert runs[False][0] == PROMPT
    assert runs[True][0] <= PROMPT - CHUNK, runs[True][0]
    assert runs[True][1] == runs[False][1]


def _evicted_while_prefilling(plans) -> bool:
    """Some plan evicts a block that a chunk stored before its request joined the pool."""
    stored_by, joined = {}, set()
    for p in plans:
        joined.update(p.decode_ids)
        ops = p.cache_ops
        if ops is not None:
            if any(stored_by.get(h, -1) not in joined | {-1} for h in ops.evict):
                return True
            stored_by.update({h: rid for rid, _, h in ops.store})
    return False


def test_real_blocks_evicted_while_their_request_prefills_leave_its_tokens_alone(tiny):
    """Paged, at a budget where blocks copied out of a prefill are evicted before their request
    joins (nobody references them): every request samples what it would without the cache."""
    ref, model, _ = tiny
    kvt = ref.spec.kv_bytes_per_token("float32")
    rng = random.Random(7)
    prompts = [[rng.randrange(ref.spec.vocab_size) for _ in range(1000)] for _ in range(2)]
    runs = {}
    for reuse in (False, True):
        sched = Scheduler(config(kv_bytes_per_token=kvt, kv_budget_bytes=4 * 256 * kvt,
                                 max_num_seqs=3, row_step=1, kv_layout="paged",
                                 reuse_prefixes=reuse, prefill_step_size=256,
                                 max_num_batched_tokens=512))
        arrivals = [(i, Request(i, 1000, SamplingParams(max_tokens=20, ignore_eos=True), 0.0,
                                prompt_token_ids=prompts[i % 2])) for i in range(4)]
        trace = drive(sched, MLXExecutor(model, kv_layout="paged"), arrivals)
        runs[reuse] = trace, {rid: r.output_token_ids for rid, r in trace.requests.items()}
    assert _evicted_while_prefilling(runs[True][0].plans)
    assert runs[True][1] == runs[False][1]


def test_a_joining_row_replaces_an_unreferenced_copy_of_its_block():
    """Paged: a block copied out of a prefill and not held (its request's hold did not fit, or
    another's chunk stored it) is replaced by the joining row's own block, not kept beside it."""
    from batchsim.scheduler.prefix_cache import PrefixCache

    cache = PrefixCache(block_bytes=1, shared=True)
    hashes = chain_block_hashes(range(2))
    cache.blocks[hashes[0]] = None  # a copy nobody references, stored in an earlier step
    cache.adopt(7, hashes)
    ops = cache.take_ops()
    assert ops.evict == (hashes[0],)  # the executor frees the copy before the row joins
    assert ops.store == ((7, 0, hashes[0]), (7, 1, hashes[1]))
    assert cache.held[7] == hashes and len(cache.blocks) == 2
    cache.pin(hashes[:1], holder=8)  # another row's reference: the next joiner keeps its own
    cache.adopt(9, hashes[:1])
    assert cache.take_ops() is None and cache.num_held(9) == 0
