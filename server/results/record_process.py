"""A run's records encoded and written on another core: a writer process, started with the run,
is sent each flush's records (step rows, request values with their token runs, the new step end
times) through a pipe and writes them with a RecordWriter, as the run's own process would. A
killed run leaves the records it sent: the child reads to the end of the pipe, writes, exits."""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import fcntl
import operator
import os
import pickle
import queue
import signal
import subprocess
import sys
import threading
from collections.abc import Sequence
from pathlib import Path
from typing import BinaryIO

from batchsim.server.platform.child import start_code
from batchsim.server.results.json_lines import run_items
from batchsim.server.results.record_writer import (
    REQUESTS,
    STEPS,
    Entry,
    RecordWriter,
    WriteFailed,
)
from batchsim.server.results.records import RequestRecord

# A request's values less its token times (sent with its token runs instead), in RequestRecord's
# field order: the times go back in at TIMES_AT.
_FIELDS = tuple(f.name for f in dataclasses.fields(RequestRecord))
TIMES_AT = _FIELDS.index("token_times_s")
REQUEST_VALUES = operator.attrgetter(*(n for n in _FIELDS if n != "token_times_s"))
PIPE_BYTES = 1 << 20  # the pipe to the writer (Linux's default limit for a user: 1 MiB)
FINISH_WAIT_S = 120.0  # close()'s wait for the child's last answer (its backlog under load)
_PROTOCOL = pickle.HIGHEST_PROTOCOL
_START_CHILD = start_code(__name__)


def batch_message(step_rows: list[tuple], requests: Sequence[Entry],
                  new_ends: Sequence[float]) -> bytes:
    """One flush's records as the writer process reads them."""
    sent = [(REQUEST_VALUES(r), runs, None if runs is not None else r.token_times_s)
            for r, runs in requests]
    return pickle.dumps((step_rows, sent, new_ends), protocol=_PROTOCOL)


class WriterProcess:
    """The main side: the child started on the files' descriptors (OSError if it cannot start),
    `send` queues a message that a thread writes (a slow child never blocks the run's loop), a
    thread reads the answers: `error`, the first failed write (seen a flush or more after it
    happened), and at `finish` the written requests' ids and line lengths."""

    def __init__(self, run_dir: Path, files: dict[str, BinaryIO]) -> None:
        fds = [files[name].fileno() for name in (STEPS, REQUESTS)]
        # Its own session: Ctrl-C at the terminal stops the run, which then sends its last records.
        self._child = subprocess.Popen(
            [sys.executable or "", "-c", _START_CHILD, str(run_dir), *map(str, fds)],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
            pass_fds=fds, start_new_session=True)
        if hasattr(fcntl, "F_SETPIPE_SZ"):  # Linux: a lagging writer's backlog waits in the pipe
            with contextlib.suppress(OSError):  # (a killed run's queue is lost), up to the limit
                fcntl.fcntl(self._child.stdin.fileno(), fcntl.F_SETPIPE_SZ, PIPE_BYTES)
        self.run_dir = run_dir
        self.error: WriteFailed | None = None
        self.written: tuple[list[int], list[int]] | None = None  # (ids, line bytes): finished
        self._queue: queue.SimpleQueue[bytes | None] = queue.SimpleQueue()
        self._threads = [threading.Thread(target=target, daemon=True)
                         for target in (self._send_all, self._read_all)]
        for thread in self._threads:
            thread.start()

    def send(self, message: bytes) -> None:
        self._queue.put(message)

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
        while True:
            try:
                kind, value = pickle.load(out)  # the answers of the process this one started
            except (EOFError, pickle.UnpicklingError, OSError, ValueError):
                return
            if kind == "failed":
                self.error = self.error or value
            else:
                self.written = value

    def finish(self, wait_s: float = FINISH_WAIT_S) -> None:
        """No more records: wait for the child's last answer (at most `wait_s`; then it is
        killed). A child that ended without answering sets `error`."""
        self._queue.put(None)
        self._threads[1].join(wait_s)
        child = self._child
        late = child.poll() is None and self._threads[1].is_alive()
        if late:
            child.kill()
        child.wait()
        for thread in self._threads:
            thread.join()
        err = child.stderr.read() if child.stderr else b""
        for stream in (child.stdout, child.stderr):
            if stream is not None:
                stream.close()
        if self.written is None and self.error is None:
            last = (err.decode(errors="replace").strip().splitlines() or ["no message"])[-1]
            why = (f"the records' writer process did not answer in {wait_s:g} s" if late else
                   f"the records' writer process exited {child.returncode}: {last}")
            self.error = WriteFailed(self.run_dir, OSError(errno.EIO, why))


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


def _serve(run_dir: str, steps_fd: str, requests_fd: str) -> int:
    """The child: write each message read from stdin until its end, then answer the written
    requests' ids and line lengths. A message it cannot read (cut short: the run was killed, no
    one hears the answer) ends the writing: answered as a failed write."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the run ends the records: its pipe's end
    files = {STEPS: os.fdopen(int(steps_fd), "wb", buffering=0),
             REQUESTS: os.fdopen(int(requests_fd), "wb", buffering=0)}
    writer = _ChildWriter(Path(run_dir), files, sys.stdout.buffer)
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
        writer.write_batch(step_rows, [
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
