"""Send a request list to a server (real or simulated) on the asyncio clock.

Time comes only from `loop.time()` and `asyncio.sleep`, so the same driver runs on a real event
loop or on one whose clock is virtual (the simulator's): nothing here reads wall-clock time.
"""

from __future__ import annotations

import asyncio
import signal
from collections import deque
from collections.abc import Awaitable, Callable, Iterable, Sequence
from typing import Any

from asyncio_throttle import Throttler
from batchsim.server.platform.signals import STOP_SIGNALS
from batchsim.workloads.requests import RequestSpec
from batchsim.workloads.spec import WorkloadSpec

# A coroutine (run as a task), or a future already in flight (the engine's own: no task needed).
Submit = Callable[[RequestSpec], Awaitable[Any]]
OnIssue = Callable[[RequestSpec, float], None]
_EPS_S = 1e-9  # float slack so a virtual clock landing a hair short of an expiry still frees it


class LoopThrottler(Throttler):
    """asyncio_throttle.Throttler (at most `rate_limit` acquisitions in any `period` seconds) on
    the running loop's clock instead of time.monotonic(), so it also works under a virtual-time
    loop. It sleeps until the oldest slot expires rather than polling every retry_interval
    (polling would cost a loop turn per 10 ms of virtual time)."""

    def __init__(self, rate_limit: int, period: float = 1.0, retry_interval: float = 0.01) -> None:
        super().__init__(rate_limit, period, retry_interval)
        self._issued_s: deque[float] = deque()

    def flush(self) -> None:
        now = asyncio.get_running_loop().time()
        while self._issued_s and now - self._issued_s[0] >= self.period - _EPS_S:
            self._issued_s.popleft()

    async def acquire(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            self.flush()
            if len(self._issued_s) < self.rate_limit:
                break
            await asyncio.sleep(max(self._issued_s[0] + self.period - loop.time(), 0.0))
        self._issued_s.append(loop.time())


def rate_throttler(max_request_rate: float | None) -> LoopThrottler | None:
    # One issue per 1/rate seconds: fractional rates (2.5/s) work and issues never bunch up.
    if max_request_rate is None:
        return None
    return LoopThrottler(rate_limit=1, period=1.0 / max_request_rate)


async def _settle(futures: Iterable[asyncio.Future]) -> None:
    """Cancel what is still running and wait for it, retrieving every exception (no log noise)."""
    running = [f for f in futures if not f.done()]
    for fut in running:
        fut.cancel()
    if running:
        await asyncio.gather(*running, return_exceptions=True)


async def drive(
    spec: WorkloadSpec,
    requests: Sequence[RequestSpec],
    submit: Submit,
    *,
    on_issue: OnIssue | None = None,
) -> None:
    """Issue `requests` following `spec` and return when every submit has finished.

    Open loop: each request is issued at t0 + arrival_s (later if max_request_rate or
    max_concurrency holds it back; issues stay in order). Closed loop: `concurrency` workers share
    the list, each awaiting submit, then thinking think_time_s. `on_issue(req, offset_s)` is called
    as each submit starts. The first exception from submit cancels the rest and propagates;
    cancelling drive cancels every submit in flight.
    """
    if not requests:
        return
    if spec.closed_loop:
        await _drive_closed(spec, requests, submit, on_issue)
    else:
        await _drive_open(spec, requests, submit, on_issue)


async def _drive_open(
    spec: WorkloadSpec, requests: Sequence[RequestSpec], submit: Submit, on_issue: OnIssue | None
) -> None:
    loop = asyncio.get_running_loop()
    t0 = loop.time()
    throttler = rate_throttler(spec.max_request_rate)
    slots = asyncio.Semaphore(spec.max_concurrency) if spec.max_concurrency else None
    # Only requests in flight are held: a long replay issues tens of thousands, and gathering
    # them all at the end would cost a callback each.
    in_flight: set[asyncio.Future] = set()
    failures: list[BaseException] = []

    def on_done(fut: asyncio.Future) -> None:
        in_flight.discard(fut)
        if slots is not None:
            slots.release()
        if not fut.cancelled() and fut.exception() is not None:  # retrieved: no log noise
            failures.append(fut.exception())
            issuing.cancel()  # fail fast: stop issuing

    def issue(req: RequestSpec) -> None:
        if on_issue is not None:
            on_issue(req, loop.time() - t0)
        fut = asyncio.ensure_future(submit(req))
        fut.add_done_callback(on_done)
        in_flight.add(fut)

    async def dispatch() -> None:
        # Sequential, so the semaphore and throttle hold back requests strictly in arrival order.
        for req in requests:
            delay_s = t0 + req.arrival_s - loop.time()
            if delay_s > 0:
                await asyncio.sleep(delay_s)
            if throttler is not None:
                await throttler.acquire()
            if slots is not None:
                await slots.acquire()
            issue(req)

    if throttler is None and slots is None:
        issuing = _issue_at_arrivals(loop, t0, requests, issue)
    else:
        issuing = loop.create_task(dispatch())
    try:
        try:
            await issuing
            if in_flight:
                await asyncio.gather(*in_flight)
        except asyncio.CancelledError:
            if not failures:  # drive itself was cancelled
                raise
        if failures:
            raise failures[0] from None
    finally:
        await _settle([issuing, *in_flight])


def _issue_at_arrivals(
    loop: asyncio.AbstractEventLoop, t0: float, requests: Sequence[RequestSpec],
    issue: Callable[[RequestSpec], None],
) -> asyncio.Future:
    """Issue each request from a timer callback at its arrival time; the future completes when all
    are issued, and cancelling it stops issuing. The same schedule as sleeping between issues in a
    task, without a task wake-up per request (most of the driver's cost in a long simulation)."""
    done = loop.create_future()
    pending: list[asyncio.TimerHandle] = []

    def issue_from(first: int) -> None:  # called when request `first` is due
        pending.clear()
        if done.done():  # cancelled this turn, before its callback cancelled this timer
            return
        try:
            issue(requests[first])
            for i in range(first + 1, len(requests)):
                when = t0 + requests[i].arrival_s
                if when > loop.time():
                    pending.append(loop.call_at(when, issue_from, i))
                    return
                issue(requests[i])
        except Exception as exc:  # noqa: BLE001 -- from a timer callback it would only be logged
            if not done.done():
                done.set_exception(exc)
            return
        if not done.done():
            done.set_result(None)

    def stop(_: asyncio.Future) -> None:
        for timer in pending:
            timer.cancel()

    done.add_done_callback(stop)
    pending.append(loop.call_at(t0 + requests[0].arrival_s, issue_from, 0))
    return done


async def _drive_closed(
    spec: WorkloadSpec, requests: Sequence[RequestSpec], submit: Submit, on_issue: OnIssue | None
) -> None:
    loop = asyncio.get_running_loop()
    t0 = loop.time()
    throttler = rate_throttler(spec.max_request_rate)
    cursor = 0  # the next request to issue, shared by all users

    async def user() -> None:
        nonlocal cursor
        while True:
            if throttler is not None:
                await throttler.acquire()
            if cursor >= len(requests):
                return
            req = requests[cursor]  # taken after the throttle, so issues stay in order
            cursor += 1
            if on_issue is not None:
                on_issue(req, loop.time() - t0)
            await submit(req)
            # Think only while requests remain: the run ends at the last completion.
            if spec.think_time_s > 0 and cursor < len(requests):
                await asyncio.sleep(spec.think_time_s)

    assert spec.concurrency is not None
    users = [loop.create_task(user()) for _ in range(min(spec.concurrency, len(requests)))]
    try:
        await asyncio.gather(*users)
    finally:
        await _settle(users)


async def drive_interruptibly(spec: WorkloadSpec, requests: Sequence[RequestSpec],
                              submit: Submit) -> str | None:
    """`drive`, where Ctrl-C (or SIGTERM, SIGHUP) stops the sending but not the caller, which still
    reports what was measured so far. The first signal's name if it was interrupted, else None."""
    loop = asyncio.get_running_loop()
    driver = asyncio.create_task(drive(spec, requests, submit))
    received: list[str] = []

    def interrupt(sig: signal.Signals) -> None:
        received.append(sig.name)
        driver.cancel()

    signals = STOP_SIGNALS
    try:
        for sig in signals:
            loop.add_signal_handler(sig, interrupt, sig)
    # no signal handlers here (Windows, not main thread)
    except (NotImplementedError, RuntimeError):
        return await _drive_plain(driver)
    try:
        await driver
    except asyncio.CancelledError:
        if not received:
            raise
    finally:
        for sig in signals:
            loop.remove_signal_handler(sig)
    return received[0] if received else None


async def _drive_plain(driver: asyncio.Task) -> None:
    await driver
