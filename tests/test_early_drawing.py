"""`batchsim run --executor sim`'s drawing child started at the program's first lines, before its
modules load (drawing_start.start_early): the run adopts it (no second child), and a run that
refuses its input, a run that draws no picture apart, or a stop signal while the program starts
kills it at once (no child left importing matplotlib after the program)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile

import pytest
from batchsim.server.results import drawing_start
from batchsim.server.results.drawing_start import wanted_early

from tests.cli_calls import gone
from tests.sim_records import wait_until

# The program as the console script starts it, each drawing child it starts noted in $NOTED:
# its pid and whether the run's modules had loaded then.
PROGRAM = """
import json, os, subprocess, sys
noted, popen = os.environ["NOTED"], subprocess.Popen.__init__
def init(self, args, *a, **k):
    popen(self, args, *a, **k)
    if "timeline_draw" in " ".join(map(str, args)):
        with open(noted, "a") as f:
            f.write(json.dumps([self.pid, "batchsim.scripts.common" in sys.modules]) + "\\n")
subprocess.Popen.__init__ = init
{patch}
sys.argv[0] = "batchsim"
from batchsim.scripts import cli
sys.exit(cli.main())
"""
SIM = ["run", "--executor", "sim", "--device-profile", "M2 Max", "--model", "llama-3.2-1b",
       "--quantize", "4", "--num-prompts", "20", "--no-progress"]
# A stop signal as the program loads its commands (as test_interrupts' _WHILE_STARTING).
SIGNALLED = """
import importlib, signal
load = importlib.import_module
def signalled(name, *args):
    os.kill(os.getpid(), signal.SIGTERM)
    return load(name, *args)
importlib.import_module = signalled
"""


def _program(home, tmp_path, argv: list[str], patch: str = "") -> tuple:
    noted = tmp_path / "noted.jsonl"
    env = {**os.environ, "BATCHSIM_HOME": str(home), "NOTED": str(noted)}
    done = subprocess.run([sys.executable, "-c", PROGRAM.format(patch=patch), *argv],
                          capture_output=True, text=True, timeout=300, check=False, env=env)
    children = [json.loads(line) for line in noted.read_text().splitlines()] if (
        noted.exists()) else []
    return done, children


def test_a_simulated_run_draws_with_the_child_started_before_its_modules(batchsim_home,
                                                                         tmp_path):
    done, children = _program(batchsim_home, tmp_path, [*SIM, "--out", str(tmp_path / "o")])
    assert done.returncode == 0, done.stderr[-2000:]
    assert len(children) == 1 and children[0][1] is False  # one child, started before them
    png = json.loads(done.stdout.splitlines()[-1])["timeline_png"]
    assert png and os.path.getsize(png) > 10_000
    assert gone(children[0][0])


@pytest.mark.parametrize("bad", [["--model", "no-such-model"], ["--num-prompts", "-3"],
                                 ["--no-such-flag"]])
def test_a_run_that_refuses_its_input_leaves_no_drawing_child(batchsim_home, tmp_path, bad):
    done, children = _program(batchsim_home, tmp_path, [*SIM, *bad, "--out", str(tmp_path)])
    assert done.returncode == 2 and len(done.stderr.strip().splitlines()) == 1, done.stderr
    assert len(children) == 1 and children[0][1] is False
    assert gone(children[0][0])  # killed before the program ended, not left to import


def test_a_stop_signal_while_starting_leaves_no_drawing_child(batchsim_home, tmp_path):
    done, children = _program(batchsim_home, tmp_path, [*SIM, "--out", str(tmp_path)],
                              patch=SIGNALLED)
    assert done.returncode == 130 and done.stderr == (
        "batchsim: interrupted while starting (SIGTERM)\n")
    assert len(children) == 1 and gone(children[0][0])


# SIGTERM as the drawing child's Popen returns, before start_early has noted the child.
SIGNALLED_AT_FORK = """
import signal
forked = subprocess.Popen.__init__
def signalled(self, args, *a, **k):
    forked(self, args, *a, **k)
    if "timeline_draw" in " ".join(map(str, args)):
        os.kill(os.getpid(), signal.SIGTERM)
