"""The engine loop: arrivals keep their timing while steps compute, tokens stream out, and an
executor failure ends a run or, in a server, fails only the requests it touched."""

from __future__ import annotations

import asyncio
import logging
import threading

import pytest
from batchsim.scheduler.request import Request, RequestStatus, SamplingParams
from batchsim.scheduler.scheduler import Scheduler
from batchsim.server.distributed.channel import RankLost
from batchsim.server.engine import clock
from batchsim.server.engine.engine import Engine
from batchsim.server.executors.fake_executor import FakeExecutor

from tests.drivers import config


class FailingExecutor(FakeExecutor):
    def __init__(self, fail_at: int, error: Exception | None = None):
        super().__init__(virtual_time=True)
        self.calls, self.fail_at, self.error = 0, fail_at, error or RuntimeError("device lost")

    def execute(self, plan, max_elapsed_s=float("inf")):
        self.calls += 1
        if self.calls == self.fail_at:
            raise self.error
        return super().execute(plan, max_elapsed_s)


def req(rid: int, prompt: int = 20, out: int = 8, arrival: float = 0.0) -> Request:
    return Request(rid, prompt, SamplingParams(max_tokens=out, ignore_eos=True), arrival)


class GatedExecutor(FakeExecutor):
    """Each step holds its thread, as real compute does, until the test opens the gate."""

    def __init__(self):
        super().__init__()
        self.in_step, self.gate = threading.Event(), threading.Event()
        self.opened = []  # per step: True if the gate opened, False if the wait gave up

    def execute(self, plan, max_elapsed_s=float("inf")):
        self.in_step.set()
        self.opened.append(self.gate.wait(timeout=60))  # a deadlock guard, not a time bound
        return super().execute(plan, max_elapsed_s)


def test_arrivals_keep_their_timing_while_a_step_computes():
    """While a step holds the executor's thread, the loop keeps running: timers fire, requests
    arrive and are stamped with their own time. Only the test can end that step, so a loop held
    up by the step would never get to open the gate."""
    async def main():
        executor = GatedExecutor()
        engine = Engine(Scheduler(config()), executor)
        engine.start_clock()
        loop_task = asyncio.create_task(engine.run())
        first = engine.add(req(0, arrival=engine.now()))
        await asyncio.to_thread(executor.in_step.wait, 60)
        during = []
        for i in range(1, 6):
            await asyncio.sleep(0.001)  # a timer: it fires only if the loop is not held up
            during.append(engine.add(req(i, arrival=engine.now())))
        executor.gate.set()
        await asyncio.gather(first, *during)
        engine.stop()
        await loop_task
        engine.close()
        return engine, executor

    engine, executor = clock.run(main(), virtual=False)
    assert executor.opened and all(executor.opened)  # the first step ended when the test said
    first_step = engine.recorder.steps[0]
    assert first_step.num_prefill_requests == 1  # request 0 alone: the rest came during it
    arrivals = [r.arrival_s for r in engine.recorder.requests.values()]
    assert arrivals == sorted(arrivals) and len(set(arrivals)) == 6  # each stamped as it came
    assert all(first_step.start_s <= t < first_step.end_s for t in arrivals[1:])
    assert all(r.status is RequestStatus.FINISHED for r in engine.recorder.requests.values())


def test_streams_deliver_every_token_then_the_request():
    async def main():
        engine = Engine(Scheduler(config()), FakeExecutor(virtual_time=True))
        engine.start_clock()
        loop_task = asyncio.create_task(engine.run())
        queue = engine.stream(req(1, out=5))
        tokens = []
        while True:
            item = await queue.get()
            if isinstance(item, Request):
                break
            tokens.extend(item)
        engine.stop()
        await loop_task
        return tokens, item

    tokens, request = clock.run(main(), virtual=True)
    assert tokens == request.output_token_ids and len(tokens) == 5


def _run_with(executor, on_error: str):
    async def main():
        engine = Engine(Scheduler(config(max_num_seqs=2)), executor, on_error=on_error)
        engine.start_clock()
        loop_task = asyncio.create_task(engine.run())
        futures = [engine.add(req(i)) for i in range(4)]
        try:
            done = await asyncio.gather(*futures)
        finally:
            engine.stop()
            await loop_task
        return done, engine

    return clock.run(main(), virtual=True)


