"""SIGINT, SIGTERM, SIGHUP in a run: a request to stop, answered where the run can keep its records
(stop issuing requests; or, while the records are written, just note it), not an exception
raised in whatever line happened to run."""

from __future__ import annotations

import contextlib
import signal
import threading
from collections.abc import Callable, Iterator

from batchsim.server.platform.signals import held, leave_closed_terminal, not_ignored


def hold(signals: tuple[signal.Signals, ...] = (signal.SIGINT,)) -> None:
    """Until an Interrupts is entered, `signals` are only noted (a rank of `run --ranks` asked to
    stop while it loads); the first Interrupts entered counts them as received. Main thread."""
    def note(signum: int, _frame: object) -> None:
        held.append(signal.Signals(signum).name)

    for sig in signals:
        signal.signal(sig, note)


def _note() -> None:
    """Answer while records are being written: nothing to stop, `received` says it happened."""


class Interrupts:
    """Installs handlers for `signals` while entered (main thread only; elsewhere a no-op). With
    no answer set, a signal raises KeyboardInterrupt, as Ctrl-C does by default."""

    def __init__(self, signals: tuple[signal.Signals, ...] = (signal.SIGINT, signal.SIGTERM),
                 name: Callable[[str], str] = str):
        self.signals = signals
        self._name = name  # a signal's name -> what `received` records (rank 0: the launcher's)
        # Why the run was stopped: the first signal's name ("SIGINT"), or stop()'s reason.
        self.received: str | None = None
        self.count = 0  # signals and stop()s so far, each one (`received` keeps only the first)
        # Set by the run under way: ends it where it stands (records and summary kept, `reason`
        # its interrupt_reason); the caller then exits (a peer rank died). Any thread.
        self.abandon: Callable[[str], None] | None = None
        self.abandoned_in: str | None = None  # the run directory an abandoned run was kept in
        self._answer: Callable[[], None] | None = None
        self._previous: dict[signal.Signals, object] = {}

    def __enter__(self) -> Interrupts:
        if held:
            self.received = self.received or self._name(held[0])
            held.clear()
        if threading.current_thread() is threading.main_thread():
            for sig in not_ignored(self.signals):  # nohup's SIGHUP stays ignored
                self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def __exit__(self, *exc: object) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)  # type: ignore[arg-type]
        self._previous.clear()

    def _handle(self, signum: int, frame: object) -> None:
        self.received = self.received or self._name(signal.Signals(signum).name)
        self.count += 1
        leave_closed_terminal(signum)
        if self._answer is None:
            raise KeyboardInterrupt
        self._answer()

    def stop(self, reason: str) -> None:
        """A stop the run asks of itself (its records cannot be written), answered as a signal
        is; `received` becomes `reason` unless a signal came first."""
        self.received = self.received or reason
        self.count += 1
        if self._answer is not None:
            self._answer()

    @contextlib.contextmanager
    def answered_by(self, answer: Callable[[], None] = _note) -> Iterator[None]:
        """Within the block a signal calls `answer` (default: only note it). Nested blocks give
        the outer answer back when they end, with no moment in between unanswered."""
        outer, self._answer = self._answer, answer
        try:
            yield
        finally:
            self._answer = outer