subprocess.Popen.__init__ = signalled
"""


def test_a_stop_signal_as_the_child_starts_leaves_no_drawing_child(batchsim_home, tmp_path):
    done, children = _program(batchsim_home, tmp_path, [*SIM, "--out", str(tmp_path)],
                              patch=SIGNALLED_AT_FORK)
    assert done.returncode == 130 and done.stderr == (
        "batchsim: interrupted while starting (SIGTERM)\n")
    assert len(children) == 1 and gone(children[0][0])  # killed, not orphaned


def test_the_early_child_has_its_stop_signals_unblocked():
    """start_early blocks them while it starts the child, which inherits the mask."""
    drawing_start.start_early()
    try:
        status = f"/proc/{drawing_start._early.pid}/status"
        wait_until(lambda: _mask(status, "SigIgn") & 1 << (signal.SIGTERM - 1),
                   "the child's own signal handling", wait_s=120)  # ignore_stop_signals
        assert _mask(status, "SigBlk") == 0
    finally:
        drawing_start.end_early()
    assert signal.pthread_sigmask(signal.SIG_BLOCK, []) == set()  # this thread's, as before


# A SIGTERM that came while the child was started with the stop signals blocked (start_early's
# window, or a service stop then): pending as its start code unblocks them.
PENDING_SIGTERM = ("import os, signal; signal.pthread_sigmask(signal.SIG_BLOCK, [signal.SIGTERM]);"
                   " os.kill(os.getpid(), signal.SIGTERM); ")


def test_a_stop_signal_pending_as_the_child_starts_leaves_it_running():
    """Its start code ignores the stop signals before it unblocks them (and before its module's
    imports): the child goes on to its end (nothing sent: exit 0), not killed by SIGTERM."""
    child = drawing_start.start(PENDING_SIGTERM + drawing_start.START_CHILD)
    assert child is not None
    child.stdin.close()  # nothing sent
    code = child.wait(timeout=120)
    stderr = child.stderr.read()
    drawing_start.ended(child)
    assert code == 0, stderr[-2000:]


def _mask(status: str, field: str) -> int:
    with open(status) as f:
        return int(next(line for line in f if line.startswith(field)).split()[1], 16)


def _unwritable_home(monkeypatch, tmp_path):
    """HOME not writable (matplotlib then makes its config directory in the temp directory), the
    temp directory tmp_path/tmp: returned."""
    monkeypatch.setenv("HOME", "/proc/nonexistent")
    for name in ("MPLCONFIGDIR", "XDG_CONFIG_HOME", "XDG_CACHE_HOME"):
        monkeypatch.delenv(name, raising=False)
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    monkeypatch.setenv("TMPDIR", str(tmp))
    return tmp


def test_a_child_killed_while_importing_matplotlib_leaves_no_temp_directory(tmp_path,
                                                                            monkeypatch):
    """Killed after matplotlib made its config directory (matplotlib-XXXX: its exit functions,
    which a kill skips, would remove it), as a refused run kills it: nothing left."""
    tmp = _unwritable_home(monkeypatch, tmp_path)
    tempfile.tempdir = None  # read TMPDIR again
    try:
        drawing_start.start_early()
        wait_until(lambda: list(tmp.rglob("matplotlib-*")), "matplotlib's config directory",
                   wait_s=120)
        drawing_start.end_early()
    finally:
        tempfile.tempdir = None
    assert list(tmp.iterdir()) == []


def test_a_drawn_run_leaves_no_temp_directory(batchsim_home, tmp_path, monkeypatch):
    tmp = _unwritable_home(monkeypatch, tmp_path)
    done, children = _program(batchsim_home, tmp_path, [*SIM, "--out", str(tmp_path / "o")])
    assert done.returncode == 0, done.stderr[-2000:]
    assert json.loads(done.stdout.splitlines()[-1])["timeline_png"]
    assert len(children) == 1 and list(tmp.iterdir()) == []


# end_early noted with whether the run had written its records yet (steps.jsonl under --out).
NOTED_END = """
from pathlib import Path
from batchsim.server.results import drawing_start
end = drawing_start.end_early
def noted_end():
    out = Path(sys.argv[sys.argv.index("--out") + 1])
    with open(noted, "a") as f:
        f.write(json.dumps(["end_early", len(list(out.rglob("steps.jsonl")))]) + "\\n")
    end()
drawing_start.end_early = noted_end
"""


def test_a_run_that_draws_no_picture_apart_kills_the_child_before_it_runs(batchsim_home,
                                                                         tmp_path):
    """--no-timel (argparse's abbreviation of --no-timeline) is not a flag the program's first
    lines know: the child starts, and the run kills it once its config says no picture."""
    done, children = _program(batchsim_home, tmp_path, [*SIM, "--no-timel", "--out",
                                                        str(tmp_path / "o")], patch=NOTED_END)
    assert done.returncode == 0, done.stderr[-2000:]
    assert children[0][1] is False and children[1] == ["end_early", 0]  # before any record
    assert gone(children[0][0])
    assert not json.loads(done.stdout.splitlines()[-1]).get("timeline_png")


@pytest.mark.parametrize(("argv", "wanted"), [
    (["run", "--executor", "sim"], True),
    (["run", "--model", "x", "--executor=sim"], True),
    (["run", "--executor", "fake"], False),  # a measured run draws after it, nothing beside
    (["run"], False),  # sim only from a config file: started later, by the run
    (["sweep", "--executor", "sim"], False),
    (["run", "--executor", "sim", "--no-timeline"], False),
    (["run", "--executor", "sim", "--target=http://127.0.0.1:1/v1"], False),
    (["run", "--executor", "sim", "--ranks", "2"], False),
    (["run", "--executor", "sim", "--help"], False),
])
def test_which_command_lines_start_the_child_early(argv, wanted):
    assert wanted_early(argv) is wanted
