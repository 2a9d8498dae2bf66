"""pytest started with SIGINT ignored (a script's `cmd &`, `trap "" INT`): the tests that press
Ctrl-C in their own process, or in a command they start, failed (exit 0 where 130 was expected)."""

from __future__ import annotations

import signal
import subprocess
import sys
from pathlib import Path

import pytest

from tests import dispositions

ROOT = Path(__file__).resolve().parents[1]
CTRL_C_TESTS = [  # in pytest's own process, then in a command it starts
    ("tests/test_hostile_signals.py::test_ctrl_c_in_one_run_of_sweep_or_compare_stops_the_command"
     "[sweep]"),
    "tests/test_review_r3.py::test_a_ctrl_c_python_swallowed_still_stops_a_command_without_a_run",
]


@pytest.mark.timeout(300)
def test_ctrl_c_tests_pass_under_a_pytest_that_inherited_sigint_ignored(tmp_path):
    cmd = [sys.executable, "-m", "pytest", "-rA", "-p", "no:cacheprovider",
           "--basetemp", str(tmp_path / "t"), *CTRL_C_TESTS]
    proc = subprocess.run(dispositions.command(cmd, signal.SIGINT), cwd=ROOT, capture_output=True,
                          text=True, timeout=280, check=False)
    assert proc.returncode == 0, proc.stdout[-3000:]
    assert proc.stdout.count("\nPASSED tests/") == len(CTRL_C_TESTS), proc.stdout[-3000:]
