"""Event loops for the engine: the ordinary asyncio loop (real time), and one whose clock is
virtual, so the same engine, workload driver and scheduler run a simulated hour in seconds.

The virtual loop swaps asyncio's selector for one that never blocks: when the loop would wait
for its next timer, the clock jumps there instead. Only public asyncio APIs are used (a custom
selector and an overridden `time()`)."""

from __future__ import annotations

import asyncio
import selectors


class SimulationStalled(RuntimeError):
    """The simulated loop had nothing scheduled and would wait forever."""


class _VirtualSelector(selectors.DefaultSelector):
    def __init__(self) -> None:
        super().__init__()
        self.now_s = 0.0

    def select(self, timeout: float | None = None):
        events = super().select(0)  # real file descriptors (the loop's self-pipe) still work
        if events:
            return events
        if timeout is None:
            raise SimulationStalled("simulated event loop has no pending timer or ready callback")
        self.now_s += max(timeout, 0.0)
        return []


class VirtualTimeLoop(asyncio.SelectorEventLoop):
    def __init__(self) -> None:
        self._virtual = _VirtualSelector()
        super().__init__(self._virtual)

    def time(self) -> float:
        return self._virtual.now_s


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
