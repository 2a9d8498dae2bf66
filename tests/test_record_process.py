"""The run's records written by a writer process (record_process.py): byte-identical to the
records written in the run's own process, written in the run's process where no writer process
can start, and kept when the run's process is killed while the writer lags behind."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from batchsim.server.engine.runner import run_workload
from batchsim.server.engine.session import open_session
from batchsim.server.results import record_process, run_files

from tests.cli_calls import SIM
from tests.sim_records import sim_config

GUARD_S = 120.0


def _files(run_dir: Path) -> tuple[bytes, bytes]:
    return tuple((run_dir / n).read_bytes() for n in (run_files.STEPS, run_files.REQUESTS))


def _run(out: Path) -> Path:
    session = open_session(sim_config())
    return run_workload(session, session.config.workload, out_dir=out, label="t",
                        timeline=False).run_dir


def test_the_writer_process_writes_the_records_here_written_where_none_starts(tmp_path,
                                                                              monkeypatch):
    """A run's records come from the writer process; where none can start (its program gone:
    sys.executable empty), the run writes the same bytes itself."""
    started = []
    start = record_process.WriterProcess.__init__

    def noted(self, *args):
        start(self, *args)
        started.append(self._child.pid)

    monkeypatch.setattr(record_process.WriterProcess, "__init__", noted)
    by_child = _files(_run(tmp_path / "child"))
    assert len(started) == 1
    monkeypatch.setattr(sys, "executable", "")
    here = _files(_run(tmp_path / "here"))
    assert len(started) == 1 and by_child == here and all(by_child)


def _writer_of(pid: int) -> int | None:
    """The pid of `pid`'s child running record_process, if one runs."""
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
            command = (entry / "cmdline").read_bytes()
        except OSError:
            continue
        if int(stat.rsplit(")", 1)[1].split()[1]) == pid and b"record_process" in command:
            return int(entry.name)
    return None


def _written_bytes(pid: int) -> int:
    """Bytes `pid` passed to write(): its records sent down the pipe among them."""
    io = dict(line.split(": ") for line in Path(f"/proc/{pid}/io").read_text().splitlines())
    return int(io["wchar"])


def _wait(until, what: str) -> object:
    deadline = time.monotonic() + GUARD_S
    while not (value := until()):
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)
    return value


def _gone(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return True
    return state in ("Z", "X")


def test_a_killed_run_leaves_every_record_it_sent_to_a_lagging_writer(tmp_path, batchsim_home):
    """SIGKILL of the run's process while its writer process is stopped (it has written nothing):
    once the writer goes on, it writes every record it was sent, the same bytes as a run that
    was not killed (a run written in its own process leaves only what it wrote before)."""
    argv = [sys.executable, "-m", "batchsim.scripts.cli", "run", *SIM, "--num-prompts", "20",
            "--request-rate", "20", "--output-len", "40", "--seed", "5", "--no-timeline"]
    env = {**os.environ, "BATCHSIM_HOME": str(batchsim_home)}
    whole = subprocess.run([*argv, "--out", str(tmp_path / "whole")], env=env, check=True,
                           capture_output=True, timeout=GUARD_S)
    assert whole.returncode == 0
    (expected,) = (tmp_path / "whole").iterdir()
    run = subprocess.Popen([*argv, "--out", str(tmp_path / "killed")], env=env,
                           stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        writer = _wait(lambda: _writer_of(run.pid), "the writer process")
        os.kill(writer, signal.SIGSTOP)
        seen = [_written_bytes(run.pid), time.monotonic()]

        def settled() -> bool:  # every record sent: the run waits for its writer's answer
            now = _written_bytes(run.pid)
            if now != seen[0]:
                seen[:] = [now, time.monotonic()]
            return time.monotonic() - seen[1] > 1.5

        _wait(settled, "the run to send its records")
        (run_dir,) = (tmp_path / "killed").iterdir()
        assert _files(run_dir) == (b"", b"")  # nothing written yet: the writer is stopped
        run.kill()
        run.wait(GUARD_S)
        os.kill(writer, signal.SIGCONT)
        _wait(lambda: _gone(writer), "the writer process to finish")
    finally:
        run.kill()
        run.wait(GUARD_S)
    assert _files(run_dir) == _files(expected) and all(_files(run_dir))
