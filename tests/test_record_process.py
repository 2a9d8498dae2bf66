"""The run's records written by a writer process (record_process.py): byte-identical to the
records written in the run's own process, written in the run's process where no writer process
can start, and kept when the run's process is killed while the writer lags behind."""

from __future__ import annotations

import json
import os
import resource
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from batchsim.server.engine.runner import run_workload
from batchsim.server.engine.session import open_session
from batchsim.server.results import record_process, run_files

from tests.cli_calls import OFTEN, SIM, gone, stopped_writer
from tests.sim_records import sim_config, step_record, the_files, wait_until

GUARD_S = 120.0
_WRITER_CODE = "run_module('batchsim.server.results.record_process'"  # its start code's call


def _run(out: Path) -> Path:
    session = open_session(sim_config())
    return run_workload(session, session.config.workload, out_dir=out, label="t",
                        timeline=False).run_dir


def test_the_writer_process_writes_the_records_here_written_where_none_starts(tmp_path,
                                                                              monkeypatch):
    """A run's records come from the writer process; where none can start (its program gone:
    sys.executable empty), the run writes the same bytes itself. A flush at every step: the
    writer starts at the first (and requests.jsonl, held no longer, is rewritten in arrival
    order at the end from what the writer answered it wrote)."""
    monkeypatch.setattr(run_files, "FLUSH_EVERY_S", 0.0)
    started = []
    start = record_process.WriterProcess.__init__

    def noted(self, *args):
        start(self, *args)
        started.append(self._child.pid)

    monkeypatch.setattr(record_process.WriterProcess, "__init__", noted)
    by_child = the_files(_run(tmp_path / "child"))
    assert len(started) == 1
    monkeypatch.setattr(sys, "executable", "")
    here = the_files(_run(tmp_path / "here"))
    assert len(started) == 1 and by_child == here and all(by_child)


def _processes() -> list[tuple[int, int, str, str]]:
    """(pid, parent's pid, state, command) of every process: `ps` (Linux and macOS; -ww: the
    whole command, not cut at 80 columns)."""
    out = subprocess.run(["ps", "-A", "-ww", "-o", "pid=,ppid=,stat=,command="], check=True,
                         capture_output=True, text=True, timeout=GUARD_S).stdout
    return [(int(pid), int(ppid), stat, command) for pid, ppid, stat, command in
            (line.split(None, 3) for line in out.splitlines() if len(line.split(None, 3)) == 4)]


def _writer_of(pid: int) -> int | None:
    """The pid of `pid`'s child running the writer's own start code, if one runs (the run's
    argv names record_process too: a child between its fork and exec, the BLAS probe, shows it)."""
    return next((p for p, parent, _, command in _processes()
                 if parent == pid and _WRITER_CODE in command), None)


def _written_bytes(pid: int) -> int:
    """Bytes `pid` passed to write(): its records sent down the pipe among them."""
    io = dict(line.split(": ") for line in Path(f"/proc/{pid}/io").read_text().splitlines())
    return int(io["wchar"])


def _wait(until, what: str, run: subprocess.Popen | None = None) -> object:
    return wait_until(until, what, GUARD_S, run)


# The writer process stops itself as it starts: the run sends everything and waits for its
# answer. Its close waits GUARD_S, not FINISH_WAIT_S: a loaded machine's stall must not let the
# run kill the stopped writer before the test kills the run.
_STOPPED = stopped_writer(GUARD_S)


