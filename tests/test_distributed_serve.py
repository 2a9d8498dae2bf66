"""`batchsim serve --ranks 2` end to end on loopback (tiny model, real processes): idle ranks sleep
instead of spinning in a collective, completions equal a 1-rank server's (every follower also
checks its sampled tokens against rank 0's at each step), and SIGTERM to the launcher ends every
rank."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import httpx
import pytest
from batchsim.server.distributed import launch, stop_signals
from batchsim.server.distributed.rank import LAUNCHER_IGNORED_ENV, STATUS_DIR_ENV

from tests import dispositions
from tests.cli_calls import last_json
from tests.drivers import WatchesServeStderr

ROOT = Path(__file__).resolve().parents[1]
PROMPTS = ("The quick brown fox", "Once upon a time, in a land")
START_GUARD_S = 120  # a server that never listens fails the test instead of hanging the suite


class Serve(WatchesServeStderr):
    def __init__(self, *args: str, ignored: tuple[signal.Signals, ...] = ()):
        cmd = [sys.executable, "-m", "batchsim.scripts.cli", "serve", "--model", "tiny", "--port",
               "0", "--max-num-seqs", "4", *args]
        self.proc = subprocess.Popen(dispositions.command(cmd, *ignored), cwd=ROOT,
                                     stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                     stdin=subprocess.DEVNULL, text=True)
        self.watch_stderr()

    def wait_listening(self) -> None:
        if not self.listening.wait(START_GUARD_S):
            self.proc.kill()
            raise AssertionError("server did not start:\n" + "".join(self.stderr))

    def complete(self, prompt: str) -> dict:
        body = {"model": "tiny", "prompt": prompt, "max_tokens": 6, "temperature": 0,
                "ignore_eos": True}
        response = httpx.post(f"{self.url}/v1/completions", json=body, timeout=60)
        assert response.status_code == 200, response.text
        choice = response.json()["choices"][0]
        return {"text": choice["text"], "usage": response.json()["usage"]}

    def stop(self) -> tuple[int, str]:
        self.proc.send_signal(signal.SIGTERM)
        out, _ = self.proc.communicate(timeout=START_GUARD_S)
        return self.proc.returncode, out


def _processes() -> dict[int, tuple[int, str]]:
    """pid -> (parent pid, state letter) for every process."""
    rows = subprocess.run(["ps", "-A", "-o", "pid=,ppid=,stat="], capture_output=True, text=True,
                          check=True).stdout.split()
    return {int(rows[i]): (int(rows[i + 1]), rows[i + 2][0]) for i in range(0, len(rows), 3)}


def _descendants(root: int) -> list[int]:
    procs, found, frontier = _processes(), [], [root]
    while frontier:
        parent = frontier.pop()
        children = [pid for pid, (ppid, _) in procs.items() if ppid == parent]
        found += children
        frontier += children
    return found


def _busy_samples(pids: list[int], samples: int = 5) -> dict[int, int]:
    """How many of `samples` looks found a thread of each process running or runnable (Linux's
    /proc; a rank spinning in a collective always is: the wait polls on MLX's stream thread)."""
    busy = dict.fromkeys(pids, 0)
    for _ in range(samples):
        for pid in pids:
            busy[pid] += any(_thread_state(t) == "R" for t in Path(f"/proc/{pid}/task").glob("*"))
        time.sleep(0.1)
    return busy


def _thread_state(task: Path) -> str:
    try:
        return (task / "stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return "?"  # the thread ended between the listing and the read


def test_two_rank_server_answers_as_one_and_stops_every_rank(tiny):
    one, two = Serve(), Serve("--ranks", "2")  # both load at once: the waits overlap
    ranks: list[int] = []
    try:
        one.wait_listening()
        two.wait_listening()
        ranks = _descendants(two.proc.pid)  # mlx.launch, its shells and the two ranks
        assert len(ranks) >= 3, ranks
        if Path("/proc/self/task").is_dir():  # idle: every rank sleeps, none polls a collective
            busy = _busy_samples(ranks)
            assert all(n <= 2 for n in busy.values()), f"idle ranks running: {busy}"
        for prompt in PROMPTS:
            assert two.complete(prompt) == one.complete(prompt)
        rc, out = two.stop()
        assert rc == 0, "".join(two.stderr)[-2000:]
        summary = last_json(out)
        assert summary["ranks"] == 2 and summary["requests"] == {"finished": 2}
        alive = [pid for pid in ranks if pid in _processes()]
        assert alive == [], f"left running after SIGTERM: {alive}"
        ranks = []  # gone: nothing to clean up (their pids may be reused)
        assert one.stop()[0] == 0
    finally:  # on a failure: kill what is left (mlx.launch runs in a session of its own)
        running = [s.proc.pid for s in (one, two) if s.proc.poll() is None]
        for pid in running + ranks:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        one.proc.wait()
        two.proc.wait()


def _rank_pid(launcher: int, rank: int) -> int:
    """The pid `rank` left in the launcher's status directory (named on the command line of
    mlx.launch's process, the owner module; `ps`, not /proc: macOS has none)."""
    from batchsim.server.distributed import owner

    for pid in _descendants(launcher):
        args = subprocess.run(["ps", "-ww", "-o", "args=", "-p", str(pid)], capture_output=True,
                              text=True, check=False).stdout.split()
        if owner.__name__ in args:  # python -m OWNER FD STATUS_DIR ...
            pid_path = Path(args[args.index(owner.__name__) + 2]) / f"rank{rank}.pid"
            found = owner.read_pid(pid_path)
            assert found is not None, f"no {pid_path}"
            return found
    raise AssertionError(f"no mlx.launch under {launcher}")


def _install_rank0(monkeypatch, tmp_path, ignored: str) -> tuple[list[str], list[str]]:
    """stop_signals.install as serve's rank 0 runs it, under the launcher's word `ignored`: the
    signals it answers (in order) and those it set ignored; every disposition restored after."""
    monkeypatch.setenv(LAUNCHER_IGNORED_ENV, ignored)
    monkeypatch.setenv(STATUS_DIR_ENV, str(tmp_path))
    server = SimpleNamespace(engine=SimpleNamespace(executor=SimpleNamespace(
        watchdog=SimpleNamespace(current=lambda: None))))
    stops = (signal.SIGINT, signal.SIGHUP, signal.SIGTERM)
    previous = {s: signal.signal(s, signal.SIG_DFL) for s in stops}
    answered: list[str] = []

    async def installed() -> list[str]:
        loop = asyncio.get_running_loop()
        real = loop.add_signal_handler
        monkeypatch.setattr(loop, "add_signal_handler",
                            lambda sig, *args: (answered.append(sig.name), real(sig, *args)))
        stop_signals.install(server, 1.0)
        ignored_here = [s.name for s in stops if signal.getsignal(s) is signal.SIG_IGN]
        for sig in stops:
            loop.remove_signal_handler(sig)
        return ignored_here

    try:
        return answered, asyncio.run(installed())
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


@pytest.mark.parametrize("noted", [["SIGINT"], ["SIGHUP", "SIGINT"]])
def test_rank0_answers_a_stop_signal_noted_while_the_ranks_loaded(monkeypatch, tmp_path, noted):
    """interrupts.hold notes rank 0's stop signals while the ranks load; serve never looked at
    them and ran on. The first drains as serving begins, a second cuts the drain short."""
    from batchsim.server.platform import signals

    monkeypatch.setenv(STATUS_DIR_ENV, str(tmp_path))
    monkeypatch.setattr(stop_signals, "_expire", lambda *_: None)  # its drain deadline's timer
    calls: list[int] = []
    server = SimpleNamespace(engine=SimpleNamespace(executor=SimpleNamespace(
        watchdog=SimpleNamespace(current=lambda: None))),
        on_signal=lambda stop: (calls.append(1), stop.set()))
    previous = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGHUP, signal.SIGTERM)}

    async def installed() -> bool:
        stop = stop_signals.install(server, 0.0)
        for sig in previous:
            asyncio.get_running_loop().remove_signal_handler(sig)
        return stop.is_set()

    before, signals.held[:] = list(signals.held), noted
    try:
        assert asyncio.run(installed()) is True
        assert signals.held == []
    finally:
        signals.held[:] = before
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    assert len(calls) == len(noted)