def test_a_failing_step_ends_a_run_by_default():
    with pytest.raises(RuntimeError, match="device lost"):
        _run_with(FailingExecutor(fail_at=3), "raise")


def test_a_server_fails_only_the_running_requests_and_serves_the_rest():
    done, engine = _run_with(FailingExecutor(fail_at=3), "abort")
    reasons = [r.finish_reason for r in done]
    assert reasons[:2] == ["error", "error"]  # running when the step failed
    assert reasons[2:] == ["length", "length"]  # queued then: served normally afterwards
    assert engine.num_executor_errors == 1
    assert engine.scheduler.kv.kv_bytes == 0 or not engine.scheduler.running


def test_a_step_failure_that_says_it_all_is_logged_in_one_line(caplog):
    """serve --ranks with a peer rank killed: the channel's RankLost was logged with a
    traceback (14 lines) before rank 0's one-line error; an ExecutorLost is one log line."""
    with caplog.at_level(logging.ERROR, logger="batchsim"):
        done, _ = _run_with(FailingExecutor(3, RankLost("lost a peer rank while exchanging "
                                                        "plans")), "abort")
    (record,) = caplog.records
    assert not record.exc_info and record.getMessage().endswith(": lost a peer rank while "
                                                                    "exchanging plans")
    assert [r.finish_reason for r in done][:2] == ["error", "error"]
    caplog.clear()
    with caplog.at_level(logging.ERROR, logger="batchsim"):
        _run_with(FailingExecutor(fail_at=3), "abort")  # anything else: its traceback
    assert caplog.records[0].exc_info is not None


@pytest.mark.parametrize("error, lost", [
    ("[ring] connection to a peer was lost", True),
    ("Send failed with errno=104", True),
    ("[METAL] Command buffer execution failed: Caused GPU Timeout Error", False),  # was RankLost
])
def test_only_a_transport_error_in_a_collective_is_a_lost_rank(monkeypatch, error, lost):
    """A Metal or MLX error in all_sum was labelled 'lost a peer rank', and lost its traceback."""
    import types

    import mlx.core as mx
    from batchsim.server.distributed.channel import PlanChannel

    def all_sum(x, group=None):
        raise RuntimeError(error)

    monkeypatch.setattr(mx.distributed, "all_sum", all_sum)
    group = types.SimpleNamespace(rank=lambda: 0, size=lambda: 2)
    with pytest.raises(RuntimeError) as raised:
        PlanChannel(group).send("plan")
    assert isinstance(raised.value, RankLost) == lost
    if not lost:  # the error itself, with the frames down to all_sum
        assert str(raised.value) == error and raised.traceback[-1].name == "all_sum"


def test_step_records_describe_each_plan():
    """The recorder builds a StepRecord per plan from positional fields (it runs every step):
    each field must land where its name says."""
    seen = []

    def on_step(engine, plan, result):
        s = engine.scheduler
        seen.append((plan, result, len(s.running), len(s.waiting)))

    async def main():
        executor = FakeExecutor(step_s=0.01, max_lookahead_steps=8, virtual_time=True)
        engine = Engine(Scheduler(config(max_num_seqs=2, max_lookahead_steps=8)), executor,
                        on_step=on_step)
        engine.start_clock()
        loop_task = asyncio.create_task(engine.run())
        futures = [engine.add(req(i, prompt=40 + 30 * i, out=6 + i)) for i in range(4)]
        await asyncio.gather(*futures)
        engine.stop()
        await loop_task
        return engine.recorder.steps

    steps = clock.run(main(), virtual=True)
    assert len(steps) == len(seen) and any(st.num_steps > 1 for st in steps)
    assert any(st.num_waiting for st in steps) and any(st.num_prefill_tokens for st in steps)
    for st, (plan, result, running, waiting) in zip(steps, seen):
        assert (st.step_index, st.num_steps, st.batch_size) == (
            plan.step_index, result.num_steps, len(plan.decode_ids))
        assert st.num_prefill_tokens == sum(c.num_tokens for c in plan.prefills)
        assert st.num_prefill_requests == len(plan.prefills)
        assert (st.num_running, st.num_waiting) == (running, waiting)
        assert (st.kv_bytes, st.kv_bytes_measured) == (plan.kv_bytes, result.kv_bytes)
        assert (st.pool_rows, st.pool_capacity_tokens) == (plan.pool.rows,
                                                           plan.pool.capacity_tokens)
        assert st.compute_s == pytest.approx(result.elapsed_s)
        assert st.end_s - st.start_s == pytest.approx(result.elapsed_s)


