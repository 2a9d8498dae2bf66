"""The signals that stop a run or a server as Ctrl-C does: SIGTERM (a service manager, `kill`)
and SIGHUP (the terminal closed) too. Each command answers them where it can keep its records."""

from __future__ import annotations

import contextlib
import os
import signal
import stat
import sys
from typing import Any

STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
# Stop signals noted before a run's Interrupts was entered (interrupts.hold, ctrl_c): the first
# one entered counts them.
held: list[str] = []


def not_ignored(signals: tuple[signal.Signals, ...] = STOP_SIGNALS) -> tuple[signal.Signals, ...]:
    """Of `signals`, those a command may answer: one set to be ignored as it stands now (nohup's
    SIGHUP, a script's `cmd &` SIGINT, inherited) stays ignored. As it stands now: a rank's
    interrupts.hold() put its note over an ignored SIGINT on purpose (the launcher's SIGINT)."""
    return tuple(sig for sig in signals if signal.getsignal(sig) is not signal.SIG_IGN)


def follow_launcher(ignored: str | None) -> tuple[signal.Signals, ...]:
    """A rank's stop signals: SIGTERM always, the others unless its launcher ignored them
    (`ignored`: their names, "SIGHUP,..."; None, without the launcher's word: unless this process
    does); each one it does not answer is set ignored here, as the launcher has it: a remote rank
    starts from sshd's dispositions (SIGHUP, SIGINT: default, fatal), not its nohup launcher's, so
    one left alone killed the rank undrained, without its records."""
    names = ignored.split(",") if ignored is not None else [
        s.name for s in STOP_SIGNALS if s not in not_ignored()]
    answered = tuple(s for s in STOP_SIGNALS if s == signal.SIGTERM or s.name not in names)
    for sig in STOP_SIGNALS:
        if sig not in answered:
            signal.signal(sig, signal.SIG_IGN)
    return answered


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


def ctrl_c(signum: int, _frame: object) -> None:
    """Ctrl-C before a run's handlers are in: KeyboardInterrupt, as Python's own, and noted as
    interrupts.hold() notes it, so the first Interrupts entered still counts it where Python
    swallowed the exception (raised in a weakref callback or a __del__, such as the import
    system's module-lock callback, it is only printed as "Exception ignored" and the command went
    on)."""
    held.append(signal.Signals(signum).name)
    leave_closed_terminal(signum)  # SIGHUP (cli answers it so too): "interrupted" must not fail
    raise KeyboardInterrupt


def unraisable(seen: Any) -> None:
    """sys.unraisablehook beside ctrl_c: a KeyboardInterrupt Python could not raise (noted) is
    not printed as a traceback (the next Interrupts counts it; no run: swallowed()); anything
    else is, as Python prints it."""
    if not issubclass(seen.exc_type, KeyboardInterrupt):
        sys.__unraisablehook__(seen)


def swallowed() -> bool:
    """A Ctrl-C Python swallowed (ctrl_c noted it, in a finalizer) that no Interrupts counted:
    the command (report, size, fit-macs) starts no run: it stops where it next can
    (stop_if_swallowed), at the latest as it ends (cli)."""
    return bool(held) and signal.getsignal(signal.SIGINT) is ctrl_c


def stop_if_swallowed() -> None:
    """Where a command that starts no run (report, size, fit-macs) can stop between two parts of
    its work: a swallowed() Ctrl-C is raised here as its KeyboardInterrupt (counted), as a run's
    loop stops at its next step on one its Interrupts counted, not after the rest of the work."""
    if swallowed():
        held.clear()
        raise KeyboardInterrupt
