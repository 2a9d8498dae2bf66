"""The signals that stop a run or a server as Ctrl-C does: SIGTERM (a service manager, `kill`)
and SIGHUP (the terminal closed) too. Each command answers them where it can keep its records."""

from __future__ import annotations

import signal

STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
