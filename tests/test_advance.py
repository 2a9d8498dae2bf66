"""The simulated fast path of update_from_output (scheduler/advance.py) against the general path:
random small workloads, with aborts while a step runs, give the same plans, finishes and request
counters either way."""

from __future__ import annotations

import random

import pytest
from batchsim.scheduler import scheduler as scheduler_module
from batchsim.scheduler.scheduler import Scheduler
from batchsim.server.executors.fake_executor import FakeExecutor

from tests.drivers import config, make_request


def _state(r) -> tuple:
    return (r.request_id, r.status, r.finish_reason, r.num_computed_tokens, r.num_output_tokens,
            r.num_preemptions, [list(run) for run in r.token_runs])


def _run(seed: int, fast: bool) -> tuple[list, list, list]:
    """Plans, finished ids per step and final request states of one random workload."""
    rng = random.Random(seed)
    tight_bytes = 3 * 256 * 512  # three KV steps: rows growing past 256 tokens collide
    cfg = config(max_num_seqs=rng.choice([2, 4, 8]), row_step=1, kv_bytes_per_token=512,
                 kv_budget_bytes=rng.choice([1 << 40, tight_bytes]),
                 max_num_batched_tokens=512, prefill_step_size=256,
                 max_lookahead_steps=rng.choice([1, 16]),
                 policy=rng.choice(["decode-first", "prefill-first"]),
                 kv_layout=rng.choice(["padded", "paged"]))
    sched, ex = Scheduler(cfg), FakeExecutor(step_s=1.0, max_lookahead_steps=16)
    arrivals = sorted((rng.randrange(30), rid, rng.randint(1, 250), rng.randint(1, 120))
                      for rid in range(rng.randint(3, 14)))
    requests = {rid: make_request(rid, p, m) for _, rid, p, m in arrivals}
    plans, finished, step, i = [], [], 0, 0
    while i < len(arrivals) or sched.has_work():
        while i < len(arrivals) and arrivals[i][0] <= step:
            sched.add_request(requests[arrivals[i][1]])
            i += 1
        if not sched.has_work():
            step = arrivals[i][0]
            continue
        plan = sched.schedule()
        horizon = arrivals[i][0] - step if i < len(arrivals) else float("inf")
        result = ex.execute(plan, max_elapsed_s=horizon)._replace(token_ids=None)  # simulated
        if sched.running and rng.random() < 0.05:  # aborted while the step ran
            sched.abort(rng.choice(sched.running).request_id)
        # plan._replace(): equal, not the plan the scheduler made, so the general path
        done = sched.update_from_output(plan if fast else plan._replace(), result)
        sched.check_integrity()
        plans.append(plan)
        finished.append([r.request_id for r in done])
        step += result.num_steps
    return plans, finished, [_state(r) for r in requests.values()]


@pytest.mark.parametrize("seed", range(24))
def test_fast_path_matches_the_general_path(seed, monkeypatch):
    calls = []
    fast_advance = scheduler_module.advance_decoded
    monkeypatch.setattr(scheduler_module, "advance_decoded",
                        lambda *a: calls.append(1) or fast_advance(*a))
    assert _run(seed, fast=True) == _run(seed, fast=False)
    assert calls  # the fast path ran
