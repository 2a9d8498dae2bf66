"""A run's two record files encoded and written: steps.jsonl and requests.jsonl, batch by batch,
each file's batch in one write. One class for both places it runs: in the run's own process (a
RecordStream is one), or in a writer process that the stream sends its batches to
(record_process.py)."""

from __future__ import annotations

import contextlib
import errno
import os
from collections.abc import Sequence
from pathlib import Path
from typing import BinaryIO

from batchsim.server.results.json_lines import TokenTimesText, request_line, step_row_lines
from batchsim.server.results.records import RequestRecord

REQUESTS = "requests.jsonl"
STEPS = "steps.jsonl"
# A request waiting to be written, and its token times as [first, end) runs of step indices into
# the step end times (None: its record's own token times, encoded the ordinary way).
Entry = tuple[RequestRecord, "Sequence[Sequence[int]] | None"]


class WriteFailed(OSError):
    """A run's file could not be written (a full disk, a file size limit): one line saying which.
    `kept`: what the run's last line says of its records after it."""

    kept = "the records written before are kept"

    def __init__(self, path: Path, exc: OSError):
        super().__init__(exc.errno, f"cannot write {path}: {exc.strerror or exc}")

    def __str__(self) -> str:
        return str(self.strerror)

    def __reduce__(self) -> tuple:
        return _write_failed, (self.errno, self.strerror)  # as a writer process answers it


def _write_failed(number: int | None, message: str) -> WriteFailed:
    error = WriteFailed.__new__(WriteFailed)
    OSError.__init__(error, number, message)
    return error


def writer_lost(run_dir: Path, how_ended: str) -> WriteFailed:
    """A writer process that ended without its last answer: the run stops and writes the batches
    it left itself (WriterSide._write_unwritten: a failed write there is the error instead)."""
    error = _write_failed(errno.EIO, how_ended)
    error.kept = (f"every record until then is in {run_dir}, the writer's unwritten ones "
                  "written by the run")
    return error


class RecordWriter:
    """Writes batches of records to a run's files (opened, unbuffered, by the caller). The first
    failed write (any OSError: ENOSPC, EFBIG, EIO) cuts its file back to the last whole record,
    sets `error`, calls `_failed`, and nothing more is written. `ends`: the step end times the
    requests' token runs index (extended by each batch, or the recorder's own list)."""

    def __init__(self, run_dir: Path, files: dict[str, BinaryIO]) -> None:
        self.run_dir = run_dir
        self._files = files
        self._sizes = dict.fromkeys(files, 0)  # bytes of whole records in each file
        self.error: WriteFailed | None = None
        self._written_ids: list[int] = []  # requests.jsonl's records, in the file's order
        self._line_bytes: list[int] = []  # and their lines' lengths
        self.follow_ends([])

    def follow_ends(self, ends: list[float]) -> None:
        """Token runs index `ends` from now on (each end time's text made once, as it comes)."""
        self.ends = ends
        self.end_texts = TokenTimesText(ends)

    def write_batch(self, step_rows: Sequence[tuple], requests: Sequence[Entry]) -> None:
        """`step_rows`: the steps' values in StepRecord's field order (json_lines.STEP_VALUES)."""
        known = self.end_texts.known()
        if step_rows:
            self._write(STEPS, [step_row_lines(step_rows, known)])
        if requests:  # ids and lines in one pass, before the write (the GIL is free there)
            ids, lines, texts = [], [], self.end_texts
            for r, runs in requests:
                ids.append(r.request_id)
                lines.append(request_line(r, None if runs is None else texts(runs), known))
            if self._write(REQUESTS, lines):
                self._written_ids += ids
                self._line_bytes += map(len, lines)  # JSON is ASCII: characters are bytes

    def _write(self, name: str, lines: list[str]) -> bool:
        """Whether `lines` reached the file whole (after a failure nothing is written)."""
        if self.error is not None:
            return False
        f, data, done = self._files[name], "".join(lines).encode(), 0
        try:
            while done < len(data):
                done += f.write(data[done:])  # an unbuffered write may be short
        except OSError as exc:
            self._sizes[name] += data.rfind(b"\n", 0, done) + 1  # the whole records that fit
            with contextlib.suppress(OSError):
                os.ftruncate(f.fileno(), self._sizes[name])  # no torn last line
            self._failed(WriteFailed(self.run_dir / name, exc))
            return False
        self._sizes[name] += len(data)
        return True

    def _failed(self, error: WriteFailed) -> None:
        self.error = error

    def written(self) -> tuple[list[int], list[int]]:
        """requests.jsonl's records in the file's order: their ids, their lines' lengths."""
        return self._written_ids, self._line_bytes
