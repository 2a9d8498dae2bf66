"""The asyncio workload driver on a real loop and on a virtual-clock loop (moved from
test_workloads.py)."""

from __future__ import annotations

import asyncio
import math
import selectors
import time

import numpy as np
import pytest
from batchsim.workloads.driver import LoopThrottler, drive
from batchsim.workloads.requests import RequestSpec, build_requests
from batchsim.workloads.spec import WorkloadSpec

# --- a loop whose clock only moves when it would otherwise block ---------------------------------

class _VirtualSelector(selectors.DefaultSelector):
    def __init__(self) -> None:
        super().__init__()
        self.now_s = 0.0

    def select(self, timeout: float | None = None):  # type: ignore[override]
        if timeout is None:
            raise RuntimeError("virtual loop would block forever: nothing scheduled")
        self.now_s += timeout
        return []


class VirtualLoop(asyncio.SelectorEventLoop):
    def __init__(self) -> None:
        super().__init__(_VirtualSelector())

    def time(self) -> float:
        return self._selector.now_s  # type: ignore[attr-defined]


def run_virtual(coro):
    loop = VirtualLoop()
    try:
        return loop.run_until_complete(coro)
    finally:
        loop.close()


# --- driver on a real event loop -----------------------------------------------------------------

def _reqs(n: int, gap_s: float = 0.0) -> list[RequestSpec]:
    return [RequestSpec(i, i * gap_s, 8, 8) for i in range(n)]


class InFlight:
    """A submit that sleeps `service_s` and records how many were in flight at once."""

    def __init__(self, service_s: float) -> None:
        self.service_s, self.now, self.peak, self.started = service_s, 0, 0, []

    async def __call__(self, req: RequestSpec) -> None:
        self.now += 1
        self.peak = max(self.peak, self.now)
        self.started.append(req.index)
        try:
            await asyncio.sleep(self.service_s)
        finally:
            self.now -= 1


def test_open_loop_issues_in_order_on_time():
    spec = WorkloadSpec(num_prompts=20, arrival="constant", request_rate=200.0)
    reqs = build_requests(spec)
    issued: list[tuple[int, float]] = []
    submit = InFlight(0.001)
    asyncio.run(drive(spec, reqs, submit, on_issue=lambda r, t: issued.append((r.index, t))))
    assert [i for i, _ in issued] == list(range(20)) == submit.started
    lateness = [t - reqs[i].arrival_s for i, t in issued]
    assert min(lateness) > -0.002 and max(lateness) < 0.05


def test_closed_loop_holds_concurrency():
    spec = WorkloadSpec(num_prompts=24, arrival="closed", concurrency=4)
    submit = InFlight(0.005)
    asyncio.run(drive(spec, _reqs(24), submit))
    assert submit.peak == 4 and submit.started == list(range(24))


def test_max_concurrency_caps_in_flight():
    spec = WorkloadSpec(num_prompts=12, request_rate=math.inf, max_concurrency=3)
    submit = InFlight(0.005)
    asyncio.run(drive(spec, _reqs(12), submit))
    assert submit.peak == 3 and submit.started == list(range(12))


def test_max_request_rate_caps_issue_rate():
    spec = WorkloadSpec(num_prompts=10, request_rate=math.inf, max_request_rate=50.0)
    issued: list[float] = []
    start = time.perf_counter()
    asyncio.run(drive(spec, _reqs(10), InFlight(0.0), on_issue=lambda r, t: issued.append(t)))
    assert time.perf_counter() - start >= 0.175
    assert min(np.diff(issued)) >= 0.0199


def test_submit_exception_propagates_and_cancels_the_rest():
    spec = WorkloadSpec(num_prompts=5, request_rate=math.inf)
    cancelled: list[int] = []

    async def submit(req: RequestSpec) -> None:
        if req.index == 2:
            raise RuntimeError("boom")
        try:
            await asyncio.sleep(10)
        except asyncio.CancelledError:
            cancelled.append(req.index)
            raise

    start = time.perf_counter()
    with pytest.raises(RuntimeError, match="boom"):
        asyncio.run(drive(spec, _reqs(5), submit))
    assert time.perf_counter() - start < 2 and sorted(cancelled) == [0, 1, 3, 4]


