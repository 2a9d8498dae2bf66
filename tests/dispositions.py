"""Signal dispositions for the tests that signal a child or themselves: pytest may have inherited
SIGINT ignored (a script's `cmd &`, `trap "" INT`), and a child inherits that; each such test sets
what it relies on instead."""

from __future__ import annotations

import signal
import sys

from batchsim.server.platform.signals import STOP_SIGNALS

# Sets SIGINT, SIGTERM and SIGHUP (argv[1]: the numbers of those to ignore), then execs the rest:
# an ignored signal stays so across exec, a default one too (a preexec_fn is unsafe with threads).
_EXEC = ("import os, signal, sys\n"
         "ignored = {int(n) for n in sys.argv[1].split(',') if n}\n"
         f"for sig in {[int(s) for s in STOP_SIGNALS]}:\n"
         "    signal.signal(sig, signal.SIG_IGN if sig in ignored else signal.SIG_DFL)\n"
         "os.execv(sys.argv[2], sys.argv[2:])\n")


def command(cmd: list[str], *ignored: signal.Signals) -> list[str]:
    """`cmd` (its first item a path) started with SIGINT, SIGTERM and SIGHUP at their defaults
    but `ignored` (as nohup leaves SIGHUP)."""
    return [sys.executable, "-I", "-c", _EXEC, ",".join(str(int(s)) for s in ignored), *cmd]


def _outlived(_signum: int, _frame: object) -> None:
    """pytest's answer to a SIGTERM or SIGHUP it inherited ignored: none (it goes on)."""


def answer_inherited_stop_signals() -> None:
    """In pytest (main thread): a SIGINT it inherited ignored is Python's Ctrl-C again (the tests
    that press Ctrl-C in their own process need it), and an ignored SIGTERM or SIGHUP (nohup) a
    handler that does nothing. A handler is reset to the default at exec, SIG_IGN is not: every
    child a test starts (signalled by it, or signalling itself) now starts with the defaults."""
    for sig in STOP_SIGNALS:
        if signal.getsignal(sig) is signal.SIG_IGN:
            signal.signal(sig, signal.default_int_handler if sig == signal.SIGINT else _outlived)
