"""Admissions in a plan made without a StepBudget (decode_plan.py: every running row decodes):
Scheduler._admit_waiting admits the queue's head while its first chunk fits this step
(StepBudget.first_chunk, chunk, add_chunk); this decides the same, by the same functions
(chunk_fit.py), in the same order, first with nothing changed, so that a head the general path
treats otherwise (a one-token prompt that joins the pool, cached blocks to reuse, tokens already
computed) hands the plan back untouched, then applies them. tests/test_admit_plan.py holds the
plans equal."""

from __future__ import annotations

from collections import deque

from batchsim.scheduler.chunk_fit import chunk_fit
from batchsim.scheduler.config import SchedulerConfig
from batchsim.scheduler.kv_bytes import PrivateCache
from batchsim.scheduler.kv_manager import KVManager
from batchsim.scheduler.plan import NewRequest, PrefillChunk, made
from batchsim.scheduler.pool_geometry import PoolGeometry
from batchsim.scheduler.prefix_cache import prompt_block_hashes
from batchsim.scheduler.request import RUNNING, Request

# admissions' answer: the pool's geometry, (request, its first chunk's tokens), the private
# caches after the chunks and their bytes
Admissions = tuple[PoolGeometry, list[tuple[Request, int]], dict[int, PrivateCache], int]


def admissions(kv: KVManager, cfg: SchedulerConfig, waiting: deque[Request], rows: int,
               geom: PoolGeometry, width: int, len_later: int) -> Admissions | None:
    """Who is admitted beside `rows` decoding rows `width` tokens wide in `geom` (`len_later`:
    the longest row once everyone running decodes), nothing changed; None: a head this path
    does not take (the general path decides it)."""
    cache, prefix, budget_bytes = kv.cache, kv.prefix, cfg.kv_budget_bytes
    step = cfg.prefill_step_size
    rows_later, room = rows, cfg.max_num_seqs - rows
    tokens_left = cfg.max_num_batched_tokens - rows
    chunks: list[tuple[Request, int]] = []
    private: dict[int, PrivateCache] = {}
    private_bytes = 0
    for r in waiting:
        if len(chunks) >= room or tokens_left <= 0:
            break
        tokens = r.num_prompt_tokens + r.num_output_tokens
        n_later = tokens + 1 if tokens >= len_later else len_later  # as _admit_waiting
        if kv.geometry_for(rows_later + 1, n_later, budget_bytes) is None:
            break
        if tokens == 1 or r.num_computed_tokens or prefix is not None and (
                r.block_hashes or r.block_hashes is None and prompt_block_hashes(r)):
            # joins the pool (add_row), or reuses cached blocks (first_chunk; the hashes worked
            # out only when not yet kept on the request: most heads, without a frame)
            return None
        left = budget_bytes - private_bytes  # StepBudget.chunk from 0, fit, geometry
        pool_bytes = kv.pool_bytes if geom is kv.pool else cache.pool_bytes(geom)
        # nothing computed: no private cache held before (StepBudget.add_chunk's cache.private)
        n, tighter, growth_bytes = chunk_fit(cache, 0, 0, tokens, step, tokens_left,
                                             left - pool_bytes,
                                             lambda need, left=left: kv.geometry_for(rows, width,
                                                                                     left - need))
        if tighter is not None:
            geom = tighter
        if n <= 0:
            break
        # StepBudget.add_chunk's cache.private(0, n): no cache before (nothing computed), so its
        # growth is what it holds
        private[r.request_id] = made(PrivateCache, (0, n, growth_bytes))
        private_bytes += growth_bytes
        tokens_left -= n
        chunks.append((r, n))
        rows_later, len_later = rows_later + 1, n_later
    return geom, chunks, private, private_bytes


def admit(waiting: deque[Request], running: list[Request], chunks: list[tuple[Request, int]]
          ) -> tuple[tuple[NewRequest, ...], tuple[PrefillChunk, ...], int]:
    """The heads admissions chose run (_admit_waiting's bookkeeping): their NewRequests, their
    first chunks and their tokens (none cached)."""
    new_requests, prefills, query_tokens = [], [], 0
    for r, n in chunks:
        waiting.popleft()
        r.status = RUNNING
        running.append(r)
        ids = r.all_token_ids() if r.prompt_token_ids is not None else None
        tokens = r.num_prompt_tokens + r.num_output_tokens
        query_tokens += tokens
        if not r.num_preemptions:
            r.num_cached_tokens = 0
        new_requests.append(made(NewRequest, (r.request_id, tuple(ids) if ids else None,
                                              r.sampling, r.num_prompt_tokens, ())))
        prefills.append(made(PrefillChunk, (r.request_id, 0, n, n == tokens,
                                            not r.num_output_tokens)))
    return tuple(new_requests), tuple(prefills), query_tokens
