"""A live progress line for long runs (stderr), fed by the engine's step hook."""

from __future__ import annotations

import time

from batchsim.scripts.common import err
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

NARROW_COLUMNS = 120  # below this the line drops the run's label, bar and wall time: counts stay


def _redrawn(console: Console) -> bool:
    """Whether the line is redrawn as it changes: on a terminal. Elsewhere (a file, a pipe, a dumb
    terminal) rich prints it once, when it stops, and its refresh thread (10 wakes a second, each
    building the line) took the run's interpreter lock for nothing: 46 refreshes, 12 ms of CPU
    in a simulated hour's command at load 5."""
    return console.is_terminal and not console.is_dumb_terminal


class RunProgress:
    """Requests done out of total, with the batch, queue and KV memory as they evolve. The line
    left on the terminal is the run's end: a last update when the run stops, whatever the rate
    limit skipped (a simulated hour ends within one interval of its last update)."""

    def __init__(self, total: int, label: str, enabled: bool = True, min_interval_s: float = 0.25):
        self.enabled = enabled
        self.min_interval_s = min_interval_s
        self._last = 0.0
        self._engine = self._plan = None  # the latest step seen, for the last update
        self._wide = err.width >= NARROW_COLUMNS
        named = TextColumn("{task.description}", style="bold", markup=False)  # the run's label
        label_bar = [named, BarColumn()] if self._wide else []
        elapsed = [TimeElapsedColumn()] if self._wide else []
        self._progress = Progress(
            *label_bar, MofNCompleteColumn(), TextColumn("{task.fields[status]}", markup=False),
            *elapsed, console=err, transient=False, auto_refresh=_redrawn(err),
        )
        self._task = self._progress.add_task(label, total=total, status="starting")

    def __enter__(self) -> RunProgress:
        if self.enabled:
            self._progress.start()
        return self

    def __exit__(self, *exc) -> None:
        if self.enabled:
            if self._engine is not None:
                self._update(self._engine, self._plan)
            self._progress.stop()

    def advance(self, n: int) -> None:
        """Requests done, when no engine steps are seen (a run against an HTTP server)."""
        self._progress.update(self._task, advance=n, status="")

    def on_step(self, engine, plan, result) -> None:
        self._engine, self._plan = engine, plan
        now = time.monotonic()
        if not self.enabled or now - self._last < self.min_interval_s:
            return
        self._last = now
        self._update(engine, plan)

    def _update(self, engine, plan) -> None:
        s = engine.scheduler
        kv_gib = plan.kv_bytes / 2**30
        if self._wide:
            status = (f"t={engine.now():7.1f}s  batch {len(plan.decode_ids):3d}"
                      f"  running {len(s.running):3d}"
                      f"  waiting {len(s.waiting):3d}  KV {kv_gib:6.2f} GiB"
                      f"  preempted {s.num_preemptions}")
        else:  # unpadded, and preemptions only once there are some
            status = (f"t={engine.now():.1f}s batch {len(plan.decode_ids)} running "
                      f"{len(s.running)} waiting {len(s.waiting)} KV {kv_gib:.2f} GiB"
                      + (f" preempted {s.num_preemptions}" if s.num_preemptions else ""))
        self._progress.update(self._task, completed=engine.recorder.num_left, status=status)
