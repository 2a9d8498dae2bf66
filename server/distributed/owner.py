"""The launcher owns its ranks: mlx.launch runs in a process group of its own, and nothing of it
outlives the launcher, whichever way the launcher ends:
- it returns or raises: the group is killed on the way out;
- it is killed (SIGKILL): mlx.launch holds the read end of a pipe only the launcher holds open
  for writing, and kills its group at EOF (this module's `__main__` wraps mlx.launch);
- mlx.launch itself is killed: every rank watches its parent (rank.py).
Signals to the launcher go to rank 0 (see STOP_PLANS); a rank that failed while a peer is stopped
or hung (mlx.launch's SIGTERM to the peer never lands) has the group killed GRACE_S later."""

from __future__ import annotations

import contextlib
import json
import os
import shlex
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

from batchsim.server.distributed import ring_log
from batchsim.server.distributed.rank import (
    GROUP_STOP_FILE,
    KEEP_RECORDS_S,
    KEEPING_SUFFIX,
    STOP_SIGNAL_FILE,
)
from batchsim.server.platform.signals import leave_closed_terminal, not_ignored
from batchsim.server.results import run_files

GRACE_S = 5.0  # after a rank failed: time for mlx.launch to end the others before the launcher does
POLL_S = 0.1
STOP_CHECK_S = 1.0  # how often the launcher looks for stopped ranks (/proc or ps each)
# What the 1st, 2nd, 3rd signal to the launcher does: to rank 0 (when its pid is known) or to the
# whole group. run: rank 0 stops sending and records the run as interrupted (as Ctrl-C does to a
# 1-rank run); serve: rank 0 drains, a second signal cuts the drain short.
STOP_PLANS = {
    "run": (("rank0", signal.SIGINT), ("group", signal.SIGTERM), ("group", signal.SIGKILL)),
    "serve": (("rank0", signal.SIGTERM), ("rank0", signal.SIGTERM), ("group", signal.SIGKILL)),
}


