"""A simulated plan in which every running row decodes and nothing else can happen, made without
a StepBudget (issue 37: in the simulated hour such plans are 44% of 25,686). The running rows are
the lazy rows (lazy_rows.py: decoding, simulated, padded, no drafts) and perhaps rows whose prefill
just ended, joining the pool; no request is prefilling, no prefill cache stays private, and nobody
can be admitted (the queue is empty, or the rows are at max_num_seqs). Scheduler._plan would fit
the pool's geometry for these rows one token wider in the whole budget, commit it with these
members, admit nobody and plan their decodes: this is that, step for step, so the same plan.
tests/test_decode_plan.py holds the two equal."""

from __future__ import annotations

from collections.abc import Sized

from batchsim.scheduler.config import SchedulerConfig
from batchsim.scheduler.kv_manager import KVManager
from batchsim.scheduler.lazy_rows import REQUEST_ID, LazyRows
from batchsim.scheduler.lookahead import lookahead_steps
from batchsim.scheduler.plan import StepPlan, made
from batchsim.scheduler.request import Request


def decode_plan(lazy: LazyRows, running: list[Request], waiting: Sized, kv: KVManager,
                cfg: SchedulerConfig, requests: dict[int, Request], step_index: int,
                free_ids: list[int]) -> tuple[StepPlan, list[Request]] | None:
    """The plan and its decode rows when every running row decodes and nobody can be admitted;
    None: the general path (a row prefilling, a request admittable, a prefill-first scheduler,
    rows that no longer fit the budget: a preemption). The arguments: the Scheduler's."""
    n = len(lazy.rows)
    if ((waiting and len(running) < cfg.max_num_seqs) or not n or cfg.policy == "prefill-first"):
        return None
    width = lazy.max_computed0 + lazy.steps + 1  # widest_longest()[0], after this step
    ids = lazy.id_set.copy()
    if len(running) > n:  # rows that join the pool this step (Scheduler._split_running)
        for r in running[n:]:
            c = r.num_computed_tokens
            if r.num_prompt_tokens + r.num_output_tokens - c > 1:
                return None  # still prefilling
            if c + 1 > width:  # noqa: PLR1730
                width = c + 1
        ids.update(map(REQUEST_ID, running[n:]))
    if kv.private and not ids.issuperset(kv.private):  # a prefill cache stays private
        return None
    geom = kv.geometry_for(len(running), width, cfg.kv_budget_bytes)
    if geom is None:
        return None
    kv_bytes = kv.commit(geom, ids, {}, 0)  # the joining rows' prefill caches end
    cache_ops = None
    if kv.prefix is not None and kv.prefix.pending:  # committing evicted cached blocks
        cache_ops, kv_bytes = kv.cache_ops(kv_bytes, [], requests)
    decodes = running.copy()
    positions = lazy.columns(decodes)
    steps = lookahead_steps(decodes, geom, width, cfg.max_lookahead_steps, kv, lazy)
    return made(StepPlan, (  # every field, in order (Scheduler._step_plan)
        step_index, tuple(sorted(free_ids)) if free_ids else (), (), (), *positions, geom,
        kv_bytes, steps, (), cache_ops, width)), decodes
