"""A run's records encoded and written on another core: a writer process, started at the run's
first due flush (run_files.RecordStream), is sent each flush's records (step rows, request
values with their token runs, the new step end times) through a pipe and writes them with a
RecordWriter, as the run's own process would, answering each batch it wrote. A killed run leaves
the records it sent: the child reads to the end of the pipe, writes, exits. A killed child
leaves the run its unanswered batches to write."""

from __future__ import annotations

import collections
import contextlib
import errno
import fcntl
import operator
import os
import pickle
import queue
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import BinaryIO

from batchsim.server.platform.child import how_it_ended, start_code
from batchsim.server.results.json_lines import run_items
from batchsim.server.results.record_writer import (
    REQUESTS,
    STEPS,
    Entry,
    RecordWriter,
    WriteFailed,
    writer_lost,
)
from batchsim.server.results.records import RequestRecord, field_names

# A request's values less its token times (sent with its token runs instead), in RequestRecord's
# field order: the times go back in at TIMES_AT.
_FIELDS = field_names(RequestRecord)
TIMES_AT = _FIELDS.index("token_times_s")
REQUEST_VALUES = operator.attrgetter(*(n for n in _FIELDS if n != "token_times_s"))
PIPE_BYTES = 1 << 20  # the pipe to the writer (Linux's default limit for a user: 1 MiB)
# close()'s wait for the child's last answer (its backlog under load; then it is killed and the
# run writes what it did not): at most half a rank's KEEP_RECORDS_S (30 s), and at most half the
# time left before `keep_until_s` once a rank keeps its records (distributed/rank.py sets it), so
# that the rest (the batches written here, the rewrite, the summary) ends before the rank exits
# unkept (test_writer_lost).
FINISH_WAIT_S = 15.0
keep_until_s: float | None = None  # time.monotonic(): when this process stops keeping records
# The child's first bytes on stdout, its answers after: what Python printed there before them (a
# sitecustomize's banner) is skipped.
START_MARK = b"\nbatchsim records' writer\n"
STDERR_TAIL_BYTES = 4096  # the child's stderr read for its last line (a file: never fills)
_PROTOCOL = pickle.HIGHEST_PROTOCOL
_awaited: dict[WriterProcess, float] = {}  # writers finish() awaits now: since (time.monotonic)
_START_CHILD = start_code(__name__)


def batch_message(step_rows: list[tuple], requests: Sequence[Entry],
                  new_ends: Sequence[float]) -> bytes:
    """One flush's records as the writer process reads them."""
    sent = [(REQUEST_VALUES(r), runs, None if runs is not None else r.token_times_s)
            for r, runs in requests]
    return pickle.dumps((step_rows, sent, new_ends), protocol=_PROTOCOL)