class OwnedLaunch:
    """mlx.launch with `launch_args`, as a child the launcher owns (start, wait, kill)."""

    def __init__(self, launch_args: list[str], status_dir: Path, mode: str, timeout_s: float):
        read_fd, self._lifeline = os.pipe()  # both non-inheritable; pass_fds hands over one
        cmd = [sys.executable, "-m", __name__, str(read_fd), str(status_dir), *launch_args]
        try:
            # stdin: a pipe never written, not /dev/null: mlx.launch polls stdin, and /dev/null
            # is always readable (at EOF), so it would spin a core for as long as the run goes.
            self.proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, start_new_session=True,
                                         pass_fds=(read_fd,))
        except BaseException:
            os.close(self._lifeline)
            raise
        finally:
            os.close(read_fd)
        self.status_dir = status_dir
        self.plan = STOP_PLANS[mode]
        self.signals = 0  # signals the launcher received
        self._names: list[str] = []  # their names, in order
        self._sent = 0  # of those, acted on
        self._failed_at: float | None = None
        self._terminated_at: float | None = None  # when the group was sent SIGTERM
        self._keeping_at: float | None = None  # when rank 0 was seen keeping its records after it
        self._followers_ended = False  # the followers still running GRACE_S after it: killed
        self._ended_followers: set[int] = set()  # those ranks: ended by us, not failed
        self.killed: list[int] = []  # ranks still running GRACE_S after another failed
        # A local rank stopped (SIGSTOP) between steps is never noticed by its peers (a follower
        # waits for rank 0's next plan without a deadline): past the rank timeout and GRACE_S it
        # ends the run.
        self.stopped: list[int] = []
        self._stopped_since: dict[int, float] = {}
        self._stop_check_at = 0.0  # monotonic time of the next look (every STOP_CHECK_S)
        self._timeout_s = timeout_s  # the ranks' step timeout (rank_timeout_s)

    def wait(self) -> int:
        """Until mlx.launch ends (forwarding signals, ending stuck ranks); its exit status."""
        main = threading.current_thread() is threading.main_thread()
        handled = not_ignored() if main else ()  # nohup's SIGHUP stays ignored
        previous = {s: signal.signal(s, self._note) for s in handled}
        try:
            while True:
                with contextlib.suppress(subprocess.TimeoutExpired):
                    return self.proc.wait(timeout=POLL_S)
                self._forward()
                self._end_unanswered_term()
                self._end_stuck_ranks()
                self._end_stopped_ranks()
        finally:
            for s, handler in previous.items():
                signal.signal(s, handler)

    def kill(self) -> None:
        """Nothing of the run is left: the group killed, mlx.launch reaped, the lifeline cut. A rank
        still running without a status (stopped or hung: mlx.launch's SIGTERM never landed, or
        mlx.launch ended first) is named in `killed`."""
        self.killed = self.killed or running_ranks(self.status_dir)
        self._signal_group(signal.SIGKILL)
        self.proc.wait()
        with contextlib.suppress(OSError):
            os.close(self._lifeline)

    def _note(self, signum: int, _frame: Any) -> None:
        leave_closed_terminal(signum)
        self._names.append(signal.Signals(signum).name)
        self.signals += 1

    def _forward(self) -> None:
        while self._sent < min(self.signals, len(self.plan)):
            target, sig = self.plan[self._sent]
            if target == "rank0":
                rank0 = read_pid(self.status_dir / "rank0.pid")
                if rank0 is None and sig == signal.SIGINT:
                    return  # not started: it gets the signal once it can keep a record of it
                if rank0 is None:
                    self._stop_group(sig)
                else:  # rank 0 records the signal the launcher got, not the one it is sent
                    self._mark(STOP_SIGNAL_FILE)
                    with contextlib.suppress(ProcessLookupError):
                        os.kill(rank0, sig)
            else:
                self._stop_group(sig)
                if sig == signal.SIGTERM:
                    self._terminated_at = time.monotonic()
            self._sent += 1

    def _stop_group(self, sig: int) -> None:
        """The launcher's own signal to every rank, marked first (GROUP_STOP_FILE: the signal it
        got): the ranks it ends say so, not that it came from elsewhere or a peer failed."""
        self._mark(GROUP_STOP_FILE)
        self._signal_group(sig)

    def _mark(self, name: str) -> None:
        """The name of the signal being acted on, in the status directory's file `name` for the
        ranks to read: whole or not at all (a rank reads it from its SIGTERM handler)."""
        with contextlib.suppress(OSError):
            run_files.replace_atomically(self.status_dir / name, self._names[self._sent].encode())

    def _end_unanswered_term(self) -> None:
        """The group's SIGTERM runs each rank's handler, which a rank blocked in a native call
        (a collective) never reaches. GRACE_S after it, the followers still running are killed
        (rank 0 waiting on them in a collective is let go); the group is killed KEEP_RECORDS_S +
        GRACE_S after rank 0 began keeping its records (rank0.keeping: it may start late, after
        a flush under way), or after the SIGTERM if it never began (mlx.launch ignores SIGTERM,
        so nothing else would end it)."""
        t0 = self._terminated_at
        if t0 is None:
            return
        now = time.monotonic()
        if self._keeping_at is None and (self.status_dir / f"rank0{KEEPING_SUFFIX}").exists():
            self._keeping_at = now
        if now - t0 > GRACE_S and not self._followers_ended:
            self._followers_ended = True
            self._kill_followers()
        if now - max(t0, self._keeping_at or t0) > KEEP_RECORDS_S + GRACE_S:
            self._kill_running()
            self._terminated_at = None

    def _kill_followers(self) -> None:
        """SIGKILL to the ranks other than 0 still without a status, each only while its pid is
        in the launch's group (a rank that ended may have left its pid to another process). They
        are noted: dead without a status they are no failure that ends rank 0 GRACE_S later
        (_end_stuck_ranks), which keeps its records until the SIGTERM's own deadline."""
        for rank, pid in _silent_ranks(self.status_dir).items():
            if rank != 0:
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    if os.getpgid(pid) == self.proc.pid:  # mlx.launch leads the ranks' group
                        os.kill(pid, signal.SIGKILL)
                        self._ended_followers.add(rank)

    def _end_stuck_ranks(self) -> None:
        if self._failed_at is None:
            if any_rank_failed(self.status_dir, ignored=self._ended_followers):
                self._failed_at = time.monotonic()
        elif time.monotonic() - self._failed_at > GRACE_S:
            self._kill_running()
            self._failed_at = float("inf")  # done: mlx.launch ends with them

    def _end_stopped_ranks(self) -> None:
        now = time.monotonic()
        if now < self._stop_check_at:  # the deadline is seconds away: no ps 10 times a second
            return
        self._stop_check_at = now + STOP_CHECK_S
        stopped = [r for r, pid in _silent_ranks(self.status_dir).items() if _stopped(pid)]
        self._stopped_since = {r: self._stopped_since.get(r, now) for r in stopped}
        # The peers' own watchdogs speak first (a stopped follower stalls rank 0's step).
        deadline_s = self._timeout_s + GRACE_S
        late = sorted(r for r, t0 in self._stopped_since.items() if now - t0 > deadline_s)
        if late and not self.stopped and self._failed_at is None:
            self.stopped = late
            self._kill_running()

    def _kill_running(self) -> None:
        """The group killed, the ranks still running named in `killed`."""
        self.killed = running_ranks(self.status_dir)
        self._signal_group(signal.SIGKILL)

    def _signal_group(self, sig: int) -> None:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.proc.pid, sig)