@pytest.mark.skipif(not Path("/proc/self/io").exists(), reason="reads write counts in /proc")
def test_a_killed_run_leaves_every_record_it_sent_to_a_lagging_writer(tmp_path, batchsim_home):
    """SIGKILL of the run's process while its writer process is stopped: once the writer goes
    on, it writes every record it was sent, the same bytes as a run that was not killed (a run
    written in its own process leaves only what it wrote before it was killed)."""
    argv = [sys.executable, "-c", OFTEN, "run", *SIM, "--num-prompts", "20",
            "--request-rate", "20", "--output-len", "40", "--seed", "5", "--no-timeline"]
    env = {**os.environ, "BATCHSIM_HOME": str(batchsim_home)}
    whole = subprocess.run([*argv, "--out", str(tmp_path / "whole")], env=env, check=True,
                           capture_output=True, timeout=GUARD_S)
    assert whole.returncode == 0
    (expected,) = (tmp_path / "whole").iterdir()
    argv[2] = _STOPPED + OFTEN
    run = subprocess.Popen([*argv, "--out", str(tmp_path / "killed")], env=env,
                           stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        writer = _wait(lambda: _writer_of(run.pid), "the writer process", run)
        seen = [_written_bytes(run.pid), time.monotonic()]

        def settled() -> bool:  # every record sent: the run waits for its writer's answer
            now = _written_bytes(run.pid)  # (3 s without a write: a loaded machine's pauses)
            if now != seen[0]:
                seen[:] = [now, time.monotonic()]
            return time.monotonic() - seen[1] > 3.0

        _wait(settled, "the run to send its records", run)
        (run_dir,) = (tmp_path / "killed").iterdir()
        at_kill = the_files(run_dir)  # the writer stopped from its start: nothing written yet
        run.kill()
        run.wait(GUARD_S)
        os.kill(writer, signal.SIGCONT)
        _wait(lambda: gone(writer), "the writer process to finish")
    finally:
        run.kill()
        run.wait(GUARD_S)
    assert the_files(run_dir) == the_files(expected) and all(the_files(run_dir))
    assert len(at_kill[0]) < len(the_files(run_dir)[0])  # written after the run was killed


def test_a_writer_killed_mid_run_stops_the_run_with_one_line_and_loses_no_record(
        tmp_path, batchsim_home):
    """SIGKILL of the writer process while the run goes (the run held still meanwhile): the
    run stops at its next flush, says how the writer ended, and every plan and request it
    recorded is in whole lines (the writer's unwritten batches written by the run itself)."""
    argv = [sys.executable, "-c", OFTEN, "run", *SIM, "--num-prompts", "20000",
            "--request-rate", "50", "--output-len", "40", "--no-timeline", "--out", str(tmp_path)]
    run = subprocess.Popen(argv, env={**os.environ, "BATCHSIM_HOME": str(batchsim_home)},
                           stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        writer = _wait(lambda: _writer_of(run.pid), "the writer process", run)
        os.kill(run.pid, signal.SIGSTOP)
        os.kill(writer, signal.SIGKILL)
        os.kill(run.pid, signal.SIGCONT)
        err = run.communicate(timeout=GUARD_S)[1]
    finally:
        run.kill()
        run.wait(GUARD_S)
    assert run.returncode == 1 and "Traceback" not in err, err[-3000:]
    (run_dir,) = tmp_path.iterdir()
    assert err.strip().splitlines()[-1] == (  # what happened, and what is kept: nothing lost
        "batchsim run: the records' writer process was killed (SIGKILL) (the run stopped; every "
        f"record until then is in {run_dir}, the writer's unwritten ones written by the run)")
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["interrupted"] and summary["num_unfinished"] > 0  # stopped early
    lines = [(run_dir / n).read_bytes() for n in (run_files.STEPS, run_files.REQUESTS)]
    assert all(b.endswith(b"\n") for b in lines)
    assert lines[0].count(b"\n") == summary["num_plans"]
    assert lines[1].count(b"\n") == summary["completed"] + summary["failed"]


def test_a_writer_late_at_close_is_one_warning_and_the_run_finished(tmp_path, batchsim_home):
    """The writer stopped from its start and late at close (0.5 s): the run writes its batches
    itself. Its loop had ended and every record is written: rc 0, not interrupted, one warning."""
    argv = [sys.executable, "-c", stopped_writer(0.5) + OFTEN, "run", *SIM,
            "--num-prompts", "20", "--request-rate", "20", "--output-len", "40", "--seed", "5",
            "--no-timeline", "--out", str(tmp_path)]
    proc = subprocess.run(argv, env={**os.environ, "BATCHSIM_HOME": str(batchsim_home)},
                          capture_output=True, check=False, text=True, timeout=GUARD_S)
    assert proc.returncode == 0, proc.stderr[-3000:]
    (run_dir,) = tmp_path.iterdir()
    assert proc.stderr.strip().splitlines()[-1].startswith(
        f"{run_dir}: the records' writer process did not answer in 0.5 s; its last ")
    summary = json.loads((run_dir / "summary.json").read_text())
    assert not summary["interrupted"] and summary["num_unfinished"] == 0
    steps, requests = the_files(run_dir)
    assert steps.count(b"\n") == summary["num_plans"] and requests.count(b"\n") == 20


def _file_limit(limit_bytes: int):
    def preexec() -> None:  # as test_disk_full: a write past the limit fails with EFBIG
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit_bytes, limit_bytes))
    return preexec


