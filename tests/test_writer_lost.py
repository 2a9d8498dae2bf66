"""A RecordStream's writer process lost mid-run (killed from outside, or hung at close): the
run stops at the next flush with a write error saying how the writer ended, and at close the
batches it never wrote are written in the run's own process, each file cut back to what the
writer answered first (no torn line). Also: when the writer process starts (8664ed6)."""

from __future__ import annotations

import os
import signal
import threading
import time
from pathlib import Path

import pytest
from batchsim.server.distributed import rank
from batchsim.server.results import record_process, run_files

from tests.sim_records import add_to, counting_starts, request_record, the_files, wait_until


def _closed(n: int) -> list:
    """The run's records at close: `n` finished, and an unfinished one never streamed."""
    return [request_record(i, float(i), float(i)) for i in range(n)] + [
        request_record(n, float(n), None)]


def _in_process(run_dir: Path, n: int) -> tuple[bytes, bytes]:
    """The same records written in the run's own process."""
    run_dir.mkdir()
    stream = run_files.RecordStream(run_dir)
    for i in range(n):
        add_to(stream, i)
    stream.close(_closed(n))
    return the_files(run_dir)


def _with_writer(run_dir: Path, errors: list) -> tuple[run_files.RecordStream,
                                                         record_process.WriterProcess]:
    """A stream whose writer process has written (and answered) its first 3 batches."""
    run_dir.mkdir()
    stream = run_files.RecordStream(run_dir, on_error=errors.append, writer_process=True)
    for i in range(3):
        add_to(stream, i)
    child = stream._child
    assert child is not None
    wait_until(lambda: all(f.count(b"\n") == 3 for f in the_files(run_dir)),
               "the writer's writes")
    wait_until(lambda: not getattr(child, "unwritten", ()), "the writer's answers")
    return stream, child


def test_a_writer_killed_mid_run_stops_it_at_the_next_flush_and_nothing_is_lost(tmp_path,
                                                                                monkeypatch):
    monkeypatch.setattr(run_files, "FLUSH_EVERY_S", 0.0)
    errors: list[OSError] = []
    stream, child = _with_writer(tmp_path / "run", errors)
    os.kill(child._child.pid, signal.SIGKILL)
    wait_until(lambda: child._child.poll() is not None, "the writer's end")
    wait_until(lambda: child.error is not None, "the end seen", wait_s=2.0)
    with (tmp_path / "run" / run_files.REQUESTS).open("ab") as f:
        f.write(b'{"request_id": 3, "sta')  # as a writer killed mid-write leaves it
    add_to(stream, 3)
    assert [str(e) for e in errors] == ["the records' writer process was killed (SIGKILL)"]
    for i in range(4, 8):  # the run's last steps while it stops
        add_to(stream, i)
    stream.close(_closed(8))
    assert len(errors) == 1 and stream.error is errors[0]
    assert stream.error.kept == (  # every batch written here: the run's last line says so
        f"every record until then is in {tmp_path / 'run'}, the writer's unwritten ones written "
        "by the run")
    assert the_files(tmp_path / "run") == _in_process(tmp_path / "here", 8)


@pytest.mark.parametrize("more, said", [
    (3, "its last 3 batches were written by the run"),
    (1, "its last batch was written by the run"),
    (0, "it had written every batch it was sent")])  # it read "its last 0 batches were ..."
def test_a_writer_that_does_not_answer_at_close_is_killed_and_its_batches_written_here(
        tmp_path, monkeypatch, caplog, more, said):
    """The run's loop had ended and every record is written here: one warning, no error (the
    run is not failed nor interrupted), saying what the writer left (`more` batches sent after
    it stopped answering)."""
    monkeypatch.setattr(run_files, "FLUSH_EVERY_S", 0.0)
    monkeypatch.setattr(record_process, "FINISH_WAIT_S", 0.5)
    errors: list[OSError] = []
    stream, child = _with_writer(tmp_path / "run", errors)
    os.kill(child._child.pid, signal.SIGSTOP)
    backstop = threading.Timer(5.0, os.kill, (child._child.pid, signal.SIGKILL))
    backstop.start()  # a close that waits longer than it should fails in seconds, not minutes
    for i in range(3, 3 + more):
        add_to(stream, i)
    try:
        stream.close(_closed(3 + more))
    finally:
        backstop.cancel()
    assert errors == [] and stream.error is None
    assert [r.getMessage() for r in caplog.records if r.name == "batchsim"] == [
        f"{tmp_path / 'run'}: the records' writer process did not answer in 0.5 s; {said}"]
    assert the_files(tmp_path / "run") == _in_process(tmp_path / "here", 3 + more)


def test_the_close_wait_for_the_writer_ends_before_a_rank_exits_unkept(tmp_path, monkeypatch):
    """A watchdog's abandon closes the stream; rank 0 exits unkept KEEP_RECORDS_S after it
    began keeping records: the writer's answer (or its kill) within half the time left, so the
    rest written here, the rewrite and the summary end first."""
    assert record_process.FINISH_WAIT_S <= rank.KEEP_RECORDS_S / 2
    monkeypatch.setattr(record_process, "keep_until_s", None)
    monkeypatch.setenv(rank.STATUS_DIR_ENV, str(tmp_path))
    status = rank._Status(0)
    rank._start_keeping(status)
    assert record_process.keep_until_s == status.keep_until
    monkeypatch.setattr(record_process, "keep_until_s", time.monotonic() + 1.0)  # 1 s left
    writer = record_process.WriterProcess(tmp_path, {
        n: (tmp_path / n).open("wb", buffering=0) for n in (run_files.STEPS, run_files.REQUESTS)})
    os.kill(writer._child.pid, signal.SIGSTOP)
    backstop = threading.Timer(3.0, os.kill, (writer._child.pid, signal.SIGKILL))
    backstop.start()  # a wait of FINISH_WAIT_S fails in seconds
    t0 = time.monotonic()
    try:
        writer.finish()
    finally:
        backstop.cancel()
    assert time.monotonic() - t0 < 1.0 and "did not answer in 0." in str(writer.error)


def test_a_run_that_ends_before_its_first_due_flush_starts_no_writer(tmp_path, monkeypatch):
    monkeypatch.setattr(run_files, "FLUSH_EVERY_S", 60.0)
    started = counting_starts(monkeypatch)
    stream = run_files.RecordStream(tmp_path, writer_process=True)
    add_to(stream, 0)
    stream.close([request_record(0, 0.0, 0.0)])
    assert started == [] and all(the_files(tmp_path))


def test_a_stream_that_flushed_here_first_keeps_writing_here(tmp_path, monkeypatch):
    """A flush before the first due one (the post-loop flush, a watchdog's) writes in-process,
    and so does every later one: one writer for each file."""
    monkeypatch.setattr(run_files, "FLUSH_EVERY_S", 60.0)
    started = counting_starts(monkeypatch)
    stream = run_files.RecordStream(tmp_path, writer_process=True)
    add_to(stream, 0)
    stream.flush()
    monkeypatch.setattr(run_files, "FLUSH_EVERY_S", 0.0)
    stream._due_s = 0.0
    add_to(stream, 1)
    assert started == [] and stream._child is None
    assert (tmp_path / run_files.STEPS).read_bytes().count(b"\n") == 2
    stream.close([request_record(i, float(i), float(i)) for i in range(2)])
