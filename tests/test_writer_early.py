"""A simulated run's records writer started at the run's start (RecordStream.start_writer), not at
its first due flush: its import overlaps the loop, the first due flush sends it the records, and
a run that ends before that flush never waits for it (it is killed unused; written here)."""

from __future__ import annotations

import os
import signal
import threading
import time

import pytest
from batchsim.server.engine.runner import run_workload
from batchsim.server.engine.session import open_session
from batchsim.server.results import record_process, run_files

from tests.sim_records import (
    add_to,
    counting_starts,
    request_record,
    sim_config,
    the_files,
    wait_until,
)

SLOW_START = "import time; time.sleep(30); "  # a writer process that takes long to start


def test_a_simulated_run_starts_its_writer_before_its_first_due_flush(tmp_path, monkeypatch):
    """sim_config(n=30) runs in well under FLUSH_EVERY_S (60 s here): no due flush, yet a writer
    started (and, never sent a record, killed unused: the records are written here, as a stream's
    without one; a writer that was sent them would exit 0)."""
    monkeypatch.setattr(run_files, "FLUSH_EVERY_S", 60.0)
    monkeypatch.setattr(run_files, "EARLY_WRITER_FIRST_FLUSH_S", 60.0)
    started = counting_starts(monkeypatch)
    session = open_session(sim_config(n=30))
    out = run_workload(session, session.config.workload, out_dir=tmp_path, label="t")
    assert len(started) == 1 and started[0]._child.returncode == -signal.SIGKILL
    assert out.summary["completed"] == 30 and out.records_error is None
    assert the_files(out.run_dir)[1].count(b"\n") == 30


def _sent_to_the_writer(stream: run_files.RecordStream, started: list, tmp_path) -> None:
    """Two steps, the second's flush due: the writer started is the one sent them, and wrote."""
    add_to(stream, 0)
    stream._due_s = 0.0  # the period over: the next step's flush is due
    add_to(stream, 1)
    assert len(started) == 1 and stream._child is started[0]
    stream.close([request_record(i, float(i), float(i)) for i in range(2)])
    assert started[0]._child.returncode == 0  # it wrote them and exited
    assert [f.count(b"\n") for f in the_files(tmp_path)] == [2, 2]


def test_the_early_writer_is_the_one_the_first_due_flush_sends_to(tmp_path, monkeypatch):
    monkeypatch.setattr(run_files, "FLUSH_EVERY_S", 60.0)
    started = counting_starts(monkeypatch)
    stream = run_files.RecordStream(tmp_path, writer_process=True)
    stream.start_writer()
    _sent_to_the_writer(stream, started, tmp_path)


def test_a_run_that_ends_before_its_first_due_flush_never_waits_for_the_early_writer(
        tmp_path, monkeypatch):
    monkeypatch.setattr(run_files, "FLUSH_EVERY_S", 60.0)
    monkeypatch.setattr(record_process, "_START_CHILD", SLOW_START + record_process._START_CHILD)
    started = counting_starts(monkeypatch)
    stream = run_files.RecordStream(tmp_path, writer_process=True)
    stream.start_writer()
    add_to(stream, 0)
    t0 = time.monotonic()
    stream.close([request_record(0, 0.0, 0.0)])
    assert time.monotonic() - t0 < 5.0  # not the writer's 30 s start
    assert started[0]._child.returncode is not None and stream.error is None
    assert [f.count(b"\n") for f in the_files(tmp_path)] == [1, 1]


