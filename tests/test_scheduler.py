"""Scheduler policy against a fake executor: budgets hold, FCFS holds, nothing starves, preemption
recomputes, lookahead changes nothing but speed. Property tests run thousands of random cases."""

from __future__ import annotations

import os
import sys

import pytest
from batchsim.scheduler.kv_manager import KVAccountError
from batchsim.scheduler.pool_geometry import KV_STEP, PoolGeometry, round_up
from batchsim.scheduler.request import RequestStatus
from batchsim.scheduler.scheduler import Scheduler
from batchsim.server.executors.fake_executor import FakeExecutor
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from tests.drivers import config, drive, make_request, random_arrivals, step_limits

EXAMPLES = int(os.environ.get("BATCHSIM_PROPERTY_EXAMPLES", "1500"))
KVT = 512  # KV bytes per token in these tests


def test_scheduler_does_not_import_mlx():
    # Policy is pure Python: importing it must not pull in MLX.
    import subprocess

    code = ("import batchsim.scheduler.scheduler, sys; "
            "print('mlx' in sys.modules or 'mlx.core' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


def test_decode_batch_and_prefill_chunks_share_a_step():
    s = Scheduler(config(max_num_seqs=4, max_num_batched_tokens=600, prefill_step_size=512))
    ex = FakeExecutor()
    a, b = make_request(1, 10, 5), make_request(2, 1000, 5)
    s.add_request(a)
    plan = s.schedule()
    assert [c.num_tokens for c in plan.prefills] == [10] and plan.decode_ids == ()
    s.update_from_output(plan, ex.execute(plan))
    s.add_request(b)
    plan = s.schedule()
    # a decodes (1 token); b gets the rest of the 600-token budget rounded down to a KV step.
    assert plan.decode_ids == (1,) and plan.decode_positions == (10,)
    assert [(c.request_id, c.start, c.num_tokens,
             c.sample) for c in plan.prefills] == [(2, 0, 512, False)]


def test_prefill_first_runs_prefill_only_steps():
    s = Scheduler(config(max_num_seqs=4, policy="prefill-first"))
    ex = FakeExecutor()
    s.add_request(make_request(1, 10, 5))
    plan = s.schedule()
    s.update_from_output(plan, ex.execute(plan))
    s.add_request(make_request(2, 300, 5))
    plan = s.schedule()
    assert plan.decode_ids == () and plan.prefills[0].request_id == 2


def test_rejects_what_can_never_fit():
    s = Scheduler(config(kv_budget_bytes=KVT * 512, max_model_len=2048))
    too_long = make_request(1, 2000, 100)
    too_big = make_request(2, 600, 10)  # round_up(610, 256) = 768 tokens > 512-token budget
    fits = make_request(3, 400, 100)  # 500 -> 512 tokens
    assert not s.add_request(too_long) and "context" in too_long.finish_reason
    assert not s.add_request(too_big) and "KV budget" in too_big.finish_reason
    assert s.add_request(fits)
    assert too_long.status is RequestStatus.REJECTED and s.num_rejected == 2


def test_rejection_is_worked_out_once_per_admissible_total(monkeypatch):
    """add_request remembers the prompt + max_tokens totals rejection_reason passed (it reads no
    more): a request of a total seen before is queued without asking again; a rejected total is
    asked, and rejected, every time."""
    s = Scheduler(config(kv_budget_bytes=KVT * 512, max_model_len=2048))
    asked = []
    reason = Scheduler.rejection_reason
    monkeypatch.setattr(Scheduler, "rejection_reason",
                        lambda self, r: asked.append(r.request_id) or reason(self, r))
    sizes = [(400, 100), (300, 200), (600, 10), (500, 110), (2000, 100), (450, 60)]
    results = [s.add_request(make_request(rid, *size)) for rid, size in enumerate(sizes)]
    assert results == [True, True, False, False, False, True]
    assert asked == [0, 2, 3, 4, 5] and s.num_rejected == 3


def test_newest_request_is_preempted_and_recomputed():
    # Budget for 3 KV steps of tokens: two 200-token requests grow past 256 and collide.
    s = Scheduler(config(kv_budget_bytes=KVT * 3 * KV_STEP, max_num_seqs=2, row_step=1))
    ex = FakeExecutor()
    old, new = make_request(1, 200, 100), make_request(2, 200, 100)
    trace = drive(s, ex, [(0, old), (0, new)])
    assert new.num_preemptions >= 1 and old.num_preemptions == 0
    assert trace.admitted[:2] == [1, 2]
    for r in (old, new):
        assert r.status is RequestStatus.FINISHED and r.num_output_tokens == 100
        assert r.output_token_ids == [FakeExecutor.token_for(r.request_id, 200 + i, 32000)
                                      for i in range(100)]


def test_pool_geometry_grows_in_steps_and_frees_when_idle():
    s = Scheduler(config(max_num_seqs=16, row_step=8))
    ex = FakeExecutor()
    reqs = [make_request(i, 100, 3) for i in range(3)]
    trace = drive(s, ex, [(0, r) for r in reqs])
    decode_plans = [p for p in trace.plans if p.decode_ids]
    assert decode_plans[0].pool == PoolGeometry(4, KV_STEP)  # 3 rows -> power of two
    assert trace.plans[-1].pool == PoolGeometry(0,
                                                0) or s.kv.pool_bytes == 0 or s.has_work() is False
    plan = s.schedule()  # frees the finished rows
    assert plan.kv_bytes == 0 and plan.pool == PoolGeometry(0, 0)


def test_integrity_check_catches_a_corrupt_account():
    s = Scheduler(config())
    ex = FakeExecutor()
    s.add_request(make_request(1, 300, 5))
    plan = s.schedule()
    s.update_from_output(plan, ex.execute(plan))
    s.kv.private[1] = s.kv.private[1]._replace(kv_bytes=s.kv.private[1].kv_bytes + 512 * KV_STEP)
    with pytest.raises(KVAccountError):
        s.check_integrity()


def test_integrity_check_catches_a_private_total_that_disagrees_with_the_caches():
    """The KV account keeps its private caches' bytes as a running total; check() adds them up
    again."""
    s = Scheduler(config())
    ex = FakeExecutor()
    s.add_request(make_request(1, 300, 5))
    plan = s.schedule()
    s.update_from_output(plan, ex.execute(plan))
    s.check_integrity()
    s.kv._private_bytes += 1
    with pytest.raises(KVAccountError, match="private caches counted"):
        s.check_integrity()


def test_lookahead_plans_match_single_steps():
    arrivals = [(i * 3, make_request(i, 50 + 37 * i, 20 + 11 * i)) for i in range(8)]
    single = drive(Scheduler(config(max_num_seqs=4)), FakeExecutor(), arrivals)
    arrivals = [(i * 3, make_request(i, 50 + 37 * i, 20 + 11 * i)) for i in range(8)]
    sched = Scheduler(config(max_num_seqs=4, max_lookahead_steps=64))
    multi = drive(sched, FakeExecutor(step_s=1.0, max_lookahead_steps=64), arrivals)
    assert len(multi.plans) < len(single.plans)
    assert any(p.num_steps > 1 for p in multi.plans)
    for rid, r in single.requests.items():
        m = multi.requests[rid]
        assert m.token_runs == r.token_runs
        assert m.output_token_ids == r.output_token_ids


class StopAfter:
    """A stop checker that matches once it has seen `n` tokens, as a stop string spanning several
    tokens would; it records what the scheduler fed it."""

    def __init__(self, n: int):
        self.n = n
        self.fed: list[list[int]] = []

    def feed(self, token_ids: list[int]) -> int | None:
        self.fed.append(list(token_ids))
        seen = sum(map(len, self.fed))
        return len(token_ids) - (seen - self.n) if seen >= self.n else None


def test_stop_checker_finishes_the_request_and_frees_its_kv_next_step():
    s = Scheduler(config(max_num_seqs=4, max_lookahead_steps=16))
    ex = FakeExecutor(step_s=1.0, max_lookahead_steps=16)
    stopped, other = make_request(1, 300, 50, ids=True), make_request(2, 300, 40, ids=True)
    stopped.stop_checker = StopAfter(5)
    trace = drive(s, ex, [(0, stopped), (0, other)])  # checks integrity every step
    assert (stopped.status, stopped.finish_reason) == (RequestStatus.FINISHED, "stop")
    assert stopped.num_output_tokens == 5
    assert stopped.stop_checker.fed == [[t] for t in stopped.output_token_ids]  # each step, once
    assert (other.finish_reason, other.num_output_tokens) == ("length", 40)
    last = max(i for i, p in enumerate(trace.plans) if 1 in p.decode_ids)
    assert trace.plans[last + 1].free_ids == (1,) and not s.kv.holds(1)
    # No lookahead while a checker watches (a stop may come at any token); after it, lookahead.
    assert all(p.num_steps == 1 for p in trace.plans[: last + 1])
    assert any(p.num_steps > 1 for p in trace.plans[last + 1:])


class FailingChecker:
    """A stop checker whose detokenizer breaks on its second step."""

    def __init__(self):
        self.calls = 0

    def feed(self, token_ids: list[int]) -> int | None:
        self.calls += 1
        if self.calls == 2:
            raise UnicodeDecodeError("utf-8", b"\xff", 0, 1, "bad byte")
        return None


def test_a_failing_stop_checker_ends_only_its_own_request(caplog):
    s = Scheduler(config(max_num_seqs=4))
    ex = FakeExecutor(step_s=1.0)
    broken, other = make_request(1, 40, 20, ids=True), make_request(2, 40, 20, ids=True)
    broken.stop_checker = FailingChecker()
    drive(s, ex, [(0, broken), (0, other)])  # checks integrity every step
    assert (broken.status, broken.finish_reason, broken.num_output_tokens) == (
        RequestStatus.ABORTED, "error", 2)
    assert (other.status, other.finish_reason, other.num_output_tokens) == (
        RequestStatus.FINISHED, "length", 20)
    assert "stop checker of request 1 failed" in caplog.text and not s.kv.holds(1)


@st.composite
def workloads(draw):
    reqs = draw(random_arrivals(24))
    cfg = dict(kv_budget_bytes=KVT * draw(st.integers(256, 12_000)), kv_bytes_per_token=KVT,
               max_model_len=2048, kv_layout=draw(st.sampled_from(["padded", "paged"])),
               **draw(step_limits(12)))
    return reqs, cfg


@settings(max_examples=EXAMPLES, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(workloads())
def test_random_workloads_keep_every_promise(case):
    reqs, cfg = case
    s = Scheduler(config(**cfg))
    ex = FakeExecutor(step_s=1.0, max_lookahead_steps=cfg["max_lookahead_steps"])
    arrivals = [(step, make_request(i, p, o)) for i, (step, p, o) in enumerate(reqs)]
    order = [r.request_id for _, r in sorted(arrivals, key=lambda a: a[0])]
    trace = drive(s, ex, arrivals)  # checks integrity and executor == scheduler bytes every step
    for plan in trace.plans:
        assert plan.kv_bytes <= cfg["kv_budget_bytes"]
        assert plan.num_scheduled_tokens <= cfg["max_num_batched_tokens"]
        assert len(plan.decode_ids) <= cfg["max_num_seqs"]
        for c in plan.prefills:  # only a request's final chunk ends off a KV step
            assert c.sample or (c.start + c.num_tokens) % KV_STEP == 0
    accepted = [rid for rid in order if trace.requests[rid].status is not RequestStatus.REJECTED]
    assert trace.admitted == accepted  # FCFS: first admissions in arrival order
    for rid, r in trace.requests.items():
        if r.status is RequestStatus.REJECTED:
            assert r.finish_reason and r.max_total_tokens > 0
            assert (r.max_total_tokens > cfg["max_model_len"]
                    or round_up(r.max_total_tokens, KV_STEP) * KVT > cfg["kv_budget_bytes"])
            continue
        assert r.status is RequestStatus.FINISHED and r.finish_reason == "length"
        assert r.num_output_tokens == r.sampling.max_tokens
        p = r.num_prompt_tokens
        expected = [FakeExecutor.token_for(rid, p + i, 32000) for i in range(r.num_output_tokens)]
        assert r.output_token_ids == expected  # preempted requests recompute the same tokens
    assert s.kv.private == {} and not s.running and not s.waiting


def test_scheduler_step_costs_under_a_millisecond_at_batch_64():
    # The policy's own time per step must never limit a real run (decode steps take 10-1000 ms).
    import time

    s = Scheduler(config(max_num_seqs=64, max_num_batched_tokens=4096))
    ex = FakeExecutor()
    for i in range(64):
        assert s.add_request(make_request(i, 100, 2_000))
    for _ in range(10):  # admissions and prefills
        plan = s.schedule()
        s.update_from_output(plan, ex.execute(plan))
    assert len(s.running) == 64
    assert all(r.num_tokens - r.num_computed_tokens == 1 for r in s.running)
    times = []
    for _ in range(300):
        t0 = time.perf_counter()
        plan = s.schedule()
        result = ex.execute(plan)
        s.update_from_output(plan, result)
        times.append(time.perf_counter() - t0)
        assert len(plan.decode_ids) == 64
    times.sort()
    assert times[len(times) // 2] < 1e-3, f"median {times[len(times) // 2] * 1e6:.0f} us"


GEOMETRY_BYTES = (48 * KV_STEP * KVT, 8 * 2 * KV_STEP * KVT, 3 * KV_STEP * KVT)  # few: repeated


@settings(max_examples=EXAMPLES // 5, deadline=None)
@given(st.lists(st.tuples(st.booleans(), st.sampled_from((0, 1, 4, 8, 9, 32, 33)),
                          st.builds(lambda k, d: max(0, k * KV_STEP + d), st.integers(0, 3),
                                    st.sampled_from((-1, 0, 1))),
                          st.sampled_from(GEOMETRY_BYTES)), min_size=1, max_size=40))
@example([(True, 8, 100, KVT << 20), (False, 4, 100, KVT << 20), (True, 32, 100, KVT << 20),
          (False, 4, 100, KVT << 20)])  # 4 rows keep a pool of 8, not one of 32
@example([(False, 4, KV_STEP, GEOMETRY_BYTES[0]), (False, 4, KV_STEP + 1, GEOMETRY_BYTES[0])])
def test_geometry_for_answers_as_next_geometry_for_the_pool_it_holds(queries):
    """KVManager.geometry_for remembers its answers per pool: each is next_geometry's for the
    pool held at the time (the same object when it keeps it), through pool changes. Lengths sit
    around multiples of KV_STEP and the byte budgets repeat, so a memo key that joins two
    lengths of different kv_steps (256 and 257 tokens: one KV step and two) answers wrong."""
    from batchsim.scheduler.kv_bytes import CacheLayout
    from batchsim.scheduler.kv_manager import KVManager
    from batchsim.scheduler.pool_geometry import next_geometry

    cache = CacheLayout.dense(KVT)
    kv = KVManager(48 * KV_STEP * KVT, cache, row_step=8, max_rows=32)
    for commit, rows, max_len, max_bytes in queries:
        got = kv.geometry_for(rows, max_len, max_bytes)
        want = next_geometry(kv.pool, rows, max_len, 8, 32, max_bytes, cache)
        assert got == want and (got is kv.pool) == (want is kv.pool), (rows, max_len, max_bytes)
        if commit and got is not None:
            kv.commit(got, set(), {}, 0)


def test_next_geometry_reads_max_len_only_as_kv_steps():
    """geometry_for's memo keys on kv_steps(max_len): next_geometry must read no more of it."""
    from batchsim.scheduler.kv_bytes import CacheLayout
    from batchsim.scheduler.pool_geometry import EMPTY_POOL, kv_steps, next_geometry

    cache = CacheLayout.dense(KVT)
    for pool in (EMPTY_POOL, PoolGeometry(8, 2 * KV_STEP)):
        for max_len in range(-1, 3 * KV_STEP + 2):
            top = kv_steps(max_len) * KV_STEP  # the longest max_len of the same key
            for max_bytes in (8 * 3 * KV_STEP * KVT, KV_STEP * KVT):
                got = next_geometry(pool, 4, max_len, 8, 32, max_bytes, cache)
                assert got == next_geometry(pool, 4, top, 8, 32, max_bytes, cache), max_len
                assert got is None or got.capacity_tokens >= top
