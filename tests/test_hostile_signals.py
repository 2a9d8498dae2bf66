"""Signals in commands that run several runs (sweep, compare) or one to fit on (calibrate,
validate): each stops the command and keeps the run under way (h8's adversarial pass, issue 37
item 4; split out of test_hostile_inputs.py at 411 lines, r3 finding 10)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from tests.cli_calls import _main, _one_line

_SWEEP = ["sweep", "--executor", "sim", "--device-profile", "M2 Max", "--model", "llama-3.2-1b",
          "--quantize", "4", "--no-progress", "--no-timeline", "--output-len", "8",
          "--prompt-len", "64", "--batches", "1,2,4"]
_COMPARE = ["compare", "--executor", "sim", "--device-profile", "M2 Max", "--model",
            "llama-3.2-1b", "--quantize", "4", "--batch", "4", "--num-prompts", "4",
            "--input-len", "64", "--output-len", "8", "--no-timeline"]


@pytest.mark.parametrize("argv", [_SWEEP, _COMPARE], ids=["sweep", "compare"])
def test_ctrl_c_in_one_run_of_sweep_or_compare_stops_the_command(capsys, tmp_path, monkeypatch,
                                                                 argv):
    """Ctrl-C during a sweep's first point (or compare's first run) stopped only that run's
    sending: the next runs went on, the table and sweep.jsonl / compare.jsonl used the cut-short
    run, exit 0 (4 s into a 7-point sweep: all 7 rows). Now exit 130, that run kept."""
    import signal

    from batchsim.server.engine import runner

    drive, runs = runner._Run.drive, []

    def pressed(run):
        runs.append(run)
        if len(runs) == 1:
            os.kill(os.getpid(), signal.SIGINT)  # as the first run starts
        return drive(run)

    monkeypatch.setattr(runner._Run, "drive", pressed)
    rc, _, err = _main([*argv, "--out", str(tmp_path), "--runs-dir", str(tmp_path / "runs")],
                       capsys)
    assert rc == 130 and _one_line(err).endswith("interrupted"), err
    assert len(runs) == 1 and not list(tmp_path.glob("*.jsonl"))
    (kept,) = (tmp_path / "runs").iterdir()
    assert (kept / "summary.json").is_file()


@pytest.mark.parametrize("command", ["calibrate", "validate"])
def test_ctrl_c_in_a_run_of_calibrate_or_validate_stops_it(monkeypatch, command):
    """calibrate fitted the step overhead it saves in a device profile on the steps of a run a
    Ctrl-C had cut short, and validate scored one, and each went on."""
    import importlib
    import signal

    from batchsim.server.engine import runner
    from batchsim.server.engine.session import open_session

    from tests.sim_records import sim_config

    drive = runner._Run.drive

    def pressed(run):
        os.kill(os.getpid(), signal.SIGINT)
        return drive(run)

    monkeypatch.setattr(runner._Run, "drive", pressed)
    session = open_session(sim_config(8))
    module = importlib.import_module(f"batchsim.scripts.{command}")
    with pytest.raises(KeyboardInterrupt):
        if command == "calibrate":
            module._busy_gaps(session, session.config.workload)
        else:
            module._run(session, None, "validate")


_TERM_AS_THE_FIRST_RUN_STARTS = """
import os, signal, sys
from batchsim.server.platform import blas
blas.preload()
from batchsim.server.engine import runner
drive = runner._Run.drive
def pressed(run):
    if not getattr(runner, "_pressed", False):
        runner._pressed = True
        os.kill(os.getpid(), signal.SIGTERM)
    return drive(run)
runner._Run.drive = pressed
from batchsim.scripts.cli import main
sys.exit(main(sys.argv[1:]))
"""


@pytest.mark.parametrize("argv", [_SWEEP, _COMPARE], ids=["sweep", "compare"])
def test_sigterm_to_sweep_or_compare_keeps_the_runs_summary(tmp_path, argv):
    """`run` answers SIGTERM and SIGHUP as Ctrl-C; sweep and compare died of them (exit -15),
    the run under way left without its summary.json."""
    import json

    proc = subprocess.run([sys.executable, "-c", _TERM_AS_THE_FIRST_RUN_STARTS, *argv, "--out",
                           str(tmp_path), "--runs-dir", str(tmp_path / "runs")],
                          capture_output=True, text=True, timeout=300, check=False)
    assert proc.returncode == 130, proc.stderr[-2000:]
    (kept,) = (tmp_path / "runs").iterdir()
    assert json.loads((kept / "summary.json").read_text())["interrupt_reason"] == "SIGTERM"


_SENT_IN_A_RUN_OF = """
import importlib, os, signal, sys
from pathlib import Path
from batchsim.server.platform import blas
blas.preload()
from batchsim.server.engine import runner
from batchsim.server.engine.session import open_session
from tests.sim_records import sim_config
command, sig, out_dir = sys.argv[1], getattr(signal, sys.argv[2]), Path(sys.argv[3])
drive = runner._Run.drive
def sent(run):
    os.kill(os.getpid(), sig)
    return drive(run)
runner._Run.drive = sent
session = open_session(sim_config(8))
module = importlib.import_module(f"batchsim.scripts.{command}")
try:
    if command == "calibrate":
        module._busy_gaps(session, session.config.workload)
    else:
        module._run(session, out_dir, "validate")
except KeyboardInterrupt:
    sys.exit(130)
"""


@pytest.mark.parametrize("sig", ["SIGTERM", "SIGHUP"])
@pytest.mark.parametrize("command", ["calibrate", "validate"])
def test_sigterm_or_sighup_in_calibrate_or_validate_stops_it_as_ctrl_c(tmp_path, command, sig):
    """r3 finding 7: calibrate and validate answered only SIGINT; SIGTERM or SIGHUP killed them
    (exit -15 / -1), validate's run directory left without its summary.json."""
    import json
    from pathlib import Path

    proc = subprocess.run([sys.executable, "-c", _SENT_IN_A_RUN_OF, command, sig, str(tmp_path)],
                          capture_output=True, text=True, timeout=300, check=False,
                          cwd=Path(__file__).resolve().parents[1])
    assert proc.returncode == 130, proc.stderr[-2000:]
    if command == "validate":
        (kept,) = tmp_path.iterdir()
        assert json.loads((kept / "summary.json").read_text())["interrupt_reason"] == sig