class WriterProcess:
    """The main side: the child started on the files' descriptors (OSError if it cannot start),
    `send` queues a batch that a thread writes to it (a slow child never blocks the run's loop),
    a thread reads the answers: each batch written (`written_ids`, `line_bytes`, `file_bytes`;
    the batch leaves `unwritten`), `error`, the first failed write (seen a flush or more after it
    happened), and at `finish` the end (`written`). A child that ends without its last answer
    (killed, or late at finish) sets `how_ended`, `error` (saying it) and, unless a failed write
    came first, `lost`: the files' whole records are then `file_bytes`, and `unwritten` holds the
    batches the run is to write itself."""

    def __init__(self, run_dir: Path, files: dict[str, BinaryIO]) -> None:
        fds = [files[name].fileno() for name in (STEPS, REQUESTS)]
        self._stderr = tempfile.TemporaryFile()  # noqa: SIM115 -- closed by finish()
        # Its own session: Ctrl-C at the terminal stops the run, which then sends its last records.
        self._child = subprocess.Popen(
            [sys.executable or "", "-c", _START_CHILD, str(run_dir), *map(str, fds)],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self._stderr,
            pass_fds=fds, start_new_session=True)
        if hasattr(fcntl, "F_SETPIPE_SZ"):  # Linux: a lagging writer's backlog waits in the pipe
            with contextlib.suppress(OSError):  # (a killed run's queue is lost), up to the limit
                fcntl.fcntl(self._child.stdin.fileno(), fcntl.F_SETPIPE_SZ, PIPE_BYTES)
        self.run_dir = run_dir
        self.error: WriteFailed | None = None
        self.written: tuple[list[int], list[int]] | None = None  # (ids, line bytes): finished
        self.written_ids: list[int] = []  # requests.jsonl's records so far, in the file's order
        self.line_bytes: list[int] = []
        self.file_bytes = dict.fromkeys((STEPS, REQUESTS), 0)  # whole records in each file
        self.how_ended = ""  # a child ended without its last answer: killed, or late
        self.unwritten: collections.deque[tuple[list[tuple], Sequence[Entry]]] = (
            collections.deque())  # sent, not yet answered
        self.lost = False
        self._heard = False  # an answer came: it runs as the writer
        self._late_s: float | None = None  # finish's wait, when the child did not answer in it
        self._queue: queue.SimpleQueue[bytes | None] = queue.SimpleQueue()
        self._threads = [threading.Thread(target=target, daemon=True)
                         for target in (self._send_all, self._read_all)]
        for thread in self._threads:
            thread.start()

    def send(self, step_rows: list[tuple], requests: Sequence[Entry],
             new_ends: Sequence[float]) -> None:
        self.unwritten.append((step_rows, requests))  # the run's to write if the child is lost
        if not self.lost:
            self._queue.put(batch_message(step_rows, requests, new_ends))

    def _send_all(self) -> None:
        stdin = self._child.stdin
        assert stdin is not None
        with contextlib.suppress(OSError, ValueError):  # the child gone: _read_all says so
            while (message := self._queue.get()) is not None:
                stdin.write(message)
                stdin.flush()
        with contextlib.suppress(OSError):
            stdin.close()  # the end: the child writes what it has and answers

    def _read_all(self) -> None:
        out = self._child.stdout
        assert out is not None
        listening = _past_mark(out)  # (what Python printed there before: skipped)
        while listening:
            try:
                kind, value = pickle.load(out)  # the answers of the process this one started
            except (EOFError, pickle.UnpicklingError, OSError, ValueError):
                break
            self._heard = True
            if kind == "wrote":
                ids, lengths, self.file_bytes = value
                self.written_ids += ids
                self.line_bytes += lengths
                self.unwritten.popleft()
            elif kind == "failed":
                self.error = self.error or value
            else:
                self.written = value
                return
        self.lost = self.error is None  # before `error`: the run reads them in that order
        self.how_ended = f"the records' writer process {self._how_it_ended()}"
        self.error = self.error or writer_lost(self.run_dir, self.how_ended)

    def _how_it_ended(self) -> str:
        if self._late_s is not None:
            return f"did not answer in {self._late_s:g} s"
        code = self._child.wait()  # its answers' end: it is gone, or going
        self._stderr.seek(0, os.SEEK_END)
        self._stderr.seek(max(0, self._stderr.tell() - STDERR_TAIL_BYTES))
        return how_it_ended(code, self._stderr.read())

    def end_unused(self) -> None:
        """Killed before it was sent anything (the run writes its files): gone at once."""
        self._child.kill()
        self.finish()

    def never_ran(self) -> bool:
        """Ended without a signal before any answer: sys.executable no Python that runs batchsim
        (a frozen app's, a wrapper's), or a writer that failed (exit 1) before its first answer;
        either way the run writes the records."""
        return (self.error is not None and self.lost and not self._heard
                and (self._child.returncode or 0) >= 0)

    def finish(self, wait_s: float | None = None) -> None:
        """No more records: wait for the child's last answer (at most `wait_s`, by default
        close_wait_s(); then it is killed). A child that ended without answering sets `error`."""
        wait_s = close_wait_s() if wait_s is None else wait_s
        self._queue.put(None)
        _awaited[self] = time.monotonic()
        self._threads[1].join(wait_s)
        _awaited.pop(self, None)
        if self._threads[1].is_alive():
            self._give_up(wait_s)
        self._child.wait()
        for thread in self._threads:
            thread.join()
        for stream in (self._child.stdout, self._stderr):
            if stream is not None:
                stream.close()

    def _give_up(self, late_s: float) -> None:
        """The child killed, not answered in `late_s`: its reader then says it was late."""
        self._late_s = late_s  # before the kill: the reader says so
        self._child.kill()