def read_pid(path: Path) -> int | None:
    try:
        return int(path.read_text())
    except (OSError, ValueError):
        return None


def any_rank_failed(status_dir: Path, ignored: set[int] | frozenset[int] = frozenset()) -> bool:
    """A rank reported its own failure, or a local rank ended without reporting (killed), other
    than the `ignored` ranks (those the launcher killed itself)."""
    for path in status_dir.glob("rank*.json"):
        with contextlib.suppress(OSError, ValueError, KeyError, TypeError):
            status = json.loads(path.read_text())
            if not status["ok"] and not status.get("terminated"):
                return True
    return any(not _alive(pid) for r, pid in _silent_ranks(status_dir).items() if r not in ignored)


def running_ranks(status_dir: Path) -> list[int]:
    """Local ranks alive without a status: they neither finished nor reported a failure."""
    return sorted(r for r, pid in _silent_ranks(status_dir).items() if _alive(pid))


def _silent_ranks(status_dir: Path) -> dict[int, int]:
    """rank -> pid of each local rank that has written its pid but no status."""
    found = {}
    for path in status_dir.glob("rank*.pid"):
        pid = read_pid(path)
        if pid is not None and not path.with_suffix(".json").exists():
            found[int(path.stem.removeprefix("rank"))] = pid
    return found


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:
        pass  # not ours to signal: alive
    return True


def _stopped(pid: int) -> bool:
    """The process is stopped: state T in /proc, or in `ps` where there is no /proc (macOS)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[-1].split()[0] == "T"
    except OSError:
        pass
    try:
        state = subprocess.run(["ps", "-o", "stat=", "-p", str(pid)], check=False,
                               capture_output=True, text=True, timeout=5).stdout
    except (OSError, subprocess.SubprocessError):
        return False
    return state.strip().startswith("T")


def _die_with_launcher(fd: int, status_dir: str) -> None:
    """mlx.launch's thread: the launcher never writes, so a read returns only at its exit."""
    while os.read(fd, 64):
        pass
    shutil.rmtree(status_dir, ignore_errors=True)  # the launcher's temporary directory
    os.killpg(0, signal.SIGKILL)  # mlx.launch and every rank


def _temp_files_in(mlx_launch: Any, status_dir: str) -> None:
    """A local rank's launch script makes two files with mktemp (its pid; the ring's hostfile)
    that mlx.launch never removes (its kill script removes the first, after a kill only): made in
    the status directory instead, they go with it. (A remote rank's stay on its host.)"""
    base = mlx_launch.RemoteProcess.make_launch_script
    ours = f"$(TMPDIR={shlex.quote(status_dir)} mktemp)"

    def script(rank: int, python: Any, cwd: Any, files: dict, env: list, command: list,
               is_local: bool) -> str:
        text = base(rank, python, cwd, files, env, command, is_local)
        if is_local and "$(mktemp)" not in text:
            raise RuntimeError("mlx.launch's launch script no longer makes its files with "
                               "$(mktemp): batchsim cannot keep them out of /tmp")
        return text.replace("$(mktemp)", ours) if is_local else text

    mlx_launch.RemoteProcess.make_launch_script = staticmethod(script)


def _main() -> None:
    """mlx.launch under the launcher: argv is the lifeline's fd, the status directory, then
    mlx.launch's arguments. Its select() is told never to wait for the ranks' stdin to be
    writable: a pipe always is, so each rank's output thread would spin a core."""
    import select

    import mlx._distributed_utils.launch as mlx_launch

    fd, status_dir = int(sys.argv.pop(1)), sys.argv.pop(1)
    # The launcher's second signal to a run is SIGTERM to the whole group: the ranks end on it
    # (rank 0 keeping its records), mlx.launch once they did. Ended first, it took the launcher's
    # wait with it, whose SIGKILL then cut rank 0's records short. (A handler, not SIG_IGN: the
    # ranks must not inherit it.)
    signal.signal(signal.SIGTERM, lambda *_: None)
    threading.Thread(target=_die_with_launcher, args=(fd, status_dir), daemon=True).start()
    mlx_launch.select = lambda r, w, x, t: select.select(r, [], x, t)  # type: ignore[attr-defined]
    ring_log.install(mlx_launch, status_dir)  # the ring backend's lines to a file, not the terminal
    _temp_files_in(mlx_launch, status_dir)
    # Its "rank N exited with code C" lines: the launcher says what failed, in one line.
    mlx_launch.log_warning = lambda *args, **kwargs: None  # type: ignore[attr-defined]
    mlx_launch.main()


if __name__ == "__main__":
    _main()
