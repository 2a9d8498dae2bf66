"""Run a workload through the engine and leave evidence: a run directory with the resolved config,
per-request and per-step JSONL, and the summary."""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import gc
import logging
import signal
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
from batchsim.scheduler.request import Request, SamplingParams
from batchsim.server.engine.collector import long_lived_heap, uncollected
from batchsim.server.engine.engine import Engine
from batchsim.server.engine.interrupts import Interrupts
from batchsim.server.engine.kv_summary import kv_summary
from batchsim.server.engine.memory import peak_resident_bytes
from batchsim.server.engine.run_dir import (
    draw_run_timeline,
    noted,
    run_timeline_panels,
    write_config,
    write_summary_noting_failures,
)
from batchsim.server.engine.session import Session
from batchsim.server.engine.virtual_run import VirtualRun, replays_exactly
from batchsim.server.results import record_process, request_arrays
from batchsim.server.results.jsonio import new_run_dir
from batchsim.server.results.metrics import output_tokens_sha256, summarize
from batchsim.server.results.recorder import RunRecorder
from batchsim.server.results.records import RequestRecord, StepRecord
from batchsim.server.results.run_files import RecordStream
from batchsim.server.results.timeline import PANEL_INTS, TIMELINE
from batchsim.server.results.timeline_draw import DrawingProcess
from batchsim.workloads.requests import (
    RequestSpec,
    build_requests,
    chat_requests,
    request_block_hashes,
    request_token_ids,
    sampling_seed,
)
from batchsim.workloads.spec import WorkloadSpec


@dataclasses.dataclass
class RunOutcome:
    summary: dict[str, Any]
    requests: list[RequestRecord]
    steps: list[StepRecord]
    run_dir: Path | None
    interrupted: bool
    records_error: str | None = None  # what of the run directory could not be written


class _Run:
    def __init__(self, session: Session, spec: WorkloadSpec, on_step: Callable | None,
                 stream: RecordStream | None, interrupts: Interrupts):
        self.session = session
        self.spec = spec
        self.requests = build_requests(spec)
        self.chat_ids: dict[int, list[int]] = {}  # chat workloads: real prompt ids by request index
        if spec.chat is not None:
            self.requests, self.chat_ids = chat_requests(spec.chat, self.requests,
                                                         session.tokenizer)
        self.open_loop = spec.arrival != "closed"
        self.arrivals_s = [r.arrival_s for r in self.requests] if self.open_loop else []
        self.recorder = RunRecorder(stream)  # the run's evidence (the engine sees a Recorder)
        self.engine = Engine(session.new_scheduler(), session.executor,
                             recorder=self.recorder, arrival_times_s=sorted(self.arrivals_s),
                             on_step=on_step)
        self.virtual = self.engine.virtual_time
        self.interrupts = interrupts
        self.stream = stream
        self.lateness_s: list[float] = []
        tok = session.tokenizer
        self.eos = frozenset(getattr(tok, "eos_token_ids", None) or ())
        self._sampling: dict[int, SamplingParams] = {}  # by max_tokens: immutable, so shared

    def make_request(self, rs: RequestSpec) -> Request:
        s = self.session
        ids = self.chat_ids.get(rs.index)
        if ids is None and s.executor.caps.needs_token_ids:
            ids = request_token_ids(self.spec.seed, rs, s.spec.vocab_size)
        now = self.engine.now()
        arrival = rs.arrival_s if self.open_loop else now
        self.lateness_s.append(max(0.0, now - arrival))
        # With token ids the prefix cache hashes them; without, the workload's segments name blocks.
        hashes = request_block_hashes(rs) if ids is None else None
        return Request(rs.index, rs.prompt_len, self.sampling(rs), arrival, ids, self.eos,
                       block_hashes=hashes)

    def sampling(self, rs: RequestSpec) -> SamplingParams:
        """Synthetic traffic: greedy, EOS as configured. Chat traffic: as its clients send it,
        EOS honoured (replies end where the model ends them)."""
        chat = self.spec.chat
        if chat is not None:
            return SamplingParams(max_tokens=rs.output_len, temperature=chat.temperature,
                                  seed=sampling_seed(self.spec.seed, rs.index))
        sampling = self._sampling.get(rs.output_len)
        if sampling is None:
            ignore_eos = self.session.config.ignore_eos
            sampling = SamplingParams(max_tokens=rs.output_len, ignore_eos=ignore_eos)
            self._sampling[rs.output_len] = sampling
        return sampling

    @property
    def interrupted(self) -> bool:
        """A signal came before the summary was made (the run may have stopped early)."""
        return self.interrupts.received is not None

    def drive(self) -> float:
        """Send the workload through the engine; the run's duration on its clock. A simulated
        open-loop run without limits on issuing goes without asyncio (VirtualRun: the same
        records, a fraction of the cost); anything else on an event loop."""
        spec = self.spec
        if (self.virtual and self.open_loop and spec.max_request_rate is None
                and not spec.max_concurrency and replays_exactly(self.arrivals_s)):
            return self._run_plain()
        from batchsim.server.engine.event_loop_run import run_on_event_loop

        return run_on_event_loop(self)

    def _run_plain(self) -> float:
        requests, engine, recorder = self.requests, self.engine, self.recorder

        def issue(i: int) -> bool:
            request = self.make_request(requests[i])
            if engine.admit(request):
                return True
            recorder.on_finish(request)  # refused: it leaves at once
            return False

        run = VirtualRun(engine, issue, recorder.on_finish)
        with self.interrupts.answered_by(run.stop), uncollected():
            if self.interrupted:  # it came while the run was being set up
                run.stop()
            duration = run.run()
        engine.close()
        return duration


