"""The simulated fast path of update_from_output (scheduler/advance.py, and the decode rows it
advances lazily, scheduler/lazy_rows.py) against the general path: random small workloads, with
aborts while a step runs, preemption, shared prefixes, padded and paged pools, give the same
plans, finishes and request counters either way, at the end and when settled part-way."""

from __future__ import annotations

import dataclasses
import pickle
import random

import pytest
from batchsim.scheduler import scheduler as scheduler_module
from batchsim.scheduler.lazy_rows import LazyRows, Positions
from batchsim.scheduler.scheduler import Scheduler
from batchsim.server.engine.run_config import RunConfig
from batchsim.server.engine.runner import run_workload
from batchsim.server.engine.session import open_session
from batchsim.server.executors.fake_executor import FakeExecutor
from batchsim.server.executors.sim_executor import SimExecutor

from tests.drivers import config, make_request


def _state(r) -> tuple:
    return (r.request_id, r.status, r.finish_reason, r.num_computed_tokens, r.num_output_tokens,
            r.num_preemptions, [list(run) for run in r.token_runs])


def _requests(rng: random.Random) -> tuple[list[tuple[int, int]], dict]:
    """Arrival steps and requests: some with token ids (never lazy), some sharing prefixes."""
    arrivals = sorted((rng.randrange(30), rid) for rid in range(rng.randint(3, 14)))
    requests = {}
    for _, rid in arrivals:
        r = make_request(rid, rng.randint(1, 250), rng.randint(1, 120), ids=rng.random() < 0.15)
        if r.prompt_token_ids is None and rng.random() < 0.5:  # a shared prefix of 1-4 blocks
            blocks = min(rng.randint(1, 4), r.num_prompt_tokens // 16)
            r = dataclasses.replace(r, block_hashes=tuple(range(blocks)))
        requests[rid] = r
    return arrivals, requests


def _run(seed: int, fast: bool, stop_at: int | None = None) -> tuple[list, list, list]:
    """Plans, finished ids per step and request states of one random workload (after
    `stop_at` plans, settled there, if given)."""
    rng = random.Random(seed)
    tight_bytes = 3 * 256 * 512  # three KV steps: rows growing past 256 tokens collide
    cfg = config(max_num_seqs=rng.choice([2, 4, 8]), row_step=1, kv_bytes_per_token=512,
                 kv_budget_bytes=rng.choice([1 << 40, tight_bytes]),
                 max_num_batched_tokens=512, prefill_step_size=256,
                 max_lookahead_steps=rng.choice([1, 16]),
                 policy=rng.choice(["decode-first", "prefill-first"]),
                 kv_layout=rng.choice(["padded", "paged"]), reuse_prefixes=rng.random() < 0.5)
    sched, ex = Scheduler(cfg), FakeExecutor(step_s=1.0, max_lookahead_steps=16)
    arrivals, requests = _requests(rng)
    plans, finished, step, i = [], [], 0, 0
    while (i < len(arrivals) or sched.has_work()) and len(plans) != stop_at:
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
    sched.settle()
    return plans, finished, [_state(r) for r in requests.values()]


@pytest.mark.parametrize("seed", range(32))
def test_fast_path_matches_the_general_path(seed, monkeypatch):
    calls = []
    fast = Scheduler._advance_simulated
    monkeypatch.setattr(Scheduler, "_advance_simulated",
                        lambda *a: calls.append(fast(*a)) or calls[-1])
    assert _run(seed, fast=True) == _run(seed, fast=False)
    assert any(calls)  # the fast path ran


@pytest.mark.parametrize("seed", range(32))
def test_lazy_rows_settle_to_the_general_paths_counters(seed):
    """Stopped after any number of plans (an interrupted run), the settled requests equal the
    general path's."""
    stop_at = random.Random(seed).randint(1, 40)
    assert _run(seed, fast=True, stop_at=stop_at) == _run(seed, fast=False, stop_at=stop_at)


def test_lazy_rows_carry_the_decoding_rows(monkeypatch):
    """Padded, without drafts: a row joins the lazy rows when its prefill ends, before its first
    decode step (LazyRows.join_ready), and is never advanced row by row; the plans' positions and
    the finishes stay the general path's."""
    eager_rows, fresh = [], []
    fast_advance, join_ready = scheduler_module.advance_decoded, LazyRows.join_ready
    monkeypatch.setattr(scheduler_module, "advance_decoded",
                        lambda rows, *a: eager_rows.append(len(rows)) or fast_advance(rows, *a))

    def counted(lazy: LazyRows, *args) -> None:
        before = len(lazy.rows)
        join_ready(lazy, *args)
        fresh.append(len(lazy.rows) - before)

    monkeypatch.setattr(LazyRows, "join_ready", counted)
    sched, ex = Scheduler(config(max_num_seqs=8)), FakeExecutor(step_s=1.0)
    requests = [make_request(rid, 10 + rid, 40 + 3 * rid) for rid in range(8)]
    for r in requests:
        sched.add_request(r)
    plans = 0
    while sched.has_work():
        plan = sched.schedule()
        sched.update_from_output(plan, ex.execute(plan)._replace(token_ids=None))
        plans += 1
    assert plans > 40 and sum(eager_rows) == 0 and sum(fresh) == 8
    assert [r.num_output_tokens for r in requests] == [40 + 3 * rid for rid in range(8)]
    assert [r.token_runs for r in requests] == [[[0, 40 + 3 * rid]] for rid in range(8)]


@pytest.mark.parametrize("seed", range(8))
def test_plans_carry_their_decode_width(seed):
    """A plan's decode_width is what an executor would work out from its positions (the sim
    executor reads it instead), preemption, prefill-only steps and paged pools included."""
    plans, _, _ = _run(seed, fast=True)
    assert any(p.decode_ids for p in plans)
    assert [p.decode_width for p in plans] == [
        max(p.decode_positions) + 1 if p.decode_ids else 0 for p in plans]


def test_positions_are_the_tuple_they_stand_for():
    lazy, rows = LazyRows(), [make_request(rid, 8, 50) for rid in range(3)]
    for r, computed in zip(rows, (5, 7, 9)):
        r.num_computed_tokens = computed
    lazy.add(rows[0])
    lazy.add(rows[1])
    assert lazy.advance(3, rows) == []  # two lazy rows, three steps on; the third joins
    ids, p = lazy.columns(rows)
    assert type(p) is Positions and ids == (0, 1, 2)
    assert p == (8, 10, 9) and (8, 10, 9) == p and p != (8, 10) and hash(p) == hash((8, 10, 9))
    assert (p[0], p[1], p[2], p[-1], p[0:2], len(p), max(p), p.pooled) == (8, 10, 9, 9, (8, 10),
                                                                              3, 10, 2)
    assert type(pickle.loads(pickle.dumps(p))) is tuple and repr(p) == "(8, 10, 9)"


def test_a_row_that_joins_when_its_prefill_ends_is_not_pooled_till_it_decodes():
    """A row joins the lazy rows once its prefill sampled its first token (join_ready), before
    it decodes: a plan's Positions counts it after the pooled rows (the simulated executor
    joins it to its pool), at its Request's position; the step that decodes every row pools it.
    A row whose last token came earlier, or that is still prefilling, does not join."""
    from batchsim.scheduler.request import RUNNING

    lazy, rows = LazyRows(), [make_request(rid, 8, 50) for rid in range(4)]
    for r, computed in zip(rows, (5, 7, 8, 8)):
        r.num_computed_tokens, r.status = computed, RUNNING
    lazy.add(rows[0])
    lazy.add(rows[1])
    assert lazy.advance(3, rows) == []
    rows[2].num_output_tokens, rows[2].token_runs = 1, [[4, 5]]  # its prefill sampled at step 4
    rows[3].num_output_tokens, rows[3].token_runs = 1, [[2, 3]]  # not in the step ending at 5
    lazy.join_ready(rows, 5)
    ids, p = lazy.columns(rows[:3])
    assert (lazy.fresh, ids, p, p.pooled, p.tail) == (1, (0, 1, 2), (8, 10, 8), 2, (8,))
    assert lazy.advance(1, rows) == []
    ids, p = lazy.columns(rows[:3])
    assert (lazy.fresh, ids, p, p.pooled, p.tail) == (0, (0, 1, 2), (9, 11, 9), 3, ())
    lazy.join_ready(rows, 6)  # rows[3]'s last token ended at step 3
    assert len(lazy.rows) == 3


def test_the_simulated_executor_joins_rows_without_making_positions_whole(monkeypatch, tmp_path):
    """The hour's workload, shortened: its plans carry lazy rows' positions (Positions), and the
    simulated executor finds the rows that join after the pooled ones, never building a whole
    tuple of positions (the records read none)."""
    made, whole, joins = [], [], []
    execute, values, join = SimExecutor.execute, Positions.values, SimExecutor._join

    def checked_execute(ex: SimExecutor, plan, *args):  # the plans that carry Positions
        made.append(type(plan.decode_positions) is Positions)
        return execute(ex, plan, *args)

    def checked_join(ex: SimExecutor, plan) -> float:  # the rows it skips are in the pool
        positions = plan.decode_positions
        joins.append(type(positions) is Positions)
        assert ex.layout.in_pool.issuperset(plan.decode_ids[:getattr(positions, "pooled", 0)])
        return join(ex, plan)

    monkeypatch.setattr(SimExecutor, "_join", checked_join)
    monkeypatch.setattr(SimExecutor, "execute", checked_execute)
    monkeypatch.setattr(Positions, "values", lambda p: whole.append(1) or values(p))
    base = RunConfig(model="llama-3.1-8b", executor="sim", device_profile="M2 Ultra", quantize=4)
    workload = dataclasses.replace(base.workload, num_prompts=200, request_rate=5.0, seed=3)
    session = open_session(dataclasses.replace(base, workload=workload))
    outcome = run_workload(session, workload, out_dir=tmp_path, label="positions",
                           timeline=False)
    assert sum(made) > outcome.summary["num_plans"] // 2 and not whole and sum(joins) > 100


def test_the_pool_members_a_plan_shares_with_the_lazy_rows_survive_them():
    """A decode plan hands the lazy rows' id set itself to the KV manager as its pool members
    (decode_plan, no copy; rows that join the lazy rows make a new set first, or their plan
    hands the manager one: LazyRows.join_ready, absorb): an abort
    between steps (settling the lazy rows) must leave the rows still running held, and every
    finished or aborted row is freed by the next plan (in its free_ids, no KV held after it),
    on plans of either kind. The account is checked after every step."""
    sched = Scheduler(config(max_num_seqs=4, kv_bytes_per_token=512, max_lookahead_steps=1))
    ex = FakeExecutor(step_s=1.0)
    arrivals = {0: range(4), 3: [4], 6: [5], 9: [6]}  # the later ones join as rows finish
    shared = joined = 0
    gone, releasing = None, set()
    for step in range(40):
        for rid in arrivals.get(step, ()):
            sched.add_request(make_request(rid, 8, 5 + 10 * (rid % 4)))
        plan = sched.schedule()
        assert releasing <= set(plan.free_ids), (releasing, plan.free_ids)
        assert not any(sched.kv.holds(rid) for rid in releasing)  # freed by its release step
        if sched.kv.pool_members is sched.lazy.id_set:
            shared += 1
        if sched.lazy.fresh:  # rows joined when their prefill ended: the members a new set,
            joined += 1  # finished rows in it till freed
        done = sched.update_from_output(plan, ex.execute(plan)._replace(token_ids=None))
        releasing = {r.request_id for r in done}
        if gone is None and sched.kv.pool_members is sched.lazy.id_set and sched.running[1:]:
            gone = sched.running[1]
            sched.abort(gone.request_id)  # settles the lazy rows
            releasing.add(gone.request_id)
        sched.check_integrity()  # every running row with KV is held, nothing else
        if not sched.has_work():
            break
    assert shared > 1 and joined > 0 and gone is not None and gone.finish_reason == "abort"
    assert not sched.has_work() and not sched.kv.pool_members
