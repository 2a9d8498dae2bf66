"""A RecordStream's side of its writer process (run_files.RecordStream, record_process's child):
when the writer starts, whether a flush goes to it, and its end awaited, the batches a killed one
did not write written by the run."""

from __future__ import annotations

import contextlib
import logging
import os
import threading
from pathlib import Path
from typing import BinaryIO

from batchsim.server.results.record_process import WriterProcess
from batchsim.server.results.record_writer import STEPS, Entry, RecordWriter


class WriterSide(RecordWriter):
    """`writer_process`: from the first flush the period makes due, a writer process (started
    then or by start_writer) encodes and writes the records on another core, each flush sending
    it one; its failed write, or its end without a last answer (killed), reaches `error` and
    `_failed` at the next flush or at close (a flush period or more late: the run goes on
    meanwhile); close waits for its last answer, and writes here the batches a killed one did not
    write. A killed run's writer writes every batch that reached its pipe (those still queued
    behind a lagging writer are lost with the run). Where none can start, a flush came sooner, or
    the files were replaced, they are written here."""

    _lock: threading.RLock

    def __init__(self, run_dir: Path, files: dict[str, BinaryIO], writer_process: bool) -> None:
        super().__init__(run_dir, files)
        self._child: WriterProcess | None = None
        self._child_due = False  # a due flush came: the writer process (if any) is sent records
        # The files a writer process is to write (None: not wanted, or started): it starts at the
        # first flush that falls due, so a run that ends before one never waits for it to start.
        self._for_child = dict(files) if writer_process else None
        self._ends_sent = 0  # step end times the child has been sent
        self._writable = False  # after `error`: the writer process's end, its batches kept

    def start_writer(self, due: bool = False) -> None:
        """The writer process started now (first due flush, or a simulated run's start) if wanted,
        nothing written yet, files the ones opened; a flush before a due one ends it unused.
        `due`: a due flush came (set with the start, under the lock: another thread's flush in
        between would have ended the writer as unused)."""
        with self._lock:  # not while a watchdog's thread flushes
            files, self._for_child = self._for_child, None
            if files is not None and files == self._files and not self._files[STEPS].closed:
                self._child = _started(self.run_dir, files)
            self._child_due = self._child_due or due

    def _sent(self, step_rows: list[tuple], requests: list[Entry]) -> bool:
        """Whether this flush's batch went to the writer process (False: it is written here, and
        from now on every batch is)."""
        if self._child is not None and not self._child_due:  # started early, not yet due
            self._child, unused = None, self._child
            unused.end_unused()
        if self._child is not None and self._child.never_ran():  # written here from now on
            self._finish_child()
        if self._child is None:
            self._for_child = None
            return False
        self._send(step_rows, requests)
        return True

    def _send(self, step_rows: list[tuple], requests: list[Entry]) -> None:
        """To the writer process (its failed write or its end is seen here at the next flush or
        close: a flush period or more after it, the run going on meanwhile); nothing after a
        failure, but kept for close after the child's end (`lost`)."""
        child = self._child
        if self.error is None and child.error is not None:
            self._failed(child.error)
        if (self.error is not None and not child.lost) or not (step_rows or requests):
            return
        ends = self.ends
        upto = len(ends)  # after the requests were taken: every end their runs index
        child.send(step_rows, requests, ends[self._ends_sent:upto])
        self._ends_sent = upto

    def _finish_child(self) -> None:
        """The writer process's last answer awaited: what it wrote, or why it failed."""
        child, self._child = self._child, None
        if child is None:
            return
        child.finish()
        if child.lost:
            self._write_unwritten(child)
        elif child.error is not None and self.error is None:
            self._failed(child.error)
        elif child.written is not None:
            self._written_ids, self._line_bytes = child.written

    def _write_unwritten(self, child: WriterProcess) -> None:
        """A writer process that ended without its last answer (killed): each file cut back to
        what it answered as written (no torn line), and the batches it did not write written
        here. Its end seen at a flush stopped the run: that error stays, unless a write here
        fails. Seen only now (the loop went on to its end), every batch written: a warning."""
        self._written_ids, self._line_bytes = child.written_ids, child.line_bytes
        stopped, self.error = self.error, None
        for name, f in self._files.items():
            self._sizes[name] = child.file_bytes[name]
            with contextlib.suppress(OSError):
                os.ftruncate(f.fileno(), child.file_bytes[name])
            f.seek(child.file_bytes[name])  # the child's offset, shared: past what it wrote
        for step_rows, requests in child.unwritten:
            self.write_batch(step_rows, requests)  # a failed write: _failed, the run stops
        self._writable = self.error is None  # close() writes the rest (the unfinished) too
        if stopped is None and self.error is None:
            logging.getLogger("batchsim").warning(
                "%s: %s; %s", self.run_dir, child.how_ended, _rest(len(child.unwritten)))
        self.error = self.error or stopped  # a failed write here: records before it are kept


def _rest(unwritten: int) -> str:
    """Who wrote a lost writer's last batches, for the run's warning."""
    if unwritten == 0:
        return "it had written every batch it was sent"
    return ("its last batch was written by the run" if unwritten == 1 else
            f"its last {unwritten} batches were written by the run")


def _started(run_dir: Path, files: dict[str, BinaryIO]) -> WriterProcess | None:
    """A writer process for `files`, or None where none can start (they are written here)."""
    try:
        return WriterProcess(run_dir, files)
    except OSError:  # no such program (sys.executable None or gone), no processes left
        return None
