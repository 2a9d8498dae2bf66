"""Stop signals on rank 0 of `serve --ranks N`. mlx.launch sends SIGTERM to rank 0 when another
rank died, and a step that waits on a dead peer never returns, so a drain would wait forever:
rank 0 exits at once when a local peer is gone, else drains as a 1-rank server does, with a
deadline after which it exits anyway. It answers the stop signals the launcher answers: the
ranks run in a session of their own (a remote rank 0 under sshd), so what nohup left ignored is
passed down (LAUNCHER_IGNORED_ENV), not inherited. One noted while the ranks loaded is answered
as serving begins (it was never acted on: serve ran on)."""

from __future__ import annotations

import asyncio
import os
import signal
import threading
from pathlib import Path
from typing import Any

from batchsim.server.distributed.rank import (
    STATUS_DIR_ENV,
    _expire,
    _Status,
    _terminated,
    follow_launchers_word,
    peers_lost,
)
from batchsim.server.platform.signals import held

GRACE_S = 10.0  # beyond the drain timeout: stopping the listener, telling the followers to stop


def install(server: Any, drain_timeout_s: float) -> asyncio.Event:
    """Signal handlers on the running loop; returns the event that stops `serve()`."""
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    status = _Status(0)
    status.doing = server.engine.executor.watchdog.current  # the LeaderExecutor's

    def on_signal(signum: int) -> None:
        if signum == signal.SIGTERM and peers_lost(Path(os.environ[STATUS_DIR_ENV])):
            _terminated(status)  # mlx.launch stopping rank 0 after a peer died
        server.on_signal(stop)  # drain; a second signal cuts it short
        deadline_s = drain_timeout_s + GRACE_S
        message = (f"rank 0: still running {deadline_s:g} s after a stop signal (a step is "
                   "waiting on a peer rank that is gone)")
        timer = threading.Timer(deadline_s, _expire, (status, message))
        timer.daemon = True
        timer.start()

    for sig in (signal.SIGTERM, *follow_launchers_word()):  # the others set ignored
        loop.add_signal_handler(sig, on_signal, sig)
    noted, held[:] = list(held), []  # while the ranks loaded (interrupts.hold): answered now
    for name in noted:
        on_signal(signal.Signals[name])
    return stop
