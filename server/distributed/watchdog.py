"""A rank that stops answering without closing its sockets (hung, paused, a lost link) would block
the others' collectives forever: a deadline per step ends this rank with a clear message."""

from __future__ import annotations

import os
import sys
import threading
import time
from collections.abc import Callable


class Watchdog:
    def __init__(self, timeout_s: float, on_expire: Callable[[str], None] | None = None):
        self.timeout_s = timeout_s
        self._on_expire = on_expire or _exit
        self._deadline: float | None = None
        self._what = ""
        self._lock = threading.Lock()
        threading.Thread(target=self._watch, daemon=True, name="rank-watchdog").start()

    def arm(self, what: str) -> None:
        with self._lock:
            self._deadline = time.monotonic() + self.timeout_s
            self._what = what

    def current(self) -> str | None:
        """What is armed now ('step 7'), without its rank; None between steps."""
        with self._lock:
            return self._what.split(": ", 1)[-1] if self._deadline is not None else None

    def disarm(self) -> None:
        with self._lock:
            self._deadline = None

    def _watch(self) -> None:
        while True:
            time.sleep(min(1.0, self.timeout_s / 4))
            with self._lock:
                late = self._deadline is not None and time.monotonic() > self._deadline
                what = self._what
            if late:
                self._on_expire(f"{what} took over {self.timeout_s:g} s: a peer rank is not "
                                "answering (hung, or its link is down)")
                return


def _exit(message: str) -> None:
    print(message, file=sys.stderr, flush=True)
    os._exit(3)
