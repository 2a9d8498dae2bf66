"""Adversarial runs of a run's child processes (the records' writer, the drawing child), as real
processes: what a hostile user or machine does to them mid-run, and what must hold after."""

from __future__ import annotations

import contextlib
import errno
import json
import logging
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from batchsim.server.results import rebuild, run_files, timeline_draw
from batchsim.server.results.record_writer import WriteFailed

from tests.cli_calls import OFTEN, SIM, gone, proc_stat, stopped_writer
from tests.sim_records import request_record, wait_until

GUARD_S = 120.0
def _run(out: Path, home: Path, *args: str) -> subprocess.Popen:
    argv = [sys.executable, "-c", OFTEN, "run", *SIM, "--request-rate", "50", "--output-len",
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
    assert "No such file or directory" in last and "its records went with it" in last, last
    assert not run_dir.exists()


def _children(pid: int) -> dict[str, int]:
    """`pid`'s writer and drawing children: {"record_process": pid, "timeline_draw": pid}."""
    kids = {}
    for proc in Path("/proc").glob("[0-9]*"):
        with contextlib.suppress(OSError):
            command = (proc / "cmdline").read_bytes().decode(errors="replace")
            for module in ("record_process", "timeline_draw"):
                if f"results.{module}'" in command and proc_stat(int(proc.name))[1:2] == [str(pid)]:
                    kids[module] = int(proc.name)
    return kids


def _children_started(pid: int, out: Path) -> dict[str, int] | None:
    """`pid`'s two children once past their first lines (a child stopped before them cannot be
    resumed): the writer has written records, the drawing child has loaded numpy."""
    kids = _children(pid)
    if len(kids) < 2 or not _recording(out):
        return None
    with contextlib.suppress(OSError):
        if "numpy" in Path(f"/proc/{kids['timeline_draw']}/maps").read_text():
            return kids
    return None


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG: Linux only")
def test_children_stopped_when_the_run_is_killed_go_on_and_end(tmp_path, batchsim_home):
    """SIGSTOP to both children, then SIGKILL to the run: each child is resumed (the kernel's
    SIGCONT at its parent's death), reads its pipe to the end and exits, the writer having
    written every record it was sent. Before, both stayed stopped for good."""
    run = _run(tmp_path / "out", batchsim_home, "--num-prompts", "20000")
    kids: dict[str, int] = {}
    try:
        kids = wait_until(lambda: _children_started(run.pid, tmp_path / "out"),
                          "both children past their start", GUARD_S, run)
        for pid in kids.values():
            os.kill(pid, signal.SIGSTOP)
        run.kill()
        run.wait(GUARD_S)
        wait_until(lambda: all(map(gone, kids.values())), "the children's end", 30.0)
    finally:
        run.kill()
        run.wait(GUARD_S)
        for pid in kids.values():  # the test's own children's children: none left stopped
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
    (run_dir,) = (tmp_path / "out").iterdir()
    for name in ("steps.jsonl", "requests.jsonl"):
        assert (run_dir / name).read_bytes().endswith(b"\n") or not (run_dir / name).stat().st_size


def _with_executable(program: str) -> str:
    """OFTEN's code run with sys.executable `program` (a frozen app's, a wrapper's)."""
    return f"import sys; sys.executable = {program!r}; " + OFTEN


_EXECUTABLE_ARGV = ["run", *SIM, "--request-rate", "50", "--output-len", "40", "--num-prompts",
                   "3000", "--seed", "4", "--no-timeline"]


def _records_of(code: str, out: Path, home: Path) -> tuple[list[bytes], str]:
    """steps.jsonl's and requests.jsonl's bytes of `python -c CODE run ... --out OUT` (it must
    exit 0, with no traceback), and its stderr."""
    proc = subprocess.run([sys.executable, "-c", code, *_EXECUTABLE_ARGV, "--out", str(out)],
                          env={**os.environ, "BATCHSIM_HOME": str(home)}, capture_output=True,
                          check=False, text=True, timeout=GUARD_S)
    assert proc.returncode == 0 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    (run_dir,) = out.iterdir()
    return [(run_dir / n).read_bytes() for n in ("steps.jsonl", "requests.jsonl")], proc.stderr


@pytest.fixture(scope="module")
def usual_records(tmp_path_factory, batchsim_home) -> list[bytes]:
    """The records of the run below with a working writer: made once for every program."""
    return _records_of(OFTEN, tmp_path_factory.mktemp("usual"), batchsim_home)[0]


@pytest.mark.parametrize("program", ["/bin/false", "/bin/cat"])
def test_a_sys_executable_that_runs_no_writer_leaves_the_run_its_records(
        tmp_path, batchsim_home, usual_records, program):
    """sys.executable a program that is no Python running batchsim (a frozen app's, a
    wrapper's): the writer 'child' ends at once without a word, and the run writes its records
    itself, the same bytes as a run whose writer worked, exit 0, one warning. Before, every
    simulated run past its first flush stopped there: exit 1, most records never made."""
    odd, err = _records_of(_with_executable(program), tmp_path / "odd", batchsim_home)
    assert usual_records == odd and all(usual_records)
    assert "the records' writer process exited" in err, err[-3000:]


def test_a_banner_on_the_childrens_stdout_does_not_cost_their_answers(tmp_path, batchsim_home):
    """A sitecustomize that prints a banner (no newline after it) as every Python starts, the
    children's included: their answers still read (the writer's after its start mark, the
    picture's on the last line). Before, both were read as garbage: the writer's batches were
    written again by the run after a warning, and the picture drawn again in the run."""
    site = tmp_path / "site"
    site.mkdir()
    (site / "sitecustomize.py").write_text("print('welcome to this machine', end='')\n")
    env = {**os.environ, "BATCHSIM_HOME": str(batchsim_home), "PYTHONPATH": str(site)}
    proc = subprocess.run([sys.executable, "-c", OFTEN, "run", *SIM, "--request-rate", "50",
                           "--num-prompts", "2000", "--out", str(tmp_path / "out")],
                          env=env, capture_output=True, check=False, text=True, timeout=GUARD_S)
    assert proc.returncode == 0 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    assert "writer process" not in proc.stderr and "drawn here" not in proc.stderr, proc.stderr
    (run_dir,) = (tmp_path / "out").iterdir()
    assert (run_dir / "timeline.png").stat().st_size and (run_dir / "steps.jsonl").stat().st_size


def _stopped_writer(marker: Path) -> str:
    """The writer stops itself as it starts, and the run's close would wait a minute for it;
    `marker` is made as that close starts to wait (WriterProcess.finish), none before."""
    return stopped_writer(GUARD_S / 2) + (
        "_finish = rp.WriterProcess.finish; rp.WriterProcess.finish = lambda self, *a, **k: "
        f"(open({str(marker)!r}, 'w').close(), _finish(self, *a, **k))[1]; ")


def _cpu_ticks(pid: int) -> int:
    fields = proc_stat(pid)
    return int(fields[11]) + int(fields[12]) if len(fields) > 12 else -1  # utime + stime


def test_a_signal_while_the_run_awaits_its_writer_ends_the_wait(tmp_path, batchsim_home):
    """The run over, its close awaiting a writer that does not answer (stopped): Ctrl-C ends
    the wait at once, the writer killed, and the run writes the batches itself (the same
    records as a run whose writer worked), exit 130. Before, the signal was noted and the run
    went on waiting (FINISH_WAIT_S, 15 s; here a minute)."""
    argv = ["run", *SIM, "--request-rate", "50", "--output-len", "40", "--num-prompts", "300",
            "--seed", "6", "--no-timeline"]
    env = {**os.environ, "BATCHSIM_HOME": str(batchsim_home)}
    subprocess.run([sys.executable, "-c", OFTEN, *argv, "--out", str(tmp_path / "whole")],
                   env=env, capture_output=True, check=True, timeout=GUARD_S)
    marker = tmp_path / "awaits-its-writer"
    run = subprocess.Popen([sys.executable, "-c", _stopped_writer(marker) + OFTEN, *argv,
                            "--out", str(tmp_path / "cut")], env=env, stdout=subprocess.DEVNULL,
                           stderr=subprocess.PIPE, text=True)
    try:
        seen = [-2, -1]  # the run's CPU time twice, 0.5 s apart: equal once it only waits

        def waiting() -> bool:  # in its close's wait (marked), not a run starved of CPU mid-run
            seen[:] = [seen[1], _cpu_ticks(run.pid)]
            time.sleep(0.5)
            return (seen[0] == seen[1] and marker.exists()
                    and "record_process" in _children(run.pid))

        wait_until(waiting, "the run to wait for its writer", GUARD_S / 4, run)
        run.send_signal(signal.SIGINT)
        start = time.monotonic()
        err = run.communicate(timeout=GUARD_S)[1]
        waited_s = time.monotonic() - start
    finally:
        run.kill()
        run.wait(GUARD_S)
    assert run.returncode == 130 and "Traceback" not in err, err[-3000:]
    assert waited_s < GUARD_S / 4, (waited_s, err[-3000:])
    assert "did not answer in" in err, err[-3000:]
    (whole,) = (tmp_path / "whole").iterdir()
    (cut,) = (tmp_path / "cut").iterdir()
    for name in ("steps.jsonl", "requests.jsonl"):
        assert (cut / name).read_bytes() == (whole / name).read_bytes()


def _no_room(path: Path, write) -> None:
    raise WriteFailed(path, OSError(errno.ENOSPC, "No space left on device"))


def test_no_room_to_put_whole_records_in_arrival_order_is_a_warning(tmp_path, monkeypatch,
                                                                    caplog):
    """Every record streamed (in completion order), no room at close for requests.jsonl's
    rewrite in arrival order: the file stays whole, a warning says its order, and the run is
    not stopped (it was: exit 1, summary 'interrupted' by a run that finished; measured on a
    2.6 MB tmpfs). A record only the rewrite had (unfinished at the end) is a failed write."""
    monkeypatch.setattr(run_files, "FLUSH_EVERY_S", 0.0)  # nothing held: completion order
    monkeypatch.setattr(run_files, "write_atomically", _no_room)
    records = [request_record(i, 0.0, 0.5) for i in (1, 2, 3)]
    errors: list[OSError] = []
    stream = run_files.RecordStream(tmp_path, on_error=errors.append)
    stream.arrivals.extend([1, 2, 3])
    for i in (2, 1, 3):
        stream.add_request(records[i - 1])
        stream.flush_if_due()
    with caplog.at_level(logging.WARNING, "batchsim"):
        stream.close(records)
    assert errors == [] and stream.error is None
    assert "requests.jsonl kept whole, in the order written" in caplog.text, caplog.text
    lines = (tmp_path / run_files.REQUESTS).read_text().splitlines()
    assert [json.loads(line)["request_id"] for line in lines] == [2, 1, 3]
    (tmp_path / "b").mkdir()
    stream = run_files.RecordStream(tmp_path / "b", on_error=errors.append)
    stream.add_request(records[0])
    stream.close(records)  # 2 and 3 were never written: lost with the rewrite
    assert len(errors) == 1 and "No space left on device" in str(stream.error)


def test_a_backend_named_in_mplbackend_that_cannot_load_costs_no_picture(tmp_path,
                                                                        batchsim_home):
    """MPLBACKEND left by a notebook's terminal (module://matplotlib_inline..., a package this
    environment lacks): batchsim writes files on Agg whatever it names. Before, matplotlib's
    import failed on it in the drawing child and again in the run: 'timeline.png: not drawn'."""
    env = {**os.environ, "BATCHSIM_HOME": str(batchsim_home),
           "MPLBACKEND": "module://matplotlib_inline.backend_inline"}
    proc = subprocess.run([sys.executable, "-m", "batchsim.scripts.cli", "run", *SIM,
                           "--num-prompts", "20", "--out", str(tmp_path)], env=env,
                          capture_output=True, check=False, text=True, timeout=GUARD_S)
    assert proc.returncode == 0 and "not drawn" not in proc.stderr, proc.stderr[-3000:]
    (run_dir,) = tmp_path.iterdir()
    assert (run_dir / "timeline.png").read_bytes().startswith(b"\x89PNG")


def test_a_service_stop_signals_the_drawing_child_too_and_it_still_draws(tmp_path,
                                                                         batchsim_home):
    """SIGTERM to the run and both children at once (systemd stopping a service signals every
    process of its group): the run stops, and its picture is the drawing child's, not drawn
    again in the run after the child died (it was: 'drawn here (the drawing process exited
    -15...)', 0.4 s more of the run's CPU). A child killed after all says how, by name."""
    run = _run(tmp_path / "out", batchsim_home, "--num-prompts", "20000")
    try:
        kids = wait_until(lambda: _children_started(run.pid, tmp_path / "out"),
                          "both children past their start", GUARD_S, run)
        for pid in (run.pid, *kids.values()):
            os.kill(pid, signal.SIGTERM)
        err = run.communicate(timeout=GUARD_S)[1]
    finally:
        run.kill()
        run.wait(GUARD_S)
    assert run.returncode == 130 and "Traceback" not in err, err[-3000:]
    assert "timeline.png" not in err, err[-3000:]  # no line: drawn by the child
    (run_dir,) = (tmp_path / "out").iterdir()
    assert (run_dir / "timeline.png").read_bytes().startswith(b"\x89PNG")
    assert timeline_draw._reply(b"", b"", -signal.SIGKILL) == (None, (
        "timeline.png: not drawn (the drawing process was killed (SIGKILL))"))


def test_report_on_a_run_still_going_replaces_neither_its_summary_nor_its_picture(
        tmp_path, monkeypatch):
    """`batchsim report` on a run directory while its run still goes: the run writes its
    summary.json (and timeline.png) while the report reads the records. The report writes
    neither over them (it did: its summary, 'interrupted' with the records it had read, 11255
    of 18000, replaced the finished run's), and says why."""
    (tmp_path / "steps.jsonl").write_text("")
    (tmp_path / "requests.jsonl").write_text("")
    finished = {"interrupted": False, "completed": 18000}
    read = rebuild._records

    def the_run_finishes_meanwhile(path, cls, notes):
        (tmp_path / "timeline.png").write_bytes(b"\x89PNG the run's")
        (tmp_path / "summary.json").write_text(json.dumps(finished))
        return read(path, cls, notes)

    monkeypatch.setattr(rebuild, "_records", the_run_finishes_meanwhile)
    _, notes = rebuild.rebuild_summary(tmp_path)
    assert json.loads((tmp_path / "summary.json").read_text()) == finished
    assert (tmp_path / "timeline.png").read_bytes() == b"\x89PNG the run's"
    assert any("changed while read" in note for note in notes), notes
    assert not any("not a JSON object" in note for note in notes), notes  # none when read
