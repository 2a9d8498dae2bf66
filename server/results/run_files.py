"""A run directory's records on disk while the run goes: steps and requests appended as they
complete, so an interrupted or killed run leaves what it measured. requests.jsonl goes in arrival
order (the order a finished run has always had) while requests finish within a flush period of
it (a simulated run); else at a clean finish it is rewritten in arrival order, atomically."""

from __future__ import annotations

import collections
import contextlib
import itertools
import json
import logging
import mmap
import os
import re
import secrets
import stat
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any, BinaryIO

from batchsim.configs import file_kind
from batchsim.server.results.json_lines import step_rows_of
from batchsim.server.results.json_text import dumps
from batchsim.server.results.record_writer import (
    REQUESTS,
    STEPS,
    Entry,
    WriteFailed,
)
from batchsim.server.results.records import RequestRecord, StepRecord
from batchsim.server.results.writer_side import WriterSide

CONFIG = "config.yaml"
SUMMARY = "summary.json"
FLUSH_EVERY_S = 0.5  # wall time between writes (a killed run loses those and any still queued)
WRITER_FLUSH_EVERY_S = 0.05  # to a writer process after its first batch: smaller ones cost less
# A writer started at the run's start (start_writer): its first batch this long into the run, not
# FLUSH_EVERY_S. At 0.5 s the simulated hour handed it half its records at once (17,000 steps),
# whose encoding (0.3 s) fell at the loop's end, where the drawing child needs that core.
EARLY_WRITER_FIRST_FLUSH_S = 0.3
WRITE_CHUNK_BYTES = 4 << 20  # requests.jsonl put in arrival order at the end: written in chunks
TEMP_RANDOM_BYTES = 4  # a temp file's random part: `.NAME.` then twice as many hex digits
_in_flush: list[RecordStream] = []  # the main thread's streams mid-flush, innermost last


def when_not_flushing(answer: Callable[[], None]) -> bool:
    """For a signal handler that keeps records (a rank's SIGTERM): if the main thread is in the
    middle of a flush, `answer` runs as that flush ends, and True is returned (the handler returns
    and the flush resumes: every buffered line written once); else False (answer it now). A
    handler runs between two lines of the main thread whichever thread the signal reached, so
    blocking signals in one thread cannot hold it."""
    if threading.current_thread() is threading.main_thread() and _in_flush:
        _in_flush[-1].deferred.append(answer)
        return True
    return False