# --- driver on a virtual clock -------------------------------------------------------------------

def test_virtual_clock_poisson_takes_virtual_time_not_real():
    spec = WorkloadSpec(num_prompts=100, request_rate=1.0, seed=5)
    reqs = build_requests(spec)
    issued: list[float] = []

    async def main() -> float:
        loop = asyncio.get_running_loop()
        t0 = loop.time()
        await drive(spec, reqs, InFlight(0.5), on_issue=lambda r, t: issued.append(t))
        return loop.time() - t0

    start = time.perf_counter()
    virtual_s = run_virtual(main())
    assert time.perf_counter() - start < 1.0
    assert virtual_s == pytest.approx(99.5, abs=1e-6)  # last arrival at 99 s, then 0.5 s of service
    np.testing.assert_allclose(issued, [r.arrival_s for r in reqs], atol=1e-9)


def test_virtual_clock_throttle_fractional_rate():
    spec = WorkloadSpec(num_prompts=6, request_rate=math.inf, max_request_rate=2.5)
    issued: list[float] = []
    run_virtual(drive(spec, _reqs(6), InFlight(0.0), on_issue=lambda r, t: issued.append(t)))
    np.testing.assert_allclose(issued, [0.0, 0.4, 0.8, 1.2, 1.6, 2.0], atol=1e-6)


def test_virtual_clock_closed_loop_think_time():
    spec = WorkloadSpec(num_prompts=6, arrival="closed", concurrency=2, think_time_s=1.0)
    issued: list[float] = []
    run_virtual(drive(spec, _reqs(6), InFlight(2.0), on_issue=lambda r, t: issued.append(t)))
    # two users, each: 2 s of service then 1 s of thought
    np.testing.assert_allclose(issued, [0, 0, 3, 3, 6, 6], atol=1e-6)


def test_virtual_clock_failure_stops_issuing_early():
    spec = WorkloadSpec(num_prompts=50, arrival="constant", request_rate=1.0)
    issued: list[int] = []

    async def submit(req: RequestSpec) -> None:
        await asyncio.sleep(0.5)
        if req.index == 2:
            raise ValueError("bad request")

    with pytest.raises(ValueError, match="bad request"):
        run_virtual(drive(spec, _reqs(50, 1.0), submit,
                          on_issue=lambda r, t: issued.append(r.index)))
    assert issued == [0, 1, 2]  # the failure at 2.5 s stopped the dispatcher before 3 s


def test_a_submit_that_refuses_at_once_stops_issuing():
    """A submit may hand back a future already in flight (the engine's own) or raise while
    issuing; the raise ends the drive there and then."""
    spec = WorkloadSpec(num_prompts=5, arrival="constant", request_rate=1.0)
    issued: list[int] = []

    def submit(req: RequestSpec) -> asyncio.Future:
        if req.index == 2:
            raise ValueError("queue full")
        fut = asyncio.get_running_loop().create_future()
        fut.set_result(req.index)
        return fut

    with pytest.raises(ValueError, match="queue full"):
        run_virtual(drive(spec, _reqs(5, 1.0), submit, on_issue=lambda r,
                          t: issued.append(r.index)))
    assert issued == [0, 1, 2]


def test_cancelling_drive_cancels_in_flight():
    spec = WorkloadSpec(num_prompts=10, arrival="constant", request_rate=1.0)
    submit = InFlight(100.0)

    async def main() -> None:
        task = asyncio.ensure_future(drive(spec, _reqs(10, 1.0), submit))
        await asyncio.sleep(3.5)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    run_virtual(main())
    assert submit.started == [0, 1, 2, 3] and submit.now == 0


def test_loop_throttler_window():
    async def main() -> list[float]:
        loop = asyncio.get_running_loop()
        throttler = LoopThrottler(rate_limit=2, period=1.0)
        times = []
        for _ in range(5):
            async with throttler:
                times.append(loop.time())
        return times

    np.testing.assert_allclose(run_virtual(main()), [0, 0, 1, 1, 2], atol=1e-6)
