"""A run driven on an event loop (runner._Run.drive's other path): the workload driver's timers
issue the requests (closed loops, rate limits, real time), the engine's task steps, and in real
time a task flushes the records while the engine idles. A simulated open-loop run goes without
one (virtual_run.py), and so never loads asyncio."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Sequence
from typing import Protocol

from batchsim.scheduler.request import Request
from batchsim.server.engine import clock
from batchsim.server.engine.engine import Engine
from batchsim.server.engine.interrupts import Interrupts
from batchsim.server.results.recorder import RunRecorder
from batchsim.server.results.run_files import RecordStream
from batchsim.workloads.driver import drive
from batchsim.workloads.requests import RequestSpec
from batchsim.workloads.spec import WorkloadSpec


class LoopedRun(Protocol):
    """What this path reads of a run (runner._Run)."""

    engine: Engine
    spec: WorkloadSpec
    requests: Sequence[RequestSpec]
    recorder: RunRecorder
    stream: RecordStream | None
    interrupts: Interrupts
    virtual: bool

    @property
    def interrupted(self) -> bool: ...

    def make_request(self, rs: RequestSpec) -> Request: ...


def run_on_event_loop(run: LoopedRun) -> float:
    """`run` driven on an event loop (virtual time for a simulated executor): its duration on
    the engine's clock."""
    return clock.run(_main(run), virtual=run.virtual)


async def _main(run: LoopedRun) -> float:
    engine = run.engine
    engine.start_clock()
    engine_task = asyncio.create_task(engine.run())
    driver = asyncio.create_task(drive(run.spec, run.requests, lambda rs: _submit(run, rs)))
    loop = asyncio.get_running_loop()

    def stop_sending() -> None:  # from a signal handler: the loop's thread-safe door
        with contextlib.suppress(RuntimeError):  # the loop is closing: nothing left to stop
            loop.call_soon_threadsafe(driver.cancel)

    # In real time the engine may idle between steps: records still reach the disk.
    flusher = None if run.virtual or run.stream is None else asyncio.create_task(
        _flush_when_due(run.stream))
    try:
        with run.interrupts.answered_by(stop_sending):
            if run.interrupted:  # it came while the run was being set up
                driver.cancel()
            await driver
    except asyncio.CancelledError:
        if not run.interrupted:
            raise
    finally:
        if flusher is not None:
            flusher.cancel()
        engine.stop()
        await engine_task
        engine.close()
    return engine.now()


def _submit(run: LoopedRun, rs: RequestSpec) -> asyncio.Future:
    """The request made and queued as it is issued; its record follows when it leaves."""
    fut = run.engine.add(run.make_request(rs))

    def left_engine(done: asyncio.Future) -> None:
        if not done.cancelled() and done.exception() is None:  # cancelled: cut off by a stop
            run.recorder.on_finish(done.result())

    fut.add_done_callback(left_engine)
    return fut


async def _flush_when_due(stream: RecordStream) -> None:
    while True:
        await asyncio.sleep(stream.flush_if_due())