class RecordStream(WriterSide):
    """steps.jsonl and requests.jsonl of one run, appended. Records wait in memory and are encoded
    and written in batches, each file's batch in one write, at most every FLUSH_EVERY_S
    (WRITER_FLUSH_EVERY_S to a writer process; no fsync: a killed process's writes survive; a
    crashed kernel's need not). The first failed write (any OSError: ENOSPC, EFBIG, EIO) cuts its
    file back to the last whole record, sets `error`, calls `on_error` (the run stops), and the
    stream writes nothing more. `writer_process`: written by a writer process (WriterSide)."""

    def __init__(self, run_dir: Path, on_error: Callable[[WriteFailed], None] | None = None,
                 writer_process: bool = False) -> None:
        files = {}
        for name in (STEPS, REQUESTS):
            try:
                files[name] = (run_dir / name).open("wb", buffering=0)
            except OSError as exc:
                raise WriteFailed(run_dir / name, exc) from None
        super().__init__(run_dir, files, writer_process)
        self._on_error = on_error
        self._steps: list[StepRecord] = []
        self._requests: list[Entry] = []  # to write at the next flush
        # Arrival order, streamed: the recorder appends each request's id as it arrives; a record
        # that finishes before an earlier arrival has left is held (with the time it was held)
        # until that one leaves, but never past a flush period: one held longer is written in
        # completion order, the stream stops holding, and close() rewrites the file in order.
        self.arrivals: collections.deque[int] = collections.deque()
        self._held: dict[int, tuple[Entry, float]] = {}
        self._in_order = True
        self._due_s = time.monotonic() + FLUSH_EVERY_S  # the next flush (time.monotonic)
        # Wall time the run's flushes spent encoding and writing records (perf_counter), taken
        # out of the run's wall time before close: close's own writes and waits are not in it.
        self.writing_s = 0.0
        # A run abandoned from another thread (a rank's watchdog) closes the stream while the
        # run's loop may flush it: one writer at a time, and nothing written once closed.
        self._lock = threading.RLock()
        self.deferred: list[Callable[[], None]] = []  # when_not_flushing: after this flush

    def start_writer(self, due: bool = False) -> None:
        super().start_writer(due)
        if self._child is not None and not due:  # started early: its first batch sooner
            self._due_s = min(self._due_s, time.monotonic() + EARLY_WRITER_FIRST_FLUSH_S)

    def add_step(self, step: StepRecord) -> None:
        self._steps.append(step)
        if time.monotonic() >= self._due_s:
            self._flush_due()

    def add_request(self, record: RequestRecord,
                    token_runs: Sequence[Sequence[int]] | None = None) -> None:
        """`token_runs`: the record's token times as [first, end) runs of indices into the step
        end times the stream follows (follow_ends; None: encoded from the record's own)."""
        entry, arrivals = (record, token_runs), self.arrivals
        if not (arrivals and self._in_order):
            self._requests.append(entry)
        elif arrivals[0] != record.request_id:  # an earlier arrival has not left yet
            self._held[record.request_id] = (entry, time.monotonic())
        else:
            arrivals.popleft()
            self._requests.append(entry)
            held = self._held
            while held and arrivals:  # those it held back (pop: a watchdog's last flush may
                waiting = held.pop(arrivals[0], None)  # take them meanwhile)
                if waiting is None:
                    break
                arrivals.popleft()
                self._requests.append(waiting[0])

    def flush_if_due(self) -> float:
        """A flush if one is due (a flusher's, between steps); the seconds to the next one."""
        if time.monotonic() >= self._due_s:
            self._flush_due()
        return max(0.0, self._due_s - time.monotonic())

    def _flush_due(self) -> None:
        """A flush the period made due: from the first, each is sent to a writer process."""
        self.start_writer(due=True)
        self.flush()

    def flush(self) -> None:
        main = threading.current_thread() is threading.main_thread()
        with self._lock:
            if self._files[STEPS].closed or self in _in_flush:
                return  # closed, or this thread's own flush, interrupted: it writes them
            if main:
                _in_flush.append(self)
            try:
                self._flush()
            finally:
                if main:
                    _in_flush.remove(self)
        answers, self.deferred = self.deferred, []
        for answer in answers:
            answer()

    def _flush(self) -> None:
        t0 = time.perf_counter()
        # Taken before the write (a syscall: the GIL is free), so a record the loop adds
        # meanwhile, while a watchdog's thread flushes, waits for the next flush.
        steps, self._steps = self._steps, []
        now, held = time.monotonic(), self._held
        self._due_s = now + (FLUSH_EVERY_S if self._child is None or not self._child_due else
                             min(FLUSH_EVERY_S, WRITER_FLUSH_EVERY_S))
        if not self._in_order:
            self.arrivals.clear()  # the recorder's, unread
        elif held:
            _, oldest_s = next(iter(held.values()))  # held in completion order: the oldest
            if now - oldest_s >= FLUSH_EVERY_S:
                self._stop_holding()
            else:
                self._due_s = min(self._due_s, oldest_s + FLUSH_EVERY_S)
        requests, self._requests = self._requests, []
        rows = step_rows_of(steps)
        if not self._sent(rows, requests):
            self.write_batch(rows, requests)
        self.writing_s += time.perf_counter() - t0

    def _stop_holding(self) -> None:
        """The held records go with the next write, in completion order, and no more are held."""
        self._requests += [entry for entry, _ in list(self._held.values())]  # list(): atomic
        self._held.clear()
        self._in_order = False

    def _failed(self, error: WriteFailed) -> None:
        self.error = error
        on_error, self._on_error = self._on_error, None  # once: the run stops once
        if on_error is not None:
            on_error(error)

    def close_unfinished(self) -> None:
        """The run failed: what was recorded stays as streamed (held records: after the rest)."""
        with self._lock:
            if self._held:
                self._stop_holding()
            self.flush()
            self._finish_child()
            for f in self._files.values():
                f.close()
            self._due_s = float("inf")  # none due: a flusher waits until cancelled, not spins

    def close(self, records: Sequence[RequestRecord]) -> None:
        """The run is over: `records` are every request in arrival order. requests.jsonl becomes
        exactly those rows in that order; rows already written are copied, not encoded again."""
        self.close_unfinished()
        ids = [r.request_id for r in records]
        if (self.error is not None and not self._writable) or ids == self._written_ids:
            return  # streamed complete and in order, or no room to write them again
        path = self.run_dir / REQUESTS
        try:  # the streamed file stays, in completion order, if this fails
            write_atomically(path, lambda out: self._write_in_order(path, out, records))
        except WriteFailed as exc:
            self._rewrite_failed(exc, ids)

    def _rewrite_failed(self, error: WriteFailed, ids: Sequence[int]) -> None:
        """requests.jsonl's rewrite in the order `ids` failed: a warning where every record is
        in the file already (only its order is not that one), else a failed write (lost)."""
        if sorted(ids) != sorted(self._written_ids):
            self._failed(error)
        else:
            logging.getLogger("batchsim").warning(
                "%s (%s kept whole, in the order written)", error, REQUESTS)

    def _write_in_order(self, path: Path, out: BinaryIO, records: Sequence[RequestRecord]) -> None:
        ends = itertools.accumulate(self._line_bytes)  # request id -> (offset, length) in the file
        spans = {i: (end - n, n) for i, n, end in zip(self._written_ids, self._line_bytes, ends)}
        with path.open("rb") as f:
            written = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) if spans else None
            lines: list[bytes] = []
            size = 0
            for r in records:  # written a few MB at a time: one write per line costs 10x
                span = spans.get(r.request_id)
                if written is None or span is None:
                    lines.append((dumps(r.to_json()) + "\n").encode())
                else:
                    lines.append(written[span[0]:span[0] + span[1]])
                size += len(lines[-1])
                if size >= WRITE_CHUNK_BYTES:
                    out.write(b"".join(lines))
                    lines, size = [], 0
            out.write(b"".join(lines))
            if written is not None:
                written.close()