def run_workload(
    session: Session, spec: WorkloadSpec, *, out_dir: Path | None, label: str,
    on_step: Callable | None = None, run_dir: Path | None = None,
    interrupts: Interrupts | None = None, timeline: bool | DrawingProcess = True,
    on_summary: Callable[[dict[str, Any]], None] | None = None,
) -> RunOutcome:
    """Run `spec` and record it in `run_dir` (else a new directory under `out_dir`, else
    nowhere): config.yaml first, steps and requests as they complete, summary.json last. A signal
    `interrupts` handles stops the sending; what was sent is finished or cut off, and recorded.
    Without `interrupts`, Ctrl-C does that (SIGTERM stays the caller's). `timeline`: draw
    timeline.png in the run directory from its records (the summary's timeline_png); a
    DrawingProcess (the caller's to close) draws it while the run is summarized. `on_summary`:
    called with the summary once its numbers are made, before timeline.png is awaited."""
    if run_dir is None and out_dir is not None:
        run_dir = new_run_dir(out_dir, label)
    with contextlib.ExitStack() as stack:
        if interrupts is None:
            interrupts = stack.enter_context(Interrupts((signal.SIGINT,)))
        stack.enter_context(interrupts.answered_by())  # outside the sending: noted, not raised
        drawing = timeline if isinstance(timeline, DrawingProcess) and run_dir else None
        return _run_recorded(session, spec, on_step, run_dir, interrupts, timeline, drawing,
                             on_summary)


def _run_recorded(session: Session, spec: WorkloadSpec, on_step: Callable | None,
                  run_dir: Path | None, interrupts: Interrupts, timeline: bool | DrawingProcess,
                  drawing: DrawingProcess | None,
                  on_summary: Callable[[dict[str, Any]], None] | None) -> RunOutcome:
    stream = None
    if run_dir is not None:
        write_config(run_dir, session.config, spec, session)
        stream = RecordStream(run_dir, on_error=lambda exc: interrupts.stop(str(exc)),
                              writer_process=True)  # encoded and written on another core
    with long_lived_heap():  # the workload's requests too (18,000: 26 collections went over)
        if stream is not None and session.executor.caps.virtual_time:
            stream.start_writer()  # a simulated run: its import overlaps the run's set-up, loop
        try:
            run = _Run(session, spec, on_step, stream, interrupts)
        except BaseException:  # a failed set-up: the files closed, the unused writer ended
            if stream is not None:
                stream.close_unfinished()
            raise
        wall0 = time.perf_counter()
        interrupts.abandon = functools.partial(_abandon, run, run_dir, wall0)
        try:
            with _kept_on_error(run, run_dir, wall0):
                duration = run.drive()
                wall = time.perf_counter() - wall0
                if stream is not None:  # the last records: written while the run is summarized
                    stream.flush()
        finally:
            interrupts.abandon = None
        gc.freeze()  # what the run kept: the summary and timeline.png do not go over it again
        return _finish(run, run_dir, duration, wall, timeline, drawing, on_summary)


