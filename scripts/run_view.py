"""What the commands show of a run on the terminal: the header line, the live progress line and
the summary table (the engine's RunView), and the warning for a profile of another machine."""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

from batchsim.scripts.common import err, gib_text, laid_out, out

if TYPE_CHECKING:
    from batchsim.server.engine.run_config import RunConfig
    from batchsim.server.engine.run_path import StepHook
    from batchsim.server.engine.session import Session
    from rich.segment import Segments


class ConsoleView:
    """A run on the terminal (stderr: header and progress; stdout: the summary table)."""

    def __init__(self, progress: bool = True) -> None:
        self.show_progress = progress
        self._table: tuple[dict[str, Any], Segments] | None = None  # summarized's

    def opened(self, session: Session) -> None:
        from batchsim.server.results.timeline import arrival_label, run_title

        cfg, spec = session.config, session.config.workload
        what = run_title(session.ref.name, session.dtype, cfg.quantize, cfg.executor,
                         cfg.device_profile, cfg.engine, session.environment())
        err.print(f"batchsim run: {what}, workload {spec.name}: {spec.num_prompts} requests, "
                  f"{arrival_label(dataclasses.asdict(spec))}, max_num_seqs "
                  f"{cfg.scheduler.max_num_seqs}, KV budget "
                  f"{gib_text(session.kv_budget_bytes)} ({session.budget_source})", markup=False)

    @contextlib.contextmanager
    def progress(self, total: int, label: str) -> Iterator[StepHook]:
        from batchsim.scripts.progress import RunProgress

        with RunProgress(total, label, enabled=self.show_progress) as bar:
            yield bar.on_step

    def summarized(self, summary: dict[str, Any]) -> None:
        """The table laid out while the run's picture is drawn: finished prints it (unless the
        summary changed meanwhile), 9-12 ms less after the wait."""
        from batchsim.scripts.report import summary_table

        self._table = (dict(summary), laid_out(summary_table(summary)))

    def finished(self, summary: dict[str, Any]) -> None:
        laid, self._table = self._table, None
        print_summary(summary, laid[1] if laid is not None and _kept(laid[0], summary) else None)


def _kept(seen: dict[str, Any], summary: dict[str, Any]) -> bool:
    """Every value `seen` has is still `summary`'s (what came after, the picture's path, the run
    directory, is not in the table)."""
    return all(key in summary and summary[key] == value for key, value in seen.items())


def print_summary(summary: dict[str, Any], table: Segments | None = None) -> None:
    """The summary table (`table`: laid out already, from this summary), then the run's notes."""
    from batchsim.scripts.report import summary_table

    out.print(table if table is not None else summary_table(summary))
    if summary.get("interrupted"):
        out.print("interrupted: records so far are in the run directory", style="yellow")
    out.print(f"run directory: {summary['run_dir']}", markup=False)  # a path's [/x] is text


def warn_profile_mismatch(cfg: RunConfig) -> None:
    """One yellow stderr line when a simulated run's profile was calibrated on another machine."""
    from batchsim.server.perf.devices import config_warning

    warning = config_warning(cfg)
    if warning:
        err.print(warning, style="yellow", soft_wrap=True, markup=False)