def test_rank0_answers_the_stop_signals_the_launcher_answers(monkeypatch, tmp_path):
    """Rank 0 of `serve --ranks` put a handler on SIGHUP even under nohup: the launcher's own
    disposition is passed down (a remote rank 0 starts with sshd's); SIGTERM always stays
    answered (mlx.launch's when a peer died). Through install, what serve runs (r7: this tested
    stop_signals.answered, which nothing else called)."""
    answered, _ = _install_rank0(monkeypatch, tmp_path, "SIGHUP,SIGTERM")
    assert answered == ["SIGTERM", "SIGINT"]
    answered, _ = _install_rank0(monkeypatch, tmp_path, "")  # own SIGHUP ignored or not
    assert sorted(answered) == ["SIGHUP", "SIGINT", "SIGTERM"]
    previous = signal.signal(signal.SIGHUP, signal.SIG_IGN)  # nohup's, in the launcher
    try:
        cmd = launch.launch_command(["serve"], 2, None, 20000, "/tmp/status")
    finally:
        signal.signal(signal.SIGHUP, previous)
    assert f"{LAUNCHER_IGNORED_ENV}=SIGHUP" in cmd


def test_rank0_keeps_serving_through_a_sighup_a_nohup_launcher_ignored(tiny):
    """nohup batchsim serve --ranks 2: a SIGHUP to rank 0 (`kill -HUP`) drained and stopped it.
    Now it serves on; the launcher's SIGTERM still stops every rank, exit 0."""
    two = Serve("--ranks", "2", ignored=(signal.SIGHUP,))
    try:
        two.wait_listening()
        os.kill(_rank_pid(two.proc.pid, 0), signal.SIGHUP)
        time.sleep(1.0)  # a handled one would have begun the drain by now
        assert two.complete(PROMPTS[0])["usage"]["completion_tokens"] == 6
        rc, out = two.stop()
        assert rc == 0, "".join(two.stderr)[-2000:]
        assert last_json(out)["requests"] == {"finished": 1}
    finally:  # on a failure: kill what is left (mlx.launch runs in a session of its own)
        for pid in (_descendants(two.proc.pid) if two.proc.poll() is None else []) + [two.proc.pid]:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        two.proc.wait()


@pytest.mark.parametrize("ignored", ["", "SIGINT,SIGHUP"])
def test_rank0_of_serve_sets_ignored_what_the_launcher_ignored(monkeypatch, tmp_path, ignored):
    """A remote rank 0 starts from sshd's dispositions (default: fatal): a signal its launcher
    ignored got no handler and stayed fatal, so `kill -INT` (or -HUP) killed it undrained."""
    _, ignored_here = _install_rank0(monkeypatch, tmp_path, ignored)
    assert ignored_here == [name for name in ignored.split(",") if name]