def _finish(run: _Run, run_dir: Path | None, duration: float, wall: float,
            timeline: bool | DrawingProcess, drawing: DrawingProcess | None = None,
            on_summary: Callable[[dict[str, Any]], None] | None = None) -> RunOutcome:
    """Summarize `run` (`duration` on its clock, `wall` s), close its records, write summary
    (timeline.png: drawn by `drawing` meanwhile, else here after the records are closed;
    `on_summary` given the summary before it is awaited)."""
    session, spec, stream, interrupts = run.session, run.spec, run.stream, run.interrupts
    count_at_end = interrupts.count  # a signal from here on ends the wait for the drawing child
    # The engine's time, as before records streamed: writing them is not the run's work.
    wall -= stream.writing_s if stream else 0.0
    rec = run.recorder
    records, steps = rec.request_records(), rec.steps
    tokens = request_arrays.RunTokens(rec.step_end_s, rec.requests.values(), records)
    col = request_arrays.step_columns(steps, PANEL_INTS)  # once: for the summary and the picture
    draw = run_dir is not None and bool(timeline) and not (stream and stream.error)
    if draw and run_dir is not None and drawing is not None:  # drawn while this goes on
        drawing.send(run_dir / TIMELINE, lambda: run_timeline_panels(
            records, steps, session, spec, tokens.counts(), col), len(steps))
    cfg = session.config
    summary = summarize(
        records, steps, duration_s=duration, percentiles=cfg.percentiles,
        goodput_slo_ms=cfg.goodput, kv_budget_bytes=session.kv_budget_bytes,
        weight_bytes=session.weight_bytes, peak_memory_bytes=_peak_memory(session),
        peak_rss_bytes=peak_resident_bytes() if session.executor.caps.real_compute else None,
        run_tokens=tokens, step_columns=col,
        running_peak_kv_bytes=run.engine.scheduler.kv.peak_running_bytes)
    summary.update(_what_ran(run, wall))
    if cfg.spec_method != "none":
        summary.update({"spec_method": cfg.spec_method, "spec_tokens": cfg.scheduler.spec_tokens,
                        "spec_policy": cfg.scheduler.spec_policy, **rec.spec.summary()})
    if session.executor.caps.real_compute:  # simulated tokens are not tokens
        summary["output_tokens_sha256"] = output_tokens_sha256(
            {rid: r.output_token_ids for rid, r in rec.requests.items()})
    if run.virtual:
        summary["sim_speedup"] = duration / wall if wall > 0 else float("inf")
    if stream is not None:  # a signal meanwhile ends the wait for the writer process
        with interrupts.answered_by(record_process.stop_waiting):
            stream.close(records)  # requests.jsonl in arrival order, as a finished run has it
    if on_summary is not None:  # while the drawing process draws
        _tell(on_summary, summary)
    if draw and run_dir is not None and not (stream and stream.error):  # no room for it
        summary["timeline_png"] = _timeline_png(run, run_dir, drawing, count_at_end, records)
    summary["interrupted"] = run.interrupted  # a signal may have come while records were written
    if run.interrupted:
        summary["interrupt_reason"] = interrupts.received
    summary["run_dir"] = str(run_dir) if run_dir else None
    summary["env"] = session.environment()
    error = write_summary_noting_failures(run_dir, summary, stream.error if stream else None)
    return RunOutcome(summary, records, steps, run_dir, run.interrupted, error)


