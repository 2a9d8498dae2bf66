"""A simulated plan in which every running row decodes, and the queue's head may be admitted, made
without a StepBudget (issue 37: in the simulated hour many plans only decode, and most of the rest
admit). The running rows are the lazy rows (lazy_rows.py: decoding, simulated, padded, no drafts)
and perhaps rows whose prefill just ended, joining the pool; no request is prefilling, no
prefill cache stays private, and the rows fit the budget one token wider (nobody is preempted).
Scheduler._plan would fit the pool's geometry for these rows one token wider in the whole budget,
admit from the queue while a first chunk fits (admit_plan.py), commit it with these members and
plan their decodes: this is that, step for step, so the same plan. tests/test_decode_plan.py and
tests/test_admit_plan.py hold the two equal."""

from __future__ import annotations

from collections import deque

from batchsim.scheduler.admit_plan import admissions, admit
from batchsim.scheduler.config import SchedulerConfig
from batchsim.scheduler.kv_manager import KVManager
from batchsim.scheduler.lazy_rows import REQUEST_ID, LazyRows
from batchsim.scheduler.lookahead import lookahead_steps
from batchsim.scheduler.plan import StepPlan, made
from batchsim.scheduler.request import Request


def decode_plan(lazy: LazyRows, running: list[Request], waiting: deque[Request], kv: KVManager,
                cfg: SchedulerConfig, requests: dict[int, Request], step_index: int,
                free_ids: list[int]) -> tuple[StepPlan, list[Request], int] | None:
    """The plan, its decode rows and the admitted requests' tokens (num_query_tokens: none was
    cached) when every running row decodes; None: the general path, nothing changed (a row
    prefilling, a prefill-first scheduler, rows that no longer fit the budget: a preemption, a
    head admit_plan.py leaves to it). The arguments: the Scheduler's. Lazy rows exist only in
    padded runs without drafts (Scheduler._lazy_ok)."""
    n = len(lazy.rows)
    if not n or cfg.policy == "prefill-first":
        return None
    s = lazy.steps  # widest_longest(), without its frame
    width, longest = lazy.max_computed0 + s + 1, lazy.max_tokens0 + s
    ids = lazy.id_set  # the pool's ids: the lazy rows' (commit holds this set: LazyRows.id_set)
    if len(running) > n:  # rows that join the pool this step (Scheduler._split_running)
        for r in running[n:]:
            c, tokens = r.num_computed_tokens, r.num_prompt_tokens + r.num_output_tokens
            if tokens - c > 1:
                return None  # still prefilling
            if tokens > longest:  # noqa: PLR1730
                longest = tokens
            if c + 1 > width:  # noqa: PLR1730
                width = c + 1
        ids = ids.union(map(REQUEST_ID, running[n:]))
    if kv.private and not ids.issuperset(kv.private):  # a prefill cache stays private
        return None
    geom = kv.geometry_for(len(running), width, cfg.kv_budget_bytes)  # StepBudget.fit_pool
    if geom is None:
        return None  # a row must be preempted
    decodes = running.copy()
    prefills, tokens = (), 0
    if waiting and len(running) < cfg.max_num_seqs:
        admitted = admissions(kv, cfg, waiting, len(running), geom, width, longest + 1)
        if admitted is None:
            return None
        geom, chunks, private, private_bytes = admitted
        new_requests, prefills, tokens = admit(waiting, running, chunks)
        kv_bytes = kv.commit(geom, ids, private, private_bytes)
    else:
        new_requests = ()
        kv_bytes = kv.commit(geom, ids, {}, 0)  # the joining rows' prefill caches end
    cache_ops, prefix = None, kv.prefix
    if prefix is not None and prefix.has_ops(prefills, requests):  # (Scheduler._step_plan)
        cache_ops, kv_bytes = kv.cache_ops(kv_bytes, list(prefills), requests)
    positions = lazy.columns(decodes)
    steps = 1 if prefills else lookahead_steps(decodes, geom, width, cfg.max_lookahead_steps,
                                               kv, lazy)
    return made(StepPlan, (  # every field, in order (Scheduler._step_plan)
        step_index, tuple(sorted(free_ids)) if free_ids else (), new_requests, prefills,
        *positions, geom, kv_bytes, steps, (), cache_ops, width)), decodes, tokens
