"""The engine loop: schedule, execute, update, record. Requests arrive from asyncio tasks (a
workload driver or HTTP handlers) while a step computes: the real executor runs in its own thread,
the simulated one advances a virtual clock."""

from __future__ import annotations

import concurrent.futures
import itertools
import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Protocol

from batchsim.scheduler.plan import StepPlan, StepResult
from batchsim.scheduler.request import Request
from batchsim.scheduler.scheduler import Scheduler
from batchsim.scheduler.spec_budget import cut_drafts
from batchsim.server.executors.base import Executor, ExecutorLost
from batchsim.server.platform import env
from batchsim.server.results.recorder import RunRecorder

# asyncio is loaded by the methods that use an event loop: a simulated open-loop run
# (virtual_run.py) has none and never loads it (about 20 ms of its start).
if TYPE_CHECKING:
    import asyncio

StepHook = Callable[["Engine", StepPlan, StepResult], None]


class Recorder(Protocol):
    """What the engine reports to: RunRecorder (a run's evidence) or a server's bounded counters."""

    requests: dict[int, Request]  # requests kept for inspection (a server keeps none)

    def on_arrival(self, request: Request) -> None: ...

    def on_step(self, plan: StepPlan, result: StepResult, start_s: float,
                ends_s: Sequence[float], scheduler: Scheduler) -> None: ...


