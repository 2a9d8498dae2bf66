"""timeline.png drawn by a child process (`batchsim run`'s way): the same picture as drawn in
process, its failures one warning that costs the run nothing, and no child left behind."""

from __future__ import annotations

import json
import logging
import os
import pickle
import signal
import subprocess
import sys

import pytest
from batchsim.server.engine import runner
from batchsim.server.engine.runner import run_workload
from batchsim.server.engine.session import open_session
from batchsim.server.results import timeline_draw
from batchsim.server.results.timeline_draw import DrawingProcess

from tests.cli_calls import last_json
from tests.sim_records import sim_config


def _run(tmp_path, label: str, timeline):
    session = open_session(sim_config(n=30))
    if timeline is not True:
        with DrawingProcess() as drawing:
            return run_workload(session, session.config.workload, out_dir=tmp_path, label=label,
                                timeline=drawing)
    return run_workload(session, session.config.workload, out_dir=tmp_path, label=label)


def test_the_child_draws_the_same_picture_while_this_process_draws_nothing(tmp_path,
                                                                           monkeypatch):
    here = _run(tmp_path, "here", True)

    def not_here(*args, **kwargs):
        raise AssertionError("drawn in the run's own process")

    monkeypatch.setattr(timeline_draw, "draw_panels", not_here)
    apart = _run(tmp_path, "apart", "apart")
    png = apart.run_dir / "timeline.png"
    assert apart.summary["timeline_png"] == str(png)
    assert png.read_bytes() == (here.run_dir / "timeline.png").read_bytes()


def test_a_failed_child_is_one_warning_and_the_run_keeps_its_summary(tmp_path, monkeypatch,
                                                                    caplog):
    monkeypatch.setattr(sys, "executable", "/bin/false")  # starts, answers nothing, exits 1
    with caplog.at_level(logging.WARNING, logger="batchsim"):
        outcome = _run(tmp_path, "t", "apart")
    png = outcome.run_dir / "timeline.png"
    assert outcome.summary["timeline_png"] == str(png) and png.exists()  # drawn here instead
    assert outcome.summary["completed"] == 30 and (outcome.run_dir / "summary.json").exists()
    assert [r.getMessage() for r in caplog.records] == [
        "timeline.png: drawn here (the drawing process exited 1: no message)"]


@pytest.mark.timeout(60)
def test_a_stopped_child_is_killed_after_its_wait_and_the_summary_is_kept(tmp_path, monkeypatch,
                                                                        caplog):
    monkeypatch.setattr(timeline_draw, "DRAW_WAIT_S", 0.5)
    monkeypatch.setattr(timeline_draw, "DRAW_WAIT_PER_STEP_S", 0.0)
    session = open_session(sim_config(n=30))
    with caplog.at_level(logging.WARNING, logger="batchsim"), DrawingProcess() as drawing:
        child = drawing._child
        assert child is not None
        os.kill(child.pid, signal.SIGSTOP)  # never answers
        outcome = run_workload(session, session.config.workload, out_dir=tmp_path, label="t",
                               timeline=drawing)
    assert child.poll() is not None  # killed, not left behind
    assert outcome.summary["timeline_png"] is None and outcome.summary["completed"] == 30
    assert json.loads((outcome.run_dir / "summary.json").read_text())["completed"] == 30
    assert [r.getMessage() for r in caplog.records] == [
        "timeline.png: not drawn (the drawing process did not answer in 0.5 s; stopped)"]


def test_no_python_to_name_draws_here(tmp_path, monkeypatch):
    monkeypatch.setattr(sys, "executable", None)  # as sys.executable may be when embedded
    outcome = _run(tmp_path, "t", "apart")
    assert outcome.summary["timeline_png"] == str(outcome.run_dir / "timeline.png")


def test_no_child_to_start_draws_here(tmp_path, monkeypatch):
    monkeypatch.setattr(sys, "executable", str(tmp_path / "no-such-python"))
    outcome = _run(tmp_path, "t", "apart")
    assert outcome.summary["timeline_png"] == str(outcome.run_dir / "timeline.png")


def test_a_child_sent_nothing_ends_with_the_run():
    drawing = DrawingProcess()
    child = drawing._child
    assert child is not None and child.poll() is None  # importing matplotlib meanwhile
    drawing.close()
    assert child.poll() is not None


def test_panels_that_fail_are_one_warning_and_the_records_and_summary_are_kept(tmp_path,
                                                                            monkeypatch, caplog):
    def broken(*args, **kwargs):
        raise RuntimeError("no panels")

    monkeypatch.setattr(runner, "run_timeline_panels", broken)
    with caplog.at_level(logging.WARNING, logger="batchsim"):
        outcome = _run(tmp_path, "t", "apart")
    saved = json.loads((outcome.run_dir / "summary.json").read_text())
    assert saved["timeline_png"] is None and saved["completed"] == 30
    lines = (outcome.run_dir / "requests.jsonl").read_text().splitlines()
    assert len(lines) == 30 and (outcome.run_dir / "steps.jsonl").read_text().count("\n") > 0
    assert [r.getMessage() for r in caplog.records] == [
        "timeline.png: not drawn (no panels)"]


