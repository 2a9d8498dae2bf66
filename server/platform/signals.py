"""The signals that stop a run or a server as Ctrl-C does: SIGTERM (a service manager, `kill`)
and SIGHUP (the terminal closed) too. Each command answers them where it can keep its records."""

from __future__ import annotations

import contextlib
import os
import signal
import stat

STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)


def not_ignored(signals: tuple[signal.Signals, ...] = STOP_SIGNALS) -> tuple[signal.Signals, ...]:
    """Of `signals`, those a command may answer: one set to be ignored as it stands now (nohup's
    SIGHUP, a script's `cmd &` SIGINT, inherited) stays ignored. As it stands now: a rank's
    interrupts.hold() put its note over an ignored SIGINT on purpose (the launcher's SIGINT)."""
    return tuple(sig for sig in signals if signal.getsignal(sig) is not signal.SIG_IGN)


def leave_closed_terminal(signum: int) -> None:
    """On SIGHUP, the terminal is gone: a write to it fails (EIO) and would turn an interrupted
    run's exit into a failure. Its standard streams go to /dev/null instead (files and pipes
    are kept: a SIGHUP sent with `kill` still gets the summary line)."""
    if signum != signal.SIGHUP:
        return
    null = os.open(os.devnull, os.O_RDWR)
    for fd in (0, 1, 2):
        with contextlib.suppress(OSError):  # a closed fd: nothing to redirect
            mode = os.fstat(fd)
            # A hung-up terminal is no longer isatty(): a character device other than /dev/null
            # that is not a terminal now (a live one, sent `kill -HUP`, keeps its lines).
            if (stat.S_ISCHR(mode.st_mode) and mode.st_rdev != os.fstat(null).st_rdev
                    and not os.isatty(fd)):
                os.dup2(null, fd)
    os.close(null)