def test_the_engine_reports_to_the_recorder_it_is_given():
    """A server passes its bounded recorder at construction: it sees every arrival and token,
    and the engine keeps no request of its own."""
    from batchsim.server.http.prometheus import ServerRecorder

    recorder = ServerRecorder()

    async def main():
        engine = Engine(Scheduler(config()), FakeExecutor(virtual_time=True), recorder=recorder)
        engine.start_clock()
        loop_task = asyncio.create_task(engine.run())
        await asyncio.gather(*[engine.add(req(i, out=8)) for i in range(3)])
        engine.stop()
        await loop_task
        return engine

    engine = clock.run(main(), virtual=True)
    assert engine.recorder is recorder and engine.virtual_time
    assert (recorder.num_arrivals, recorder.generation_tokens, recorder.requests) == (3, 24, {})


class AbortingExecutor(FakeExecutor):
    """Aborts request `rid` while its `at`-th step computes, as a client leaving mid-step does."""

    def __init__(self, rid: int, at: int):
        super().__init__(virtual_time=True)
        self.rid, self.at, self.calls, self.engine = rid, at, 0, None

    def execute(self, plan, max_elapsed_s=float("inf")):
        self.calls += 1
        if self.calls == self.at:
            self.engine.abort(self.rid)
        return super().execute(plan, max_elapsed_s)


def test_a_request_aborted_mid_step_adds_no_generation_token():
    """The step computing when a request is aborted still samples its row, which the scheduler
    drops: serve's token counter counts what the requests got, no more."""
    from batchsim.server.http.prometheus import ServerRecorder

    recorder, executor = ServerRecorder(), AbortingExecutor(rid=1, at=4)

    async def main():
        engine = Engine(Scheduler(config()), executor, recorder=recorder)
        executor.engine = engine
        engine.start_clock()
        loop_task = asyncio.create_task(engine.run())
        done = await asyncio.gather(*[engine.add(req(i, out=8)) for i in range(2)])
        engine.stop()
        await loop_task
        return done

    done = clock.run(main(), virtual=True)
    assert [r.finish_reason for r in done] == ["length", "abort"]
    assert 0 < done[1].num_output_tokens < 8
    assert recorder.generation_tokens == sum(r.num_output_tokens for r in done)


def test_an_aborted_rows_accepted_drafts_are_not_generation_tokens():
    """A verify step whose row's request was aborted meanwhile: neither its sampled token nor
    its accepted drafts were emitted; the other row's were."""
    from batchsim.scheduler.plan import StepResult
    from batchsim.server.http.prometheus import ServerRecorder

    scheduler, recorder = Scheduler(config()), ServerRecorder()
    for i in range(2):
        scheduler.add_request(req(i, prompt=4, out=20))
    while not (plan := scheduler.schedule()).decode_ids:  # the prompts' prefill
        scheduler.update_from_output(plan, FakeExecutor(virtual_time=True).execute(plan))
    assert plan.decode_ids == (0, 1)
    aborted = scheduler.abort(1)
    before = aborted.num_output_tokens
    result = StepResult(1, (0, 1), None, (0.01,), plan.kv_bytes, ((7, 7), (7, 7, 7)), (3, 3))
    scheduler.update_from_output(plan, result)
    recorder.on_step(plan, result, 0.0, [0.01], scheduler)
    assert scheduler.requests[0].num_output_tokens == 1 + 3 and aborted.num_output_tokens == before
    assert recorder.generation_tokens == 3