def _past_mark(out: BinaryIO) -> bool:
    """`out` read past START_MARK (False: it ended first)."""
    seen = b""
    while seen != START_MARK:
        byte = out.read(1)
        if not byte:
            return False
        seen = (seen + byte)[-len(START_MARK):]
    return True


def stop_waiting() -> None:
    """A signal while a run's close awaits its writer's last answer (a signal handler's: a
    second Ctrl-C, a SIGTERM): each writer awaited is killed now, and the run writes the batches
    it did not answer."""
    for writer, since_s in list(_awaited.items()):
        writer._give_up(round(time.monotonic() - since_s, 1))


def close_wait_s() -> float:
    """finish()'s wait: FINISH_WAIT_S, or half the time left to keep records if less."""
    if keep_until_s is None:
        return FINISH_WAIT_S
    return round(min(FINISH_WAIT_S, max(0.0, keep_until_s - time.monotonic()) / 2), 3)


def _record(values: tuple, times: Sequence[float]) -> RequestRecord:
    return RequestRecord(*values[:TIMES_AT], tuple(times), *values[TIMES_AT:])


class _ChildWriter(RecordWriter):
    """The child's writer: a failed write is answered at once."""

    def __init__(self, run_dir: Path, files: dict[str, BinaryIO], answers: BinaryIO) -> None:
        super().__init__(run_dir, files)
        self.answers = answers

    def answer(self, kind: str, value: object) -> None:
        with contextlib.suppress(OSError):  # the run's process is gone: the files still count
            pickle.dump((kind, value), self.answers, protocol=_PROTOCOL)
            self.answers.flush()

    def _failed(self, error: WriteFailed) -> None:
        super()._failed(error)
        self.answer("failed", error)

    def write_answered(self, step_rows: list[tuple], requests: list[Entry]) -> None:
        """A batch written and, unless it failed, answered: its requests' ids and line lengths,
        and the files' sizes after it."""
        before = len(self._written_ids)
        self.write_batch(step_rows, requests)
        if self.error is None:
            self.answer("wrote", (self._written_ids[before:], self._line_bytes[before:],
                                  dict(self._sizes)))


def _serve(run_dir: str, steps_fd: str, requests_fd: str) -> int:
    """The child: write each message read from stdin until its end, then answer the written
    requests' ids and line lengths. A message it cannot read (cut short: the run was killed, no
    one hears the answer) ends the writing: answered as a failed write."""
    files = {STEPS: os.fdopen(int(steps_fd), "wb", buffering=0),
             REQUESTS: os.fdopen(int(requests_fd), "wb", buffering=0)}
    writer = _ChildWriter(Path(run_dir), files, sys.stdout.buffer)
    with contextlib.suppress(OSError):  # the run's process gone: the files still count
        writer.answers.write(START_MARK)
    ends = writer.ends
    while True:
        try:
            step_rows, requests, new_ends = pickle.load(sys.stdin.buffer)  # from its parent
        except EOFError:
            break
        except Exception as exc:  # noqa: BLE001 -- pickle raises many kinds: say which, stop
            writer._failed(WriteFailed(writer.run_dir, OSError(errno.EIO, (
                f"the records' writer process could not read a message ({exc})"))))
            break
        ends += new_ends
        writer.write_answered(step_rows, [
            (_record(values, run_items(ends, runs) if times is None else times), runs)
            for values, runs, times in requests])
    writer.answer("written", writer.written())
    return 0


if __name__ == "__main__":
    code = _serve(*sys.argv[1:4])
    # Answered: gone at once (the run's close waits for this process's end, not for the
    # interpreter's teardown; the files are written: nothing is buffered here).
    sys.stderr.flush()
    os._exit(code)
