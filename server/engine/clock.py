"""Event loops for the engine: the ordinary asyncio loop (real time), and one whose clock is
virtual, so the same engine, workload driver and scheduler run a simulated hour in seconds.

The virtual loop swaps asyncio's selector for one that never blocks: when the loop would wait
for its next timer, the clock jumps there instead. Only public asyncio APIs are used (a custom
selector and an overridden `time()`), plus shortcuts (`advance_to`, `skip_to_timer`) that read the
loop's ready queue and timer heap (attributes every CPython event loop since 3.4 has)."""

from __future__ import annotations

import asyncio
import heapq
import selectors
from collections.abc import Callable

from batchsim.server.engine import virtual_clock
from batchsim.server.engine.virtual_clock import MAX_WAIT_S


class SimulationStalled(RuntimeError):
    """The simulated loop had nothing scheduled and would wait forever."""


class _VirtualSelector(selectors.DefaultSelector):
    POLL_EVERY = 16  # loop turns per look at real file descriptors (signals, threads' wake-ups)

    def __init__(self) -> None:
        super().__init__()
        self.now_s = 0.0
        self._turns = 0
        self.next_timer_s: Callable[[], float | None] = lambda: None  # set by VirtualTimeLoop

    def select(self, timeout: float | None = None):
        self._turns += 1
        if timeout is None or self._turns % self.POLL_EVERY == 0:
            events = super().select(0)  # the loop's self-pipe still works (Ctrl-C, threads)
            if events:
                return events
        if timeout is None:
            raise SimulationStalled("simulated event loop has no pending timer or ready callback")
        # asyncio caps a wait at a day: jump to the timer itself (1e12 s away: not 1e7 turns).
        due_s = self.next_timer_s() if timeout >= MAX_WAIT_S else None
        self.now_s = virtual_clock.waited_s(self.now_s, timeout, due_s)
        return []


class VirtualTimeLoop(asyncio.SelectorEventLoop):
    def __init__(self) -> None:
        self._virtual = _VirtualSelector()
        super().__init__(self._virtual)
        # Moving the clock in place reads the loop's ready queue and timer heap; without them
        # (not CPython's loop) every sleep takes the ordinary way.
        self._in_place = hasattr(self, "_ready") and hasattr(self, "_scheduled")
        if self._in_place:
            self._virtual.next_timer_s = self._first_timer_s

    def _first_timer_s(self) -> float | None:
        return self._scheduled[0].when() if self._scheduled else None

    def time(self) -> float:
        return self._virtual.now_s

    @property
    def _clock_resolution(self) -> float:
        """asyncio fires a timer once `when < time() + resolution`. Far into virtual time (very low
        rates, long trace gaps) 1 ns is below a float's spacing, and a timer due exactly now would
        never fire: the loop would spin at timeout 0. So: at least two float steps of the clock."""
        return virtual_clock.resolution_s(self._virtual.now_s)

    @_clock_resolution.setter
    def _clock_resolution(self, value: float) -> None:  # asyncio assigns the OS clock's; ours wins
        pass

    def advance(self, dt: float) -> bool:
        """Moves the clock dt forward in place when nothing else could run in between: no callback
        ready and no timer due by then. That is exactly what `await asyncio.sleep(dt)` would do,
        without a turn of the loop per plan. False: sleep instead."""
        return self.advance_to(self._virtual.now_s + max(dt, 0.0))

    def advance_to(self, target: float) -> bool:
        if not self._in_place or self._ready:
            return False
        timers = self._scheduled
        if timers and timers[0].when() <= target:
            return False
        self._virtual.now_s = target
        return True

    def skip_to_timer(self, target: float) -> bool:
        """Moves the clock to the first timer if it is due by `target` (it fires on the next turn).
        False: no timer is due, or the loop's internals are unknown."""
        timers = self._scheduled if self._in_place else None
        if not timers or timers[0].when() > target:
            return False
        if not timers[0].cancelled():  # a cancelled one is dropped on the next turn
            self._virtual.now_s = max(self._virtual.now_s, timers[0].when())
        return True

    def run_due_timers(self, target: float) -> bool:
        """What the next turn would do when nothing is ready and the first timer is due by
        `target`: move the clock to it and run the timers due then, in order, here and now.
        False (nothing run): a callback is ready, no timer is due, or the first is cancelled."""
        timers = self._scheduled if self._in_place else None
        if not timers or self._ready or timers[0].when() > target or timers[0].cancelled():
            return False
        virtual = self._virtual
        virtual.now_s = max(virtual.now_s, timers[0].when())
        end_s = virtual.now_s + self._clock_resolution  # as _run_once picks the due timers
        while timers and timers[0].when() < end_s:
            handle = heapq.heappop(timers)
            handle._scheduled = False
            if handle.cancelled():
                self._timer_cancelled_count -= 1
            else:
                handle._run()
        return True

    def run_ready(self) -> bool:
        """Runs the callbacks ready now, as the next turn would run them before a task's wake-up
        queued after them, when none of them resumes a task (a task cannot run inside another:
        the caller's). False: nothing was run (the caller yields to the loop)."""
        ready = self._ready if self._in_place else None
        if not ready:
            return False
        # A copy first: a signal handler may append to the queue (call_soon_threadsafe) any time.
        if any(isinstance(getattr(h._callback, "__self__", None), asyncio.Task)
               for h in list(ready)):
            return False
        for _ in range(len(ready)):
            handle = ready.popleft()
            if not handle._cancelled:
                handle._run()
        return True

    def callbacks_ready(self) -> bool:
        return self._in_place and bool(self._ready)


async def sleep(dt: float) -> None:
    """`await asyncio.sleep(dt)`; on the virtual loop without a turn of the loop when nothing else
    is due meanwhile. Callbacks already queued (a finished request's client) run first, at the
    present time, exactly as they would during the sleep; timers due meanwhile (the next arrival)
    fire at their time (here, when nothing else is ready: no turn of the loop for an arrival), and
    the clock then lands exactly on the end of the sleep."""
    loop = asyncio.get_running_loop()
    if not isinstance(loop, VirtualTimeLoop):
        await asyncio.sleep(dt)
        return
    target = loop.time() + max(dt, 0.0)
    while not loop.advance_to(target):
        if loop.run_due_timers(target):
            continue
        if not loop.callbacks_ready() and not loop.skip_to_timer(target):
            await asyncio.sleep(target - loop.time())  # unknown loop internals
            return
        await asyncio.sleep(0)  # one turn of the loop: what is ready or due runs first


def new_event_loop(virtual: bool) -> asyncio.AbstractEventLoop:
    return VirtualTimeLoop() if virtual else asyncio.new_event_loop()


def run(coro, virtual: bool):
    """asyncio.run on a real or virtual-time loop (Python 3.10 compatible)."""
    loop = new_event_loop(virtual)
    try:
        asyncio.set_event_loop(loop)
        return loop.run_until_complete(coro)
    finally:
        try:
            pending = asyncio.all_tasks(loop)
            for task in pending:
                task.cancel()
            if pending:
                loop.run_until_complete(asyncio.gather(*pending, return_exceptions=True))
            loop.run_until_complete(loop.shutdown_asyncgens())
        finally:
            asyncio.set_event_loop(None)
            loop.close()
