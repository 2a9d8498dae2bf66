"""A Python child process that runs one of batchsim's modules as __main__ (the drawing child, the
records' writer), as `python -c START_CODE ARGS...`."""

from __future__ import annotations

import contextlib
import signal
import sys

from batchsim.server.platform.signals import STOP_SIGNALS

PR_SET_PDEATHSIG = 1  # <linux/prctl.h>


def start_code(module: str) -> str:
    """The -c code that runs `module` as __main__. `-m` would put the working directory first on
    the child's path, where a numpy.py or matplotlib/ of the user's would run in it (the console
    script's parent never imports from there); -c puts '' there, taken out (PYTHONSAFEPATH would
    do it from 3.11 only). The working directory stays: run directories may be relative paths.
    The stop signals are ignored before they are unblocked (one pending then is dropped) and
    before the module's imports: a service stop while the child starts leaves it running."""
    return ("import sys; sys.path[:1] = [p for p in sys.path[:1] if p]; "
            "from batchsim.server.platform.child import ignore_stop_signals, "
            "resume_when_orphaned, unblock_stops; "
            "ignore_stop_signals(); unblock_stops(); resume_when_orphaned(); import runpy; "
            f"runpy.run_module({module!r}, run_name='__main__')")


def unblock_stops() -> None:
    """The stop signals unblocked: a child inherits its parent's signal mask, and the drawing
    child starts while they are blocked (drawing_start.start_early)."""
    signal.pthread_sigmask(signal.SIG_UNBLOCK, STOP_SIGNALS)


def resume_when_orphaned() -> None:
    """Linux: this process gets a SIGCONT when the thread that started it ends (the run's process
    killed, by SIGKILL too): a child stopped then (SIGSTOP) goes on, reads its pipe to the end
    and exits, where it stayed stopped for good. A running process ignores SIGCONT. Elsewhere
    (macOS) nothing: no such call."""
    if not sys.platform.startswith("linux"):
        return
    import ctypes  # 4 ms, on the child's core

    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, int(signal.SIGCONT))


def how_it_ended(code: int | None, stderr: bytes) -> str:
    """How a child process ended, for a message: 'was killed (SIGTERM)', or 'exited 1: ' and
    the last line of its `stderr` (None: its end unknown)."""
    if code is not None and code < 0:
        with contextlib.suppress(ValueError):
            return f"was killed ({signal.Signals(-code).name})"
        return f"was killed (signal {-code})"
    lines = stderr.decode(errors="replace").strip().splitlines()
    return f"exited {code}: {(lines or ['no message'])[-1][:200]}"


def ignore_stop_signals() -> None:
    """SIGINT, SIGTERM, SIGHUP ignored: a whole service stopped (systemd signals every process
    of its group) ends a child through its run (its pipe's end), which it then answers."""
    for number in STOP_SIGNALS:
        signal.signal(number, signal.SIG_IGN)