def _tell(on_summary: Callable[[dict[str, Any]], None], summary: dict[str, Any]) -> None:
    """The caller's hook (a table laid out ahead) cannot cost the run summary.json or
    timeline.png: its failure is one line, and the caller's view lays the table out as before."""
    try:
        on_summary(summary)
    except Exception as exc:  # noqa: BLE001 - any failure of the hook; the records come first
        logging.getLogger("batchsim").warning("the summary's early look failed: %s: %s",
                                              type(exc).__name__, exc)


def _what_ran(run: _Run, wall: float) -> dict[str, Any]:
    """The summary's account of what ran (model, executor, scheduler, plans, `wall` s, KV)."""
    session, cfg, plans = run.session, run.session.config, len(run.recorder.steps)
    return {
        "model": session.ref.name, "dtype": session.dtype,
        "quantize_bits": session.ref.quantize_bits,
        "executor": cfg.executor, "engine": cfg.engine, "workload": run.spec.name,
        "kv_layout": cfg.kv_layout,
        "max_num_seqs": cfg.scheduler.max_num_seqs,
        "memory_budget_bytes": session.memory_budget_bytes,
        "budget_source": session.budget_source, "num_steps": run.engine.scheduler.num_steps,
        "num_plans": plans, "wall_s": wall,
        "mean_plan_wall_ms": 1e3 * wall / plans if plans else 0.0,
        "kv_account_mismatches": run.recorder.kv_account_mismatches,
        "mean_arrival_lateness_ms": 1e3 * float(np.mean(run.lateness_s)) if run.lateness_s else 0.0,
        "interrupted": run.interrupted,
        **kv_summary(run.engine.scheduler),
    }


def _timeline_png(run: _Run, run_dir: Path, drawing: DrawingProcess | None, count_at_end: int,
                  records: list[RequestRecord]) -> str | None:
    """timeline.png: the drawing child's (awaited unless stopped), else drawn here."""
    if drawing is not None:
        return _drawn_unless_stopped(drawing, run.interrupts, count_at_end)
    return draw_run_timeline(run_dir, records, run.recorder.steps, run.session, run.spec)


def _drawn_unless_stopped(drawing: DrawingProcess, interrupts: Interrupts,
                          count_at_end: int) -> str | None:
    """The drawing child's picture; a signal while it is awaited, or since the run ended
    (interrupts.count past `count_at_end`: a second Ctrl-C too), ends the wait (the summary says
    interrupted)."""
    stopped = threading.Event()
    with interrupts.answered_by(stopped.set):
        if interrupts.count != count_at_end:  # it came while the run was summarized
            stopped.set()
        return noted(drawing.result(stopped.is_set))


@contextlib.contextmanager
def _kept_on_error(run: _Run, run_dir: Path | None, wall0: float) -> Iterator[None]:
    """A failed run leaves what it recorded, and a summary interrupted with the error as reason."""
    try:
        yield
    except Exception as exc:
        try:
            with contextlib.suppress(Exception):  # the error says more than a failed summary
                _abandon(run, run_dir, wall0, f"failed: {exc}")
        finally:  # a failed summary (the device gone) must not lose the buffered records
            _close_unfinished(run)
        raise
    except BaseException:
        _close_unfinished(run)
        raise


def _close_unfinished(run: _Run) -> None:
    """The records as they stand (safe after a finished or abandoned close: a no-op)."""
    if run.stream is not None:
        run.stream.close_unfinished()


def _abandon(run: _Run, run_dir: Path | None, wall0: float, reason: str) -> None:
    """The run cannot go on: its records and summary as they stand (unfinished requests said
    so), `reason` its interrupt_reason unless a signal came first."""
    run.interrupts.abandon = None  # once: a signal meanwhile must not start it again
    run.interrupts.received = run.interrupts.received or reason
    _finish(run, run_dir, run.engine.now(), time.perf_counter() - wall0, False)
    run.interrupts.abandoned_in = str(run_dir) if run_dir else None


def _peak_memory(session: Session) -> int | None:
    if not session.executor.caps.real_compute:
        return None
    import mlx.core as mx

    return int(mx.get_peak_memory())