@pytest.mark.parametrize("executor", ["sim", "fake"])
def test_only_a_simulated_run_starts_a_drawing_child(executor, batchsim_home, tmp_path,
                                                     monkeypatch, capsys):
    from batchsim.scripts.cli import main

    started = []

    class Counted(DrawingProcess):
        def __init__(self) -> None:
            started.append(self)
            super().__init__()

    monkeypatch.setattr(timeline_draw, "DrawingProcess", Counted)
    model = (["--device-profile", "M2 Max", "--model", "llama-3.2-1b", "--quantize", "4"]
             if executor == "sim" else ["--model", "tiny"])
    assert main(["run", "--executor", executor, *model, "--num-prompts", "4", "--input-len", "16",
                 "--output-len", "8", "--no-progress", "--out", str(tmp_path)]) == 0
    summary = last_json(capsys.readouterr().out)
    assert len(started) == (executor == "sim")  # a measured run decodes with no child beside it
    assert summary["timeline_png"] and os.path.exists(summary["timeline_png"])


def test_the_child_imports_nothing_from_the_working_directory(tmp_path, monkeypatch):
    """h8: `python -m` put the working directory first on the child's path: a numpy.py there
    ran in the child (the console script's process never imports from it), and the picture
    was drawn in the run's process instead. (r3: on every Python: PYTHONSAFEPATH is 3.11's.)"""
    work = tmp_path / "work"
    work.mkdir()
    (work / "numpy.py").write_text(f"open({str(tmp_path / 'ran')!r}, 'w').close()\n"
                                   "raise SystemExit('not numpy')\n")
    monkeypatch.chdir(work)
    apart = _run(tmp_path, "apart", "apart")
    assert not (tmp_path / "ran").exists()
    assert apart.summary["timeline_png"] == str(apart.run_dir / "timeline.png")


def test_the_child_exits_without_its_teardown_once_it_answered(tmp_path, monkeypatch):
    """The child's interpreter teardown (matplotlib's objects freed: 0.5 s at load 9) held the
    run's wait for it after the picture was written: it exits at once (a module global's __del__,
    run by the teardown, never runs)."""
    torn_down = tmp_path / "torn-down"
    monkeypatch.setattr(timeline_draw, "_START_CHILD", "_probe = type('P', (), {'__del__': "
                        f"lambda self, o=open: o({str(torn_down)!r}, 'w').close()}})(); "
                        f"{timeline_draw._START_CHILD}")
    apart = _run(tmp_path, "apart", "apart")
    assert apart.summary["timeline_png"] == str(apart.run_dir / "timeline.png")
    assert not torn_down.exists()


def test_the_child_leaves_no_temporary_config_directory(tmp_path, monkeypatch):
    """r4: where HOME is not writable matplotlib makes a temporary config directory and removes
    it at exit (atexit): the child's quick exit skipped that, leaving a /tmp/matplotlib-* (40 KB)
    per run. HOME here is a file, so no config directory can be made in it, even as root."""
    home, tmp = tmp_path / "home", tmp_path / "tmp"
    home.write_text("not a directory\n")
    tmp.mkdir()
    for name in ("MPLCONFIGDIR", "XDG_CONFIG_HOME", "XDG_CACHE_HOME"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("HOME", str(home))
    monkeypatch.setenv("TMPDIR", str(tmp))
    apart = _run(tmp_path, "apart", "apart")
    assert apart.summary["timeline_png"] == str(apart.run_dir / "timeline.png")
    assert not list(tmp.glob("matplotlib-*"))


# The drawing child's own order (timeline_draw._serve): the canvas made, the warm-up, then the
# panels unpickled, as made by another process (here the test's), then drawn. Nothing else is
# loaded first: no run in this process (it loaded more modules than the child has).
WARMED = """
import pickle, sys
from pathlib import Path
from batchsim.server.results import timeline_draw

canvas = timeline_draw._canvas(ahead=True)
from matplotlib import font_manager
from matplotlib.figure import Figure

saved, savefig = [], Figure.savefig

def noted(fig, *args, **kwargs):
    saved.append(tuple(map(float, fig.get_size_inches())))
    return savefig(fig, *args, **kwargs)

Figure.savefig = noted
timeline_draw._warm()
warmed = list(saved)
path, panels = pickle.loads(Path(sys.argv[1]).read_bytes())
loaded, fonts = set(sys.modules), font_manager._get_font.cache_info().misses
timeline_draw.draw_panels(path, panels, canvas)
print(warmed, sorted(set(sys.modules) - loaded), font_manager._get_font.cache_info().misses - fonts)
"""


def test_the_warm_up_is_a_small_picture_that_leaves_the_timeline_nothing_to_load(tmp_path):
    """The drawing child warms up while the run runs, on the core the run's writer process uses
    too: a picture of one square inch (it drew a whole timeline to memory, 0.2 s of CPU), after
    which the timeline loads no module and no font (what the warm-up is for)."""
    from batchsim.server.engine.run_dir import run_timeline_panels

    session = open_session(sim_config(n=30))
    out = run_workload(session, session.config.workload, out_dir=None, label="w")
    panels = run_timeline_panels(out.requests, out.steps, session, session.config.workload, None)
    sent = tmp_path / "panels.pickle"  # as DrawingProcess.send pickles them for the child
    sent.write_bytes(pickle.dumps((tmp_path / "t.png", panels), protocol=pickle.HIGHEST_PROTOCOL))
    done = subprocess.run([sys.executable, "-c", WARMED, str(sent)],
                          capture_output=True, text=True, timeout=300, check=False)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split("\n")[0] == "[(1.0, 1.0)] [] 0"
    assert (tmp_path / "t.png").stat().st_size > 10_000
