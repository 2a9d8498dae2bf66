"""Adversarial runs of a run's child processes (the records' writer, the drawing child), as real
processes: what a hostile user or machine does to them mid-run, and what must hold after."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

from tests.cli_calls import SIM
from tests.sim_records import wait_until

GUARD_S = 120.0
# `batchsim` flushing at every step: its writer process starts at the first flush.
_OFTEN = ("import sys; from batchsim.server.results import run_files; "
          "run_files.FLUSH_EVERY_S = 0.0; from batchsim.scripts.cli import main; "
          "sys.exit(main(sys.argv[1:]))")


def _run(out: Path, home: Path, *args: str) -> subprocess.Popen:
    argv = [sys.executable, "-c", _OFTEN, "run", *SIM, "--request-rate", "50", "--output-len",
            "40", *args, "--out", str(out)]
    return subprocess.Popen(argv, env={**os.environ, "BATCHSIM_HOME": str(home)},
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _recording(out: Path) -> Path | None:
    """The run directory under `out` once steps.jsonl has a record in it."""
    for steps in out.glob("*/steps.jsonl"):
        if steps.stat().st_size:
            return steps.parent
    return None


def _one_line_error(proc: subprocess.Popen, err: str) -> str:
    assert proc.returncode == 1, err[-3000:]
    assert "Traceback" not in err and "terminate called" not in err, err[-3000:]
    return err.strip().splitlines()[-1]


def test_a_run_directory_removed_mid_run_is_not_made_again_nor_called_a_success(
        tmp_path, batchsim_home):
    """The run's directory removed while the run records (its records gone with it): the run
    ends with one line saying its files cannot be written, exit 1; the drawing child does not
    make the directory again to hold a picture and a summary with no records beside them (it
    did: exit 0, and `report` then found no run directory there)."""
    out = tmp_path / "out"
    run = _run(out, batchsim_home, "--num-prompts", "20000")
    try:
        run_dir = wait_until(lambda: _recording(out), "the first records", GUARD_S, run)
        os.kill(run.pid, signal.SIGSTOP)
        shutil.rmtree(run_dir)
        os.kill(run.pid, signal.SIGCONT)
        err = run.communicate(timeout=GUARD_S)[1]
    finally:
        run.kill()
        run.wait(GUARD_S)
    last = _one_line_error(run, err)
    assert "No such file or directory" in last and "its records are gone" in last, last
    assert not run_dir.exists()
