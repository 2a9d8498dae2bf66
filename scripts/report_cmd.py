"""`batchsim report RUN_DIR`: rebuild a run directory's summary.json from its records, as after a
run that was killed before writing it (marked interrupted), and print it as `run` does."""

from __future__ import annotations

import argparse
from pathlib import Path

from batchsim.scripts.common import err, out


def add_parser(p: argparse.ArgumentParser) -> None:
    p.add_argument("run_dir", help="a run directory (what `batchsim run` leaves under --out)")


def run(args: argparse.Namespace) -> dict:
    from batchsim.scripts.common import CommandFailed
    from batchsim.scripts.report import summary_table
    from batchsim.server.results.rebuild import NOT_KEPT, rebuild_summary

    summary, notes = rebuild_summary(Path(args.run_dir))
    unwritten = [n for n in notes if n.startswith(NOT_KEPT)]
    for note in notes:
        if note not in unwritten:  # that one is the failure's line, last
            err.print(f"batchsim report: {note}", style="yellow", markup=False)
    out.print(summary_table(summary))
    if summary.get("interrupted"):
        out.print("interrupted: the summary covers the records the run left", style="yellow")
    if unwritten:  # shown, not kept: exit 1
        raise CommandFailed(unwritten[0], summary)
    out.print(f"summary rebuilt: {Path(args.run_dir) / 'summary.json'}", markup=False)
    return summary
