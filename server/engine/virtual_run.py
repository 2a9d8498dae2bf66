"""A simulated open-loop run as one plain loop: no event loop, and no future, task or timer per
request. Arrivals go to the scheduler straight from the request list, finished requests to the
recorder when their step ends.

It makes what the asyncio path makes (engine.py's loop on clock.py's VirtualTimeLoop, requests
issued by the timers of workloads/driver.py): the same plans at the same times, so the same
records. An arrival fires when asyncio's timer would: between a plan's pricing and its update
when it falls within the plan, at the clock's landing after an idle wait otherwise (asyncio's
float arithmetic, kept). tests/test_virtual_run.py holds the two paths equal."""

from __future__ import annotations

import functools
import itertools
from collections.abc import Callable, Sequence

from batchsim.scheduler.request import Request
from batchsim.scheduler.scheduler import Scheduler
from batchsim.server.engine import virtual_clock
from batchsim.server.engine.engine import Engine
from batchsim.server.engine.virtual_clock import MAX_WAIT_S

MIN_GAP_S = 1e-8  # distinct arrivals closer: asyncio may fire the later one early (1 ns)
INF = float("inf")
FAST_PATH_MAX_S = 2.0**22  # this loop only; beyond, the clock's step (2 ulp) nears MIN_GAP_S


def replays_exactly(arrivals_s: Sequence[float]) -> bool:
    """Whether this loop fires `arrivals_s` exactly as asyncio's timers would: sorted, finite,
    below FAST_PATH_MAX_S, distinct ones at least MIN_GAP_S apart (closer ones, asyncio fires the
    later one within its clock resolution of the earlier: the asyncio path runs them)."""
    if not arrivals_s or not 0.0 <= arrivals_s[0] <= arrivals_s[-1] < FAST_PATH_MAX_S:
        return False
    return all(b == a or b - a >= MIN_GAP_S for a, b in itertools.pairwise(arrivals_s))


class VirtualRun:
    """Drives `engine` (a simulated executor's) through requests arriving at its `arrivals_s`
    (sorted: request i arrives at the i-th). `issue(i)` makes request i and gives it to the engine
    (engine.admit): whether it was queued (False: refused, finished at once). `on_finish` gets
    every request that leaves."""

    def __init__(self, engine: Engine, issue: Callable[[int], bool],
                 on_finish: Callable[[Request], None]) -> None:
        assert replays_exactly(engine.arrivals_s) and engine.virtual_time
        self.engine = engine
        self.now_s = 0.0  # the virtual clock
        self._arrivals_s = engine.arrivals_s
        self._issue = issue
        self._on_finish = on_finish
        self._next = 0  # the next request to issue
        self._stopping = False

    def stop(self) -> None:
        """Stop issuing and stepping after the current step (safe from a signal handler)."""
        self._stopping = True

    def run(self) -> float:
        """Until every request has left the engine (or a stop); the simulated duration."""
        engine = self.engine
        scheduler = engine.scheduler
        # now_s read by a C callable (engine.now() runs at every arrival): no frame
        engine.start_clock(functools.partial(getattr, self, "now_s"))
        try:
            self._loop(engine, scheduler)
        finally:  # running requests' counters as the records read them (as Engine.run)
            scheduler.settle()
        return self.now_s

    def _loop(self, engine: Engine, scheduler: Scheduler) -> None:
        late = False  # arrivals asyncio fires after the next plan is priced (_wait)
        # Bound once: each is called every plan (25,000 plans in a simulated hour).
        schedule, finish_step = scheduler.schedule, engine.finish_step
        execute = engine.executor.execute  # engine.simulate, without its frame
        arrivals, num_arrivals = self._arrivals_s, len(self._arrivals_s)
        waiting, running = scheduler.waiting, scheduler.running  # has_work(), without its frame
        past = 0  # arrivals at or before the clock (engine.next_arrival's, without its frame)
        while not (self._stopping or engine.stopping):
            if not (waiting or running or scheduler.releasing):
                if self._next >= num_arrivals:
                    return
                late = self._wait()
                continue
            plan = schedule()
            start = self.now_s
            while past < num_arrivals and arrivals[past] <= start:
                past += 1  # the plan is timed up to the first arrival after it starts
            result = execute(plan, (arrivals[past] if past < num_arrivals else INF) - start)
            if late:
                late = False
                while self._due():
                    self._fire()
            end_s = start + max(sum(result.step_durations_s), 0.0)  # its elapsed_s
            while self._next < num_arrivals and arrivals[self._next] <= end_s:
                self.now_s = max(self.now_s, arrivals[self._next])  # each at its own time
                self._fire()  # (the clock to the plan's end: here, without a frame)
            self.now_s = end_s
            for r in finish_step(plan, result, start):
                if r.finished_s is None:  # engine.stamp_finished, without its frames (engine.now()
                    r.finished_s = end_s  # is the clock less its start, 0.0: run's start_clock)
                self._on_finish(r)

    def _wait(self) -> bool:
        """The engine is idle: the clock jumps to the next arrival as the virtual loop's does,
        and it fires. Landing a hair short of it (float rounding), asyncio fires the arrivals due
        at the same time one per turn: before the engine wakes while none was queued, after its
        next plan is priced once one was (then True: the caller fires them)."""
        when = self._arrivals_s[self._next]
        now = self.now_s
        while True:  # asyncio's turns until the timer is due (one, below FAST_PATH_MAX_S)
            timeout = min(max(0, when - now), MAX_WAIT_S)
            now = virtual_clock.waited_s(now, timeout, when if timeout >= MAX_WAIT_S else None)
            if when < now + virtual_clock.resolution_s(now):
                break
        self.now_s = now
        woke = self._fire()
        while not woke and self._due():
            woke = self._fire()
        return self._due()

    def _due(self) -> bool:
        """The next arrival's timer is due now (within the clock's resolution)."""
        i, now = self._next, self.now_s
        return (i < len(self._arrivals_s)
                and self._arrivals_s[i] < now + virtual_clock.resolution_s(now))

    def _fire(self) -> bool:
        """The driver's timer callback: the next request, then every one due by now; whether
        any was queued."""
        arrivals, n, now = self._arrivals_s, len(self._arrivals_s), self.now_s
        i = self._next
        queued = False
        while True:
            self._next = i + 1
            queued = self._issue(i) or queued
            i += 1
            if i >= n or arrivals[i] > now:
                return queued