def replace_atomically(path: Path, data: bytes) -> None:
    """`path` holds `data`, as write_atomically puts it there."""
    write_atomically(path, lambda f: f.write(data))


def write_atomically(path: Path, write: Callable[[BinaryIO], object]) -> None:
    """`path` holds what `write` writes to the file it is given. Readers see the old file or the
    new one, never a part (a rename within the directory). Each writer has its own temp file (two
    reports on one run dir, two streams closing one), removed whatever stops the write; a new file
    is made as open() makes one (0o666 less the umask), an existing one's mode kept where the
    filesystem has modes. An OSError is raised as WriteFailed."""
    try:
        fd, tmp = _own_temp(path)
    except OSError as exc:
        raise WriteFailed(path, exc) from None
    try:
        with os.fdopen(fd, "wb") as f:
            with contextlib.suppress(OSError):  # none to keep, or no modes there (vfat)
                os.fchmod(f.fileno(), stat.S_IMODE(path.stat().st_mode))
            write(f)
        os.replace(tmp, path)
    except BaseException as exc:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        if isinstance(exc, OSError):
            raise WriteFailed(path, exc) from None
        raise


def _own_temp(path: Path) -> tuple[int, str]:
    """A new file beside `path`, opened for writing, and its name: `.NAME.` and a random part,
    created with mode 0o666 (the umask applies, as for open(); no process-wide state read)."""
    for _ in range(100):
        tmp = str(path.parent / f".{path.name}.{secrets.token_hex(TEMP_RANDOM_BYTES)}")
        try:
            return os.open(tmp, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o666), tmp
        except FileExistsError:
            continue
    raise FileExistsError(f"no free temp name beside {path}")


def leftover_temps(directory: Path) -> list[str]:
    """The names of write_atomically's temp files in `directory`: a writer killed mid-write left
    them (or one writes now). Never records: each reader reads its file by its own name."""
    return sorted(p.name for p in directory.glob(".*.*") if p.is_file()
                  and re.fullmatch(rf"\..+\.[0-9a-f]{{{2 * TEMP_RANDOM_BYTES}}}", p.name))


def write_summary(run_dir: Path, summary: dict[str, Any]) -> Path:
    path = run_dir / SUMMARY
    replace_atomically(path, json.dumps(summary, indent=1).encode())
    return path


def not_a_file(path: Path) -> str:
    """Why a run's file that is no regular file is not read: 'missing', 'a pipe, not a file'."""
    return file_kind(path) + ", not a file" if path.exists() else "missing"


def read_rows(path: Path, notes: list[str]) -> Iterator[dict[str, Any]]:
    """A JSONL file's rows. A line that is not a JSON object (a torn last line from a killed writer,
    NaN, nesting too deep, bytes) is skipped, and the notes say which."""
    if not path.is_file():  # a pipe hung the read, /dev/zero filled the memory
        notes.append(f"{path.name}: {not_a_file(path)}, read as empty")
        return
    lines = path.read_bytes().split(b"\n")
    last = len(lines) - 1  # the part after the final newline: b"" unless the write was torn
    bad: list[int] = []
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line, parse_constant=_no_constant)
        except (ValueError, RecursionError):
            row = None
        if isinstance(row, dict):
            yield row
        elif number - 1 == last:
            notes.append(f"{path.name}: skipped a torn last line ({len(line)} bytes)")
        else:
            bad.append(number)
    if bad:
        notes.append(f"{path.name}: skipped {len(bad)} line(s) that are not JSON records "
                     f"(line {', '.join(map(str, bad[:5]))}{', ...' if len(bad) > 5 else ''})")


def _no_constant(name: str) -> None:
    raise ValueError(f"{name} is not a recorded value")  # the writer never writes NaN or Infinity
