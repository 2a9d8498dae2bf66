"""The MLX ring backend's own stderr lines ("[ring] Socket 3 was closed by the peer", "[ring]
Sending to socket 4 failed with errno 32", ...): a dead rank makes its peers print a score of
them before batchsim's one-line error. mlx.launch's wrapper (owner.py) writes them to a file in
the status directory instead of the terminal, each with its rank; the launcher moves that file
into the run directory and names it, with their count, after its error."""

from __future__ import annotations

import shutil
import sys
import tempfile
import threading
from pathlib import Path
from typing import Any

RING_PREFIX = "[ring] "  # how MLX's ring backend starts each of its messages
LOG_NAME = "mlx_ring.log"


class RankStderr:
    """One rank's stderr as mlx.launch reads it (chunks, not lines): the ring lines to `log`, the
    rest passed on at once; only a line that may yet turn out a ring line waits for its end. A
    remote rank's stdout too: over `ssh -tt` one pty carries both, its lines ending in CR LF."""

    _lock = threading.Lock()  # one file, a thread per rank

    def __init__(self, rank: int, log: Path):
        self.rank, self.log, self.tail = rank, log, ""

    def feed(self, data: str) -> str:
        *lines, self.tail = (self.tail + data).split("\n")
        ring = [line for line in lines if line.startswith(RING_PREFIX)]
        kept = "".join(f"{line}\n" for line in lines if not line.startswith(RING_PREFIX))
        if ring:
            with self._lock, self.log.open("a") as f:
                f.writelines(f"rank {self.rank}: {line.rstrip(chr(13))}\n" for line in ring)
        if not (self.tail.startswith(RING_PREFIX) or RING_PREFIX.startswith(self.tail)):
            kept, self.tail = kept + self.tail, ""  # a progress bar's line: shown as it comes
        return kept

    def flush(self) -> str:
        """What the rank left unfinished when its stream ended."""
        tail, self.tail = self.tail, ""
        return tail


def install(mlx_launch: Any, status_dir: str) -> None:
    """mlx.launch's ranks (its RemoteProcess, local or over ssh) with their ring lines filtered."""
    log = Path(status_dir) / LOG_NAME

    class Filtered(mlx_launch.RemoteProcess):
        def __init__(self, rank: int, *args: Any, **kwargs: Any):
            super().__init__(rank, *args, **kwargs)
            self._stderr = RankStderr(rank, log)
            # Over ssh (mlx.launch's `ssh -tt`) the rank's stderr arrives on its stdout.
            self._stdout = None if getattr(self, "_is_local", True) else RankStderr(rank, log)

        def preprocess_output(self, data: str, is_stdout: bool = False) -> str:
            data = super().preprocess_output(data, is_stdout)
            stream = self._stdout if is_stdout else self._stderr
            return stream.feed(data) if stream else data

        @property
        def exit_status(self) -> tuple:  # read once the rank's streams ended
            for stream, out in ((self._stderr, sys.stderr), (self._stdout, sys.stdout)):
                if stream and (tail := stream.flush()):
                    out.write(tail)
                    out.flush()
            return super().exit_status

    mlx_launch.RemoteProcess = Filtered


def keep(status_dir: Path, run_dir: str | None) -> str:
    """Move the ring lines into `run_dir` (else a file of their own in the temporary directory):
    '' without any, else ' (and N MLX ring messages, in PATH)' for the launcher's error."""
    log = status_dir / LOG_NAME
    if not log.exists():
        return ""
    count = len(log.read_text().splitlines())
    if run_dir and Path(run_dir).is_dir():
        dest = Path(run_dir) / LOG_NAME
    else:
        dest = Path(tempfile.mkstemp(prefix="batchsim-", suffix=f"-{LOG_NAME}")[1])
    shutil.move(log, dest)
    return f" (and {count} MLX ring message{'s' * (count != 1)}, in {dest})"
