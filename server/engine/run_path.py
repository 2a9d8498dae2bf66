"""Opening a run and driving it to its summary: the run directory (made first: an unwritable
`--out` fails before the model loads), the signals it answers (stopped, it keeps its records),
the session (model, executor, scheduler) and the recorded workload. `run`, `compare` and rank 0
of `run --ranks` run this way; what is shown of a run is the caller's `RunView`."""

from __future__ import annotations

import contextlib
import shutil
import signal
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from batchsim.server.engine.interrupts import Interrupts
from batchsim.server.platform.signals import STOP_SIGNALS

if TYPE_CHECKING:
    from batchsim.scheduler.plan import StepPlan, StepResult
    from batchsim.server.engine.engine import Engine
    from batchsim.server.engine.run_config import RunConfig
    from batchsim.server.engine.session import Session
    from batchsim.server.results.timeline_draw import DrawingProcess

StepHook = Callable[["Engine", "StepPlan", "StepResult"], None]  # after every engine step


class RunView(Protocol):
    """What a caller shows of a run (the CLI: a header line, a progress line, the summary)."""

    def opened(self, session: Session) -> None:
        """The model is loaded; the workload starts."""

    def progress(self, total: int,
                 label: str) -> contextlib.AbstractContextManager[StepHook | None]:
        """Entered around the workload; gives the hook called after every step (or None)."""

    def summarized(self, summary: dict[str, Any]) -> None:
        """The summary's numbers are made; its picture may still be drawn (what is shown of the
        numbers can be laid out meanwhile; `finished` still comes, with the final summary)."""

    def finished(self, summary: dict[str, Any]) -> None:
        """The summary is made (and written, where the disk allowed)."""


class QuietView:
    """Shows nothing."""

    def opened(self, session: Session) -> None:
        pass

    def progress(self, total: int, label: str) -> contextlib.AbstractContextManager[None]:
        return contextlib.nullcontext()

    def summarized(self, summary: dict[str, Any]) -> None:
        pass

    def finished(self, summary: dict[str, Any]) -> None:
        pass


QUIET = QuietView()


class RecordsLost(Exception):
    """The run stopped because its records could not be written (a full disk); what was written
    is kept, and `summary` says how far it got."""

    def __init__(self, message: str, summary: dict[str, Any]) -> None:
        super().__init__(message)
        self.summary = summary


def run_config(cfg: RunConfig, out_dir: Path, view: RunView = QUIET, *, label: str | None = None,
               signals: tuple[signal.Signals, ...] = STOP_SIGNALS,
               timeline: bool | DrawingProcess = True) -> dict[str, Any]:
    """Open `cfg`'s session and run its workload into a new directory under `out_dir`; the
    summary. A signal in `signals` (default: SIGTERM and SIGHUP as Ctrl-C, as for every command's
    run) stops the run at any point, records kept."""
    from batchsim.server.results.jsonio import new_run_dir

    label = label or f"{cfg.model}-{cfg.workload.name}-{cfg.executor}"
    with Interrupts(signals) as stop:
        run_dir = new_run_dir(out_dir, label)
        return _open_and_run(cfg, run_dir, label, stop, view, timeline)


def run_session(session: Session, out_dir: Path, view: RunView = QUIET,
                interrupts: Interrupts | None = None) -> dict[str, Any]:
    """A session opened elsewhere (a rank's shard of the model) run as `run_config` runs one;
    `interrupts` (default: SIGINT's) is the caller's to abandon the run with."""
    from batchsim.server.results.jsonio import new_run_dir

    cfg = session.config
    label = f"{session.ref.name}-{cfg.workload.name}-{cfg.executor}"
    with interrupts or Interrupts((signal.SIGINT,)) as stop:
        return _run_opened(session, new_run_dir(out_dir, label), label, stop, view, True)


def _open_and_run(cfg: RunConfig, run_dir: Path, label: str, stop: Interrupts, view: RunView,
                  timeline: bool | DrawingProcess) -> dict[str, Any]:
    try:  # the import too: session.py and the scheduler load while a signal stops the run
        from batchsim.server.engine.session import open_session

        session = open_session(cfg)
    except KeyboardInterrupt:  # a signal while the model loads: nothing ran, and it says so
        with stop.answered_by():  # signals noted from here, not raised
            from batchsim.server.engine.run_dir import record_stopped_before_start

            summary = record_stopped_before_start(cfg, run_dir, timeline, stop.received)
            view.finished(summary)
            return summary
    except BaseException:
        shutil.rmtree(run_dir, ignore_errors=True)  # still empty: a bad config leaves no trace
        raise
    return _run_opened(session, run_dir, label, stop, view, timeline)


def _run_opened(session: Session, run_dir: Path, label: str, stop: Interrupts, view: RunView,
                timeline: bool | DrawingProcess) -> dict[str, Any]:
    spec = session.config.workload
    with stop.answered_by():  # the import too: a signal meanwhile is noted, the run stops at once
        from batchsim.server.engine.runner import run_workload

        view.opened(session)
        with view.progress(spec.num_prompts, label) as on_step:
            outcome = run_workload(session, spec, out_dir=None, label=label, on_step=on_step,
                                   run_dir=run_dir, interrupts=stop, timeline=timeline,
                                   on_summary=view.summarized)
        view.finished(outcome.summary)
        if outcome.records_error:  # a full disk: the run stopped, what it wrote is kept
            raise RecordsLost(outcome.records_error, outcome.summary)
        return outcome.summary
