"""The engine loop: arrivals keep their timing while steps compute, tokens stream out, and an
executor failure ends a run or, in a server, fails only the requests it touched."""

from __future__ import annotations

import asyncio
import time

import pytest

from scheduler.request import Request, RequestStatus, SamplingParams
from scheduler.scheduler import Scheduler
from server import clock
from server.engine import Engine
from server.fake_executor import FakeExecutor
from tests.drivers import config


class SlowExecutor(FakeExecutor):
    """Blocks its thread like real compute does."""

    def execute(self, plan, max_elapsed_s=float("inf")):
        time.sleep(self.step_s)
        return super().execute(plan, max_elapsed_s)


class FailingExecutor(FakeExecutor):
    def __init__(self, fail_at: int):
        super().__init__()
        self.calls, self.fail_at = 0, fail_at

    def execute(self, plan, max_elapsed_s=float("inf")):
        self.calls += 1
        if self.calls == self.fail_at:
            raise RuntimeError("device lost")
        return super().execute(plan, max_elapsed_s)


def req(rid: int, prompt: int = 20, out: int = 8, arrival: float = 0.0) -> Request:
    return Request(rid, prompt, SamplingParams(max_tokens=out, ignore_eos=True), arrival)


def test_arrivals_keep_their_timing_while_a_step_computes():
    async def main():
        engine = Engine(Scheduler(config()), SlowExecutor(step_s=0.05))
        engine.start_clock()
        loop_task = asyncio.create_task(engine.run())
        seen = []
        for i in range(10):  # one arrival every 20 ms, while each step blocks a thread for 50 ms
            await asyncio.sleep(0.02)
            seen.append(engine.now())
            engine.add(req(i, arrival=engine.now()))
        await asyncio.sleep(0.6)
        engine.stop()
        await loop_task
        engine.close()
        return seen, engine

    seen, engine = clock.run(main(), virtual=False)
    gaps = [b - a for a, b in zip(seen, seen[1:])]
    assert max(gaps) < 0.045  # never held up for a whole 50 ms step
    assert all(r.status is RequestStatus.FINISHED for r in engine.recorder.requests.values())


def test_streams_deliver_every_token_then_the_request():
    async def main():
        engine = Engine(Scheduler(config()), FakeExecutor(), virtual_time=True)
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
        engine = Engine(Scheduler(config(max_num_seqs=2)), executor, virtual_time=True,
                        on_error=on_error)
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
