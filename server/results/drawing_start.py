"""The drawing child's start (timeline_draw.DrawingProcess's), light enough for the program's
first lines: `batchsim run --executor sim` starts it before its own modules load (scripts/cli.py:
matplotlib's import, 0.4-0.5 s of CPU, then begins on the other core about 0.1 s sooner), and
the run's DrawingProcess adopts it. One not adopted (the run refused its input, or needs no
picture from it) is killed: when the run decides so, at the program's exit, or at a stop signal
while the program starts."""

from __future__ import annotations

import atexit
import itertools
import os
import shutil
import signal
import subprocess
import sys
import tempfile

from batchsim.server.platform.child import start_code
from batchsim.server.platform.signals import STOP_SIGNALS

DRAWING_MODULE = "batchsim.server.results.timeline_draw"
START_CHILD = start_code(DRAWING_MODULE)
# Flags after which the run draws no timeline apart (or says only its help): no early child.
_NOT_APART = frozenset({"--no-timeline", "--target", "--ranks", "--hostfile", "-h", "--help"})
# The child's TMPDIR, a directory of batchsim's (named in the child's environment under OWN_TMP):
# where HOME is not writable, matplotlib makes its config directory there (matplotlib-XXXX),
# which only its exit functions remove; a child killed mid-import leaves it to ended() here.
OWN_TMP = "BATCHSIM_DRAWING_TMPDIR"
_early: subprocess.Popen | None = None
_tmp_dirs: dict[subprocess.Popen, str] = {}  # each child's own TMPDIR


def start(code: str = START_CHILD) -> subprocess.Popen | None:
    """A drawing child running `code`, or None where none can start (no such program:
    sys.executable None or gone). Its own session: Ctrl-C at the terminal stops the run, which
    then draws. Its own TMPDIR (OWN_TMP): removed as it exits, or by ended(). Started early,
    it lacks the OPENBLAS_CORETYPE that blas.preload sets later: no matter, drawing does no BLAS
    work to speak of; it has the OPENBLAS_THREAD_TIMEOUT the program set first (numpy's OpenBLAS
    worker spun 0.1 s of its CPU after numpy's import without it)."""
    tmp = _new_tmp()
    env = None if tmp is None else {**os.environ, "TMPDIR": tmp, OWN_TMP: tmp}
    try:
        child = subprocess.Popen([sys.executable or "", "-c", code], stdin=subprocess.PIPE,
                                 stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                 start_new_session=True, env=env)
    except OSError:
        remove_tmp(tmp)
        return None
    if tmp is not None:
        _tmp_dirs[child] = tmp
    return child


def _new_tmp() -> str | None:
    """A new directory in the user's temp directory, or None (none writable: the child's is
    the user's)."""
    try:
        return tempfile.mkdtemp(prefix="batchsim-drawing-")
    except OSError:
        return None


def remove_tmp(tmp: str | None) -> None:
    """`tmp` (a child's own TMPDIR, or None) removed with what is in it."""
    if tmp:
        shutil.rmtree(tmp, ignore_errors=True)


def ended(child: subprocess.Popen) -> None:
    """A drawing child, ending or killed: waited for, its pipes closed, its TMPDIR removed."""
    child.wait()
    for stream in (child.stdin, child.stdout, child.stderr):
        if stream is not None and not stream.closed:
            stream.close()
    remove_tmp(_tmp_dirs.pop(child, None))


def wanted_early(argv: list[str]) -> bool:
    """Whether the command line `argv` (less the program's name) is a simulated run that draws
    its timeline apart: `run` with `--executor sim` named, none of _NOT_APART."""
    sim = "--executor=sim" in argv or ("--executor", "sim") in itertools.pairwise(argv)
    return argv[:1] == ["run"] and sim and not any(
        arg.split("=", 1)[0] in _NOT_APART for arg in argv)


def start_early() -> None:
    """Start the drawing child now; killed at exit unless a run adopts it. The stop signals wait
    until it is `_early` and registered (the program's only thread blocks them): their handler
    (scripts/cli.py) ends `_early`, and one that came after the fork, before, left it orphaned."""
    global _early
    blocked = signal.pthread_sigmask(signal.SIG_BLOCK, STOP_SIGNALS)
    try:
        _early = start()
        if _early is not None:
            atexit.register(end_early)
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, blocked)  # one that came is answered now


def adopt() -> subprocess.Popen | None:
    """The child start_early started (now the caller's), or None."""
    global _early
    child, _early = _early, None
    return child


def end_early() -> None:
    """The child start_early started, not adopted: killed (it has loaded nothing the run needs)
    and waited for, its pipes closed."""
    child = adopt()
    if child is None:
        return
    child.kill()
    ended(child)