def test_a_writer_process_is_sent_a_batch_every_writer_period_after_its_first(tmp_path,
                                                                               monkeypatch):
    """FLUSH_EVERY_S (60 s here) until the first due flush; from then on, WRITER_FLUSH_EVERY_S
    (0 here: each step) between the batches the writer process is sent."""
    monkeypatch.setattr(run_files, "FLUSH_EVERY_S", 60.0)
    monkeypatch.setattr(run_files, "WRITER_FLUSH_EVERY_S", 0.0)
    stream = run_files.RecordStream(tmp_path, writer_process=True)
    add_to(stream, 0)
    assert stream._child is None  # not due yet
    stream._due_s = 0.0
    for i in range(1, 4):
        add_to(stream, i)
    wait_until(lambda: the_files(tmp_path)[0].count(b"\n") == 4, "each step written")
    stream.close([request_record(i, float(i), float(i)) for i in range(4)])


def test_a_failed_set_up_ends_the_early_writer_and_closes_the_files(tmp_path, monkeypatch):
    """The writer starts before the run's set-up (_Run): a set-up that raises (here the
    scheduler's) leaves no writer process running and no file of the run open."""
    started = counting_starts(monkeypatch)
    session = open_session(sim_config(n=30))

    def no_scheduler():
        raise RuntimeError("no scheduler")

    monkeypatch.setattr(session, "new_scheduler", no_scheduler)
    with pytest.raises(RuntimeError, match="no scheduler"):
        run_workload(session, session.config.workload, out_dir=tmp_path, label="t")
    assert len(started) == 1 and started[0]._child.returncode == -signal.SIGKILL
    run_dir = next(tmp_path.iterdir())
    opened = {os.path.realpath(f"/proc/self/fd/{fd}") for fd in os.listdir("/proc/self/fd")
              if os.path.exists(f"/proc/self/fd/{fd}")}
    assert not opened & {str((run_dir / n).resolve()) for n in ("steps.jsonl", "requests.jsonl")}


def test_a_flush_from_another_thread_as_the_writer_starts_keeps_the_writer(tmp_path, monkeypatch):
    """Another thread's flush (a rank's ring log, a watchdog's) between the first due flush's
    start of the writer and that flush: the writer is due already, sent the records, not ended
    as an unused one (its records then written here)."""
    monkeypatch.setattr(run_files, "FLUSH_EVERY_S", 60.0)
    started = counting_starts(monkeypatch)
    stream = run_files.RecordStream(tmp_path, writer_process=True)
    start = stream.start_writer

    def start_then_flush_elsewhere(*args, **kwargs):
        start(*args, **kwargs)
        other = threading.Thread(target=stream.flush)
        other.start()
        other.join()

    monkeypatch.setattr(stream, "start_writer", start_then_flush_elsewhere)
    _sent_to_the_writer(stream, started, tmp_path)


def test_an_early_writer_is_sent_its_first_batch_sooner_than_a_flush_period(tmp_path,
                                                                           monkeypatch):
    """Started at the run's start, the writer's first batch is due EARLY_WRITER_FIRST_FLUSH_S in
    (not FLUSH_EVERY_S: half the simulated hour at once); a stream without one keeps the period."""
    monkeypatch.setattr(run_files, "FLUSH_EVERY_S", 60.0)
    monkeypatch.setattr(run_files, "EARLY_WRITER_FIRST_FLUSH_S", 0.05)
    started = counting_starts(monkeypatch)
    stream = run_files.RecordStream(tmp_path, writer_process=True)
    before = time.monotonic()
    stream.start_writer()
    assert stream._due_s <= before + 0.05 + 1.0 < before + 60.0
    add_to(stream, 0)
    wait_until(lambda: time.monotonic() >= stream._due_s, "the first batch due")
    add_to(stream, 1)  # its flush is due: sent to the writer started early
    assert len(started) == 1 and stream._child is started[0] and stream._child_due
    stream.close([request_record(i, float(i), float(i)) for i in range(2)])
    assert [f.count(b"\n") for f in the_files(tmp_path)] == [2, 2]
    (tmp_path / "x").mkdir()
    plain = run_files.RecordStream(tmp_path / "x", writer_process=True)
    assert plain._due_s > time.monotonic() + 30.0  # no writer started early: the period
    plain.close([])
