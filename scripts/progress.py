"""A live progress line for long runs (stderr), fed by the engine's step hook."""

from __future__ import annotations

import time

from batchsim.scripts.common import err
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn


class RunProgress:
    """Requests done out of total, with the batch, queue and KV memory as they evolve."""

    def __init__(self, total: int, label: str, enabled: bool = True, min_interval_s: float = 0.25):
        self.enabled = enabled
        self.min_interval_s = min_interval_s
        self._last = 0.0
        self._progress = Progress(
            TextColumn("[bold]{task.description}"), BarColumn(), MofNCompleteColumn(),
            TextColumn("{task.fields[status]}"), TimeElapsedColumn(), console=err, transient=False,
        )
        self._task = self._progress.add_task(label, total=total, status="starting")

    def __enter__(self) -> RunProgress:
        if self.enabled:
            self._progress.start()
        return self

    def __exit__(self, *exc) -> None:
        if self.enabled:
            self._progress.stop()

    def advance(self, n: int) -> None:
        """Requests done, when no engine steps are seen (a run against an HTTP server)."""
        self._progress.update(self._task, advance=n, status="")

    def on_step(self, engine, plan, result) -> None:
        now = time.monotonic()
        if not self.enabled or now - self._last < self.min_interval_s:
            return
        self._last = now
        s = engine.scheduler
        done = engine.recorder.num_left
        status = (f"t={engine.now():7.1f}s  batch {len(plan.decode_ids):3d}"
                  f"  running {len(s.running):3d}"
                  f"  waiting {len(s.waiting):3d}  KV {plan.kv_bytes / 2**30:6.2f} GiB"
                  f"  preempted {s.num_preemptions}")
        self._progress.update(self._task, completed=done, status=status)