class Engine:
    def __init__(
        self,
        scheduler: Scheduler,
        executor: Executor,
        *,
        recorder: Recorder | None = None,
        arrival_times_s: Sequence[float] = (),
        on_step: StepHook | None = None,
        on_error: str = "raise",
    ):
        self.scheduler = scheduler
        self.executor = executor
        # A simulated executor's steps are timed on a virtual clock (clock.run(virtual=True)).
        self.virtual_time = executor.caps.virtual_time
        # Every request and step by default; a server passes a bounded one.
        self.recorder = recorder if recorder is not None else RunRecorder()
        # sorted open-loop arrivals bound simulated lookahead
        self.arrivals_s = list(arrival_times_s)
        self._arrivals_past = 0  # arrivals at or before the clock (it only moves forward)
        self._on_step = on_step
        # "raise": an executor failure ends the run (batchsim run). "abort": the running requests
        # fail, the executor starts clean, and everyone else is still served (batchsim serve).
        self._on_error = on_error
        self.num_executor_errors = 0
        self._t0 = 0.0
        self._loop: asyncio.AbstractEventLoop | None = None
        self._time: Callable[[], float] = time.monotonic  # the clock now() reads (start_clock)
        self._wake: asyncio.Event | None = None  # made by the loop (run), set by what wakes it
        self._done: dict[int, asyncio.Future] = {}
        self.stopping = False  # set by stop() (an attribute: the simulated loop reads it a plan)
        self._thread = (None if self.virtual_time
                        else concurrent.futures.ThreadPoolExecutor(1, "executor"))
        self._streams: dict[int, asyncio.Queue] = {}
        self._stream_requests: dict[int, Request] = {}  # the streamed requests, by id
        self._streamed: dict[int, int] = {}  # request id -> output tokens its stream has had

    def now(self) -> float:
        return self._time() - self._t0

    def start_clock(self, time_s: Callable[[], float] | None = None) -> None:
        """Time starts now, on the running loop's clock, or on `time_s` (a loop-less simulation's
        virtual clock: server/engine/virtual_run.py)."""
        if time_s is None:
            import asyncio

            self._loop = asyncio.get_running_loop()
            time_s = self._loop.time
        self._time = time_s
        self._t0 = time_s()

    # -- requests ------------------------------------------------------------------------------
    def add(self, request: Request) -> asyncio.Future:
        """Queue a request; the future resolves with it once finished, rejected or aborted."""
        import asyncio

        fut = asyncio.get_running_loop().create_future()
        if self.admit(request):
            self._done[request.request_id] = fut
            self._wake_up()
        else:
            fut.set_result(request)
        return fut

    def admit(self, request: Request) -> bool:
        """Record and queue a request: True, or False when it is refused (finished now)."""
        self.recorder.on_arrival(request)
        if self.scheduler.add_request(request):
            return True
        request.finished_s = self.now()
        return False

    def stream(self, request: Request) -> asyncio.Queue:
        """Queue a request and get its tokens as they come: lists of new token ids, then the
        finished Request itself (finished, rejected or aborted)."""
        import asyncio

        queue: asyncio.Queue = asyncio.Queue()
        self._streams[request.request_id] = queue
        self._stream_requests[request.request_id] = request

        def close(fut: asyncio.Future) -> None:
            self._stream_requests.pop(request.request_id, None)
            self._streamed.pop(request.request_id, None)
            if self._streams.pop(request.request_id, None) is not None:
                queue.put_nowait(fut.result())

        self.add(request).add_done_callback(close)
        return queue

    def abort(self, request_id: int) -> None:
        request = self.scheduler.abort(request_id)
        if request is not None:
            request.finished_s = self.now()
            self._resolve([request])
            self._wake_up()

    def stop(self) -> None:
        self.stopping = True
        self._wake_up()

    def _wake_up(self) -> None:
        """The loop, waiting for work, looks again (before it runs, it looks first anyway)."""
        if self._wake is not None:
            self._wake.set()

    # -- the loop ------------------------------------------------------------------------------
    async def run(self) -> None:
        try:
            await self._loop_steps()
        except BaseException as exc:
            # Whoever awaits a request must hear that the engine died, not wait forever.
            for fut in self._done.values():
                if not fut.done():
                    fut.set_exception(exc if isinstance(exc, Exception)
                                      else RuntimeError("engine stopped"))
            self._done.clear()
            raise
        finally:  # running requests' counters as the records read them (an interrupted run)
            self.scheduler.settle()

    async def _loop_steps(self) -> None:
        import asyncio

        from batchsim.server.engine import clock

        self._wake = asyncio.Event()
        # The virtual loop moves its clock in place when nothing else is due (most plans), and
        # runs a finished request's callbacks without a turn when they wake no task.
        advance = getattr(self._loop, "advance", None)
        run_ready = getattr(self._loop, "run_ready", None)
        while not self.stopping:
            if not self.scheduler.has_work():
                self._wake.clear()
                await self._wake.wait()
                continue
            plan = self.scheduler.schedule()
            start = self.now()
            try:
                if self._thread is None:  # simulated: timed, not run (no coroutine per plan)
                    result = self.simulate(plan, start)
                    elapsed = result.elapsed_s
                    if advance is None or not advance(elapsed):
                        await clock.sleep(elapsed)
                else:
                    loop = asyncio.get_running_loop()
                    result = await loop.run_in_executor(self._thread, self.executor.execute, plan)
            except Exception as exc:
                if self._on_error == "raise":
                    raise
                self._recover(exc)
                continue
            finished = self.finish_step(plan, result, start)
            self._resolve(finished)
            # A closed-loop client sends its next request before the next plan.
            if finished and (run_ready is None or not run_ready()):
                await asyncio.sleep(0)

    def simulate(self, plan: StepPlan, now: float) -> StepResult:
        """Time a plan without running it, up to the next open-loop arrival."""
        return self.executor.execute(plan, max_elapsed_s=self.next_arrival(now) - now)

    def finish_step(self, plan: StepPlan, result: StepResult, start: float) -> list[Request]:
        """The step is done: the scheduler takes its result, the recorder its record; the
        requests it finished (their finish times are stamped by the caller)."""
        scheduler = self.scheduler
        finished = scheduler.update_from_output(plan, result)
        if scheduler.cut_drafts:  # records and metrics count the drafts it kept
            result = cut_drafts(result, scheduler.cut_drafts)
        # The step's record (here, not in a method of its own: a frame fewer a plan).
        if self._thread is None:
            durations = result.step_durations_s
            # most plans have one step: its end without a call
            ends = [start + durations[0]] if len(durations) == 1 else _cumsum(start, durations)
        else:
            # what a client sees: the loop's time when the step's tokens are out
            ends = [self.now()]
        for new in plan.new_requests:
            r = scheduler.requests.get(new.request_id)
            if r is not None and r.first_scheduled_s is None:
                r.first_scheduled_s = start
        self.recorder.on_step(plan, result, start, ends, scheduler)
        if self._streams and result.token_ids is not None:
            self._send_tokens(result)
        if self._on_step is not None:
            self._on_step(self, plan, result)
        return finished

    def _send_tokens(self, result: StepResult) -> None:
        """The streamed requests' new tokens, those the scheduler kept (a verify step's are cut)."""
        for rid in result.sampled_ids:
            queue = self._streams.get(rid)
            if queue is not None:
                out = self._stream_requests[rid].output_token_ids
                sent = self._streamed.get(rid, 0)
                if len(out) > sent:
                    self._streamed[rid] = len(out)
                    queue.put_nowait(out[sent:])

    def _recover(self, exc: Exception) -> None:
        """After a failed step nothing the executor holds can be trusted: fail every running
        request and start the executor empty; waiting requests are untouched. Logged with its
        traceback unless its message says it all (ExecutorLost: a peer rank lost)."""
        import logging

        said = isinstance(exc, ExecutorLost)
        logging.getLogger("batchsim").error("executor failed; aborting the running requests"
                                            + (f": {exc}" if said else ""), exc_info=not said)
        self.num_executor_errors += 1
        for r in list(self.scheduler.running):
            self.abort(r.request_id)
            r.finish_reason = "error"
        self.executor.reset()
        if self.scheduler.kv.prefix is not None:
            self.scheduler.kv.prefix.clear()

    def next_arrival(self, now: float) -> float:
        """The first open-loop arrival after `now` (inf: none), which a simulated plan's time
        stops at."""
        arrivals, i = self.arrivals_s, self._arrivals_past
        n = len(arrivals)
        while i < n and arrivals[i] <= now:  # bisect_right from where the last one was: the clock
            i += 1  # passes a few arrivals a plan, cheaper stepped over than bisected
        self._arrivals_past = i
        return arrivals[i] if i < n else float("inf")

    def _resolve(self, finished: list[Request]) -> None:
        if not finished:
            return
        self.stamp_finished(finished)
        for r in finished:
            fut = self._done.pop(r.request_id, None)
            if fut is not None and not fut.done():
                fut.set_result(r)

    def stamp_finished(self, finished: list[Request]) -> None:
        now = self.now()
        for r in finished:
            if r.finished_s is None:
                r.finished_s = now

    def _end_thread(self) -> None:
        """The executor thread's last work: the executor ends the run, then the MLX streams the
        thread used go (on the thread that used them)."""
        self.executor.end_run()
        env.release_mlx_streams()

    def close(self) -> None:
        if self._thread is not None:
            self._thread.submit(self._end_thread).result()
            self._thread.shutdown(wait=True)


def _cumsum(start: float, durations: Sequence[float]) -> list[float]:
    ends = list(itertools.accumulate(durations, initial=start))
    del ends[0]
    return ends