def test_the_writers_failed_write_stops_the_run_with_one_line(tmp_path, batchsim_home):
    """The file size limit reached in the writer process (it inherits the run's): its answer
    stops the run at a later flush; whole records stay, the summary says why, one line."""
    limit = 20_000
    argv = [sys.executable, "-c", OFTEN, "run", *SIM, "--num-prompts", "400",
            "--request-rate", "50", "--output-len", "40", "--no-timeline", "--out", str(tmp_path)]
    proc = subprocess.run(argv, env={**os.environ, "BATCHSIM_HOME": str(batchsim_home)},
                          capture_output=True, check=False, text=True, timeout=GUARD_S,
                          preexec_fn=_file_limit(limit))
    assert proc.returncode == 1 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    last = proc.stderr.strip().splitlines()[-1]
    assert "cannot write" in last and "File too large" in last, proc.stderr[-3000:]
    (run_dir,) = tmp_path.iterdir()
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["interrupted"] and "File too large" in summary["interrupt_reason"]
    for name in (run_files.STEPS, run_files.REQUESTS):
        text = (run_dir / name).read_text()
        assert len(text) <= limit and (not text or text.endswith("\n"))
        assert all(json.loads(line) for line in text.splitlines())
    assert summary["num_plans"] > len((run_dir / run_files.STEPS).read_text().splitlines())


def _writer(tmp_path: Path) -> tuple[record_process.WriterProcess, dict]:
    files = {n: (tmp_path / n).open("wb", buffering=0) for n in (run_files.STEPS,
                                                                  run_files.REQUESTS)}
    return record_process.WriterProcess(tmp_path, files), files


def test_a_writer_that_does_not_answer_in_time_is_killed_and_said_so(tmp_path):
    writer, _ = _writer(tmp_path)
    os.kill(writer._child.pid, signal.SIGSTOP)
    writer.finish(wait_s=0.5)
    assert writer.written is None and writer._child.returncode == -signal.SIGKILL
    assert str(writer.error).endswith("the records' writer process did not answer in 0.5 s")


def test_a_writer_that_dies_is_a_write_error_saying_how(tmp_path):
    writer, _ = _writer(tmp_path)
    os.kill(writer._child.pid, signal.SIGKILL)
    writer.finish()
    assert writer.written is None and writer.lost and str(writer.error) == (
        "the records' writer process was killed (SIGKILL)")


def _one_batch(writer: record_process.WriterProcess, i: int) -> None:
    """A batch of one step sent, written and answered."""
    writer.send(run_files.step_rows_of([step_record(i, float(i), 1, 0)]), [], [])
    deadline = time.monotonic() + 10.0
    while writer.unwritten:
        assert writer._child.poll() is None, f"the writer ended: {writer.error}"
        assert time.monotonic() < deadline, "no answer in 10 s"
        time.sleep(0.005)


def test_a_service_stop_signal_leaves_the_writer_to_end_at_its_pipe_end(tmp_path):
    """SIGTERM and SIGHUP to the whole service (systemd stop, pkill): the run's process answers
    them and ends the records; its writer writes on until the pipe's end."""
    writer, _ = _writer(tmp_path)
    _one_batch(writer, 0)  # the writer is up: its signals set
    for number in (signal.SIGTERM, signal.SIGHUP):
        os.kill(writer._child.pid, number)
    _one_batch(writer, 1)
    writer.finish()
    assert writer.error is None and writer._child.returncode == 0
    assert (tmp_path / run_files.STEPS).read_text().count("\n") == 2


def test_a_writer_with_much_to_say_on_stderr_is_not_blocked_and_its_last_line_kept(
        tmp_path, monkeypatch):
    """Over a pipe's 64 KiB on stderr: the child would block on it until finish's kill."""
    monkeypatch.setattr(record_process, "_START_CHILD", (
        "import sys; sys.stderr.write('warning\\n' * 30000 + 'the last line\\n'); sys.exit(3)"))
    writer, _ = _writer(tmp_path)
    writer.finish(wait_s=5.0)
    assert str(writer.error) == (
        "the records' writer process exited 3: the last line")


def test_a_message_the_writer_cannot_read_is_a_write_error(tmp_path):
    writer, _ = _writer(tmp_path)
    writer._queue.put(b"not a pickle of records")  # as send() would put a bad message
    writer.finish()
    assert writer.written is not None and writer.error is not None
    assert "the records' writer process could not read a message" in str(writer.error)
