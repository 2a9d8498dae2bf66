"""The launcher of `run`/`serve --ranks 2` owns its ranks (real processes, loopback): whichever
way it ends (SIGINT to it alone or to its group, SIGTERM, SIGKILL; its mlx.launch killed; a
follower stopped), no process of the run is left, found by a marker in each one's environment
(/proc, no psutil); a stopped run says `interrupted`, a stopped follower ends it in one line."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
import uuid
from pathlib import Path

import httpx
import pytest
from batchsim.scripts.common import EXIT_INTERRUPTED
from batchsim.server.distributed.rank import (
    LAUNCHER_IGNORED_ENV,
    STATUS_DIR_ENV,
    STOP_SIGNAL_FILE,
    follow_launchers_word,
)

from tests.cli_calls import last_json
from tests.drivers import WatchesServeStderr

pytestmark = pytest.mark.skipif(not Path("/proc/self/environ").exists(), reason="reads /proc")
MARK = "BATCHSIM_TEST_RUN"
RUN = ["run", "--model", "tiny", "--num-prompts", "400", "--request-rate", "10", "--input-len",
       "16", "--output-len", "8", "--no-progress"]
START_GUARD_S = 120  # a run that never starts fails the test instead of hanging the suite
GONE_S = 10  # after the launcher ended: how long its processes may take to exit


class Ranks(WatchesServeStderr):
    """`batchsim ARGS --ranks 2` in a session of its own (a group signal reaches only it)."""

    def __init__(self, args: list[str], **env: str):
        self.mark = uuid.uuid4().hex
        env = {**os.environ, MARK: self.mark, **env}
        cmd = [sys.executable, "-m", "batchsim.scripts.cli", *args, "--ranks", "2"]
        self.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                     stdin=subprocess.DEVNULL, text=True, env=env,
                                     start_new_session=True)
        self.stdout: list[str] = []
        # One reader per pipe (communicate() beside a reader thread would race it for the last
        # lines of stderr).
        self._readers = [self.watch_stderr(),
                         threading.Thread(target=lambda: self.stdout.extend(self.proc.stdout),
                                          daemon=True)]
        self._readers[1].start()

    def wait_for_rank0(self) -> None:
        """Until rank 0's process exists (START_GUARD_S at most)."""
        deadline = time.monotonic() + START_GUARD_S
        while not self.processes(rank=0) and time.monotonic() < deadline:
            time.sleep(0.02)

    def processes(self, rank: int | None = None, writers: bool = False) -> list[int]:
        """Live processes of this run (launcher, mlx.launch, ranks; a zombie has no environ);
        `rank`: that rank's; `writers`: rank 0's records' writer process too (same environment)."""
        want = f"{MARK}={self.mark}".encode()
        found = []
        for environ in Path("/proc").glob("[0-9]*/environ"):
            try:
                env = environ.read_bytes().split(b"\0")
                writer = b"record_process" in (environ.parent / "cmdline").read_bytes()
            except OSError:
                continue
            if (want in env and (writers or not writer)
                    and (rank is None or f"MLX_RANK={rank}".encode() in env)):
                found.append(int(environ.parent.name))
        return found

    def finish(self) -> tuple[int, str, str]:
        """The launcher's exit status, stdout and stderr, once it ended."""
        self.proc.wait(timeout=START_GUARD_S)
        for reader in self._readers:
            reader.join(timeout=START_GUARD_S)  # the last lines of each pipe
        return self.proc.returncode, "".join(self.stdout), "".join(self.stderr)

    def assert_none_left(self) -> None:
        deadline = time.monotonic() + GONE_S
        while self.processes(writers=True) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert self.processes(writers=True) == [], f"left: {self.processes(writers=True)}"

    def cleanup(self) -> None:
        for pid in self.processes(writers=True):
            try:
                os.kill(pid, signal.SIGCONT)
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait()


def wait_for_steps(ranks: Ranks, out: Path) -> Path:
    """The run directory, once rank 0 has recorded a step."""
    deadline = time.monotonic() + START_GUARD_S
    while time.monotonic() < deadline:
        assert ranks.proc.poll() is None, "".join(ranks.stderr)[-2000:]
        for steps in out.glob("*/steps.jsonl"):
            if b"\n" in steps.read_bytes():
                return steps.parent
        time.sleep(0.05)
    raise AssertionError("no step recorded:\n" + "".join(ranks.stderr)[-2000:])


@pytest.mark.parametrize("sig, group", [(signal.SIGINT, False), (signal.SIGINT, True),
                                        (signal.SIGTERM, False),
                                        pytest.param(signal.SIGHUP, False,
                                                     marks=pytest.mark.slow)],  # 14 s at load 3
                         ids=["sigint-launcher", "ctrl-c-group", "sigterm-launcher",
                              "sighup-launcher"])
def test_a_signalled_launcher_ends_the_run_interrupted_and_leaves_no_process(tiny, tmp_path, sig,
                                                                              group):
    ranks = Ranks([*RUN, "--out", str(tmp_path)])
    try:
        wait_for_steps(ranks, tmp_path)
        (os.killpg if group else os.kill)(ranks.proc.pid, sig)
        rc, out, err = ranks.finish()
        assert rc == EXIT_INTERRUPTED, err[-3000:]  # as a 1-rank run stopped so
        assert "Traceback" not in err and "Error" not in err, err[-3000:]
        last = last_json(out)
        assert last["interrupted"] is True and last["ranks"] == 2 and last["completed"] < 400
        saved = json.loads(Path(last["run_dir"], "summary.json").read_text())
        assert saved["interrupted"] is True and saved["completed"] == last["completed"]
        # the signal that stopped the run, not the SIGINT the launcher forwards to rank 0
        assert saved["interrupt_reason"] == sig.name
        ranks.assert_none_left()
    finally:
        ranks.cleanup()


def test_a_signal_while_the_ranks_join_still_ends_the_run_interrupted(tiny, tmp_path):
    """SIGINT as soon as rank 0 exists: the launcher holds it until rank 0 can note it, which
    is while the ranks connect (an interrupted accept() there failed the whole run)."""
    ranks = Ranks([*RUN, "--out", str(tmp_path)])
    try:
        ranks.wait_for_rank0()
        os.kill(ranks.proc.pid, signal.SIGINT)
        rc, out, err = ranks.finish()
        assert rc == EXIT_INTERRUPTED and "ring backend" not in err, err[-3000:]
        assert out.strip(), f"no summary: {err[-3000:]}"
        last = last_json(out)
        assert last["interrupted"] is True and last["completed"] == 0
        ranks.assert_none_left()
    finally:
        ranks.cleanup()


@pytest.mark.slow  # mlx.launch and two ranks starting: 10-15 s at load 6-10
def test_sigterm_to_rank_0_names_the_signal_and_process_it_reached_and_keeps_the_records(
        tiny, tmp_path):
    """SIGTERM sent straight to rank 0 (not through the launcher) was reported as 'stopped by
    mlx.launch (another rank failed)', and rank 0 left no summary.json."""
    rc, err, run_dir, rank0, summary = _signal_rank0(tmp_path, signal.SIGTERM)
    assert rc == 1 and "Traceback" not in err, err[-3000:]
    last = err.strip().splitlines()[-1]
    assert f"rank 0: SIGTERM reached its process (pid {rank0})" in last, err[-3000:]
    assert "rank 0: stopped by mlx.launch" not in last and f"kept in {run_dir}" in last
    assert summary["interrupted"] is True and "SIGTERM" in summary["interrupt_reason"]


def _signal_rank0(tmp_path, sig: int) -> tuple[int, str, Path, int, dict]:
    """`run --ranks 2` with `sig` sent straight to rank 0 once steps are recorded: the launcher's
    exit code and stderr, the run directory, rank 0's pid and its summary (whose completed count
    is checked against requests.jsonl), no process left."""
    ranks = Ranks([*RUN, "--out", str(tmp_path)])
    try:
        run_dir = wait_for_steps(ranks, tmp_path)
        (rank0,) = ranks.processes(rank=0)
        os.kill(rank0, sig)
        rc, _out, err = ranks.finish()
        assert (run_dir / "summary.json").exists(), err[-3000:]
        summary = json.loads((run_dir / "summary.json").read_text())
        lines = (run_dir / "requests.jsonl").read_text().splitlines()
        assert summary["completed"] == [json.loads(x)["status"] for x in lines].count("finished")
        ranks.assert_none_left()
    finally:
        ranks.cleanup()
    return rc, err, run_dir, rank0, summary


@pytest.mark.slow  # mlx.launch and two ranks starting: 10-15 s at load 6-10
def test_sighup_to_rank_0_stops_the_run_as_the_launchers_does_records_kept(tiny, tmp_path):
    """SIGHUP sent straight to rank 0 of `run --ranks` (a launcher that answers it) hit no
    handler: rank 0 died ("rank 0 died", no summary.json). Now it stops the run as the
    launcher's SIGHUP does: interrupted, records kept, exit 130."""
    rc, err, _run_dir, _rank0, summary = _signal_rank0(tmp_path, signal.SIGHUP)
    assert rc == EXIT_INTERRUPTED and "Traceback" not in err, err[-3000:]
    assert summary["interrupted"] is True and summary["interrupt_reason"] == "SIGHUP"


def test_every_rank_ignores_every_stop_signal_its_launcher_ignored():
    """A remote rank starts from sshd's dispositions (SIGHUP, SIGINT: default, fatal): the
    launcher's word (LAUNCHER_IGNORED_ENV) decides for each, for `run --ranks` as for `serve
    --ranks` (one helper). run ranks read only SIGHUP from it; SIGTERM is answered apart."""
    stops = (signal.SIGINT, signal.SIGHUP)
    previous = {sig: signal.signal(sig, signal.SIG_DFL) for sig in stops}
    try:
        assert follow_launchers_word({LAUNCHER_IGNORED_ENV: ""}) == stops
        assert follow_launchers_word({LAUNCHER_IGNORED_ENV: "SIGHUP"}) == (signal.SIGINT,)
        assert signal.getsignal(signal.SIGHUP) is signal.SIG_IGN
        assert follow_launchers_word({LAUNCHER_IGNORED_ENV: "SIGINT,SIGHUP,SIGTERM"}) == ()
        assert all(signal.getsignal(sig) is signal.SIG_IGN for sig in stops)
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


@pytest.mark.parametrize("victim", ["launcher", "mlx.launch"])
def test_a_killed_run_launcher_or_mlx_launch_leaves_no_rank(tiny, tmp_path, victim):
    ranks = Ranks([*RUN, "--out", str(tmp_path)])
    try:
        wait_for_steps(ranks, tmp_path)
        pid = ranks.proc.pid if victim == "launcher" else _mlx_launch(ranks)
        os.kill(pid, signal.SIGKILL)
        ranks.assert_none_left()
    finally:
        ranks.cleanup()


def _mlx_launch(ranks: Ranks) -> int:
    """The run's one process that is neither the launcher nor a rank."""
    (pid,) = set(ranks.processes()) - {ranks.proc.pid} - {
        p for r in (0, 1) for p in ranks.processes(rank=r)}
    return pid


SERVE = ["serve", "--model", "tiny", "--port", "0", "--max-num-seqs", "4"]


def test_ctrl_c_while_a_servers_ranks_start_says_interrupted(tiny):
    """Stopped before it served, `serve --ranks 2` is an interrupted run (one line, 130), not a
    silent 0."""
    ranks = Ranks(SERVE)
    try:
        ranks.wait_for_rank0()
        os.kill(ranks.proc.pid, signal.SIGINT)
        rc, _out, err = ranks.finish()
        assert not ranks.listening.is_set(), "served before the signal: the test did not test"
        assert rc == EXIT_INTERRUPTED, err[-3000:]
        assert err.strip().splitlines()[-1] == "batchsim serve: interrupted", err[-3000:]
        ranks.assert_none_left()
    finally:
        ranks.cleanup()


@pytest.mark.slow  # two ranks serving: 15 s at load 3
def test_sighup_to_a_serving_launcher_drains_and_stops_every_rank(tiny):
    """The terminal closed: as SIGTERM, the server drains, prints its totals and exits 0."""
    ranks = Ranks(SERVE)
    try:
        assert ranks.listening.wait(START_GUARD_S), "".join(ranks.stderr)[-2000:]
        os.kill(ranks.proc.pid, signal.SIGHUP)
        rc, out, err = ranks.finish()
        assert rc == 0, err[-3000:]
        assert last_json(out)["ranks"] == 2
        ranks.assert_none_left()
    finally:
        ranks.cleanup()


def test_a_killed_serve_launcher_leaves_no_rank_on_the_port(tiny):
    ranks = Ranks(SERVE)
    try:
        assert ranks.listening.wait(START_GUARD_S), "".join(ranks.stderr)[-2000:]
        assert httpx.get(f"{ranks.url}/health", timeout=30).status_code == 200
        os.kill(ranks.proc.pid, signal.SIGKILL)
        ranks.assert_none_left()
        with pytest.raises(httpx.ConnectError):
            httpx.get(f"{ranks.url}/health", timeout=5)
    finally:
        ranks.cleanup()


@pytest.mark.parametrize("rank, said", [
    # Who ends a stopped follower first is a race: the launcher (after GRACE_S: "rank 1 did not
    # answer ... and was killed" joins the line) or mlx.launch, once rank 0 has failed.
    (1, ("a peer rank is not answering",)),
    # Rank 0 stopped between steps: its follower waits for the next plan without a deadline (an
    # idle leader is no fault), so the run hung past any timeout; the launcher now ends it.
    # Stopped mid-step: rank 1's own watchdog.
    (0, ("rank 0 stayed stopped (SIGSTOP) past the rank timeout",
         "rank 0 did not answer (stopped or hung) and was killed")),
])
def test_a_stopped_rank_ends_the_run_within_the_rank_timeout_in_one_line(tiny, tmp_path, rank,
                                                                         said):
    ranks = Ranks([*RUN, "--out", str(tmp_path)], BATCHSIM_RANK_TIMEOUT_S="3")
    try:
        run_dir = wait_for_steps(ranks, tmp_path)
        (stopped,) = ranks.processes(rank=rank)
        os.kill(stopped, signal.SIGSTOP)
        t0 = time.monotonic()
        rc, _out, err = ranks.finish()
        assert time.monotonic() - t0 < 3 + 15, err  # the rank timeout, then the launcher's grace
        assert rc == 1 and "Traceback" not in err, err[-3000:]
        last = err.strip().splitlines()[-1]
        assert any(s in last for s in said), err[-3000:]
        if rank == 1:  # rank 0's watchdog ended the run: its records are kept, with a summary
            assert last.endswith(f"records kept in {run_dir}"), err[-3000:]
            summary = json.loads((run_dir / "summary.json").read_text())
            assert summary["interrupted"] and "not answering" in summary["interrupt_reason"]
        ranks.assert_none_left()
    finally:
        ranks.cleanup()



def test_a_second_signal_ends_the_ranks_with_rank_0s_records_kept(tiny, tmp_path):
    """Ctrl-C twice: the second is SIGTERM to the whole group. mlx.launch died of it at once, the
    launcher's wait returned and its SIGKILL could cut rank 0's records short (no summary.json,
    finished requests unwritten: seen with 40 requests in flight). mlx.launch now outlives the
    SIGTERM until its ranks end; shown alone first, as that race is not reliably lost.
    It flaked at load 2: 40 requests were done in a few seconds, before the signals (a finished
    run is no interrupted one), so the run is 10 times longer; and two signals sent back to back
    can reach the launcher as one (a pending signal is not queued twice), so the second is sent
    once the launcher has forwarded the first (its stop_signal file)."""
    ranks = Ranks(["run", "--model", "tiny", "--num-prompts", "400", "--request-rate", "inf",
                   "--input-len", "16", "--output-len", "200", "--max-num-seqs", "4",
                   "--no-progress", "--out", str(tmp_path)])
    try:
        run_dir = wait_for_steps(ranks, tmp_path)
        launch = _mlx_launch(ranks)
        os.kill(launch, signal.SIGTERM)
        time.sleep(1.0)  # the ranks watch their parent every 0.25 s
        assert launch in ranks.processes() and ranks.processes(0), "".join(ranks.stderr)[-2000:]
        forwarded = _status_dir(ranks) / STOP_SIGNAL_FILE
        assert not (run_dir / "summary.json").exists(), "the run ended before the signals"
        os.kill(ranks.proc.pid, signal.SIGINT)
        deadline = time.monotonic() + START_GUARD_S
        while not forwarded.exists() and time.monotonic() < deadline:
            time.sleep(0.01)
        assert forwarded.exists(), "the launcher never forwarded the first SIGINT"  # else one
        os.kill(ranks.proc.pid, signal.SIGINT)  # signal: the second would go untested
        rc, _out, err = ranks.finish()
        assert rc == EXIT_INTERRUPTED and "Traceback" not in err, err[-3000:]
        saved = json.loads((run_dir / "summary.json").read_text())
        assert saved["interrupted"] is True
        requests = (run_dir / "requests.jsonl").read_text().splitlines()
        assert saved["completed"] == sum(json.loads(r)["status"] == "finished" for r in requests)
        ranks.assert_none_left()
    finally:
        ranks.cleanup()


def _status_dir(ranks: Ranks) -> Path:
    """The launcher's status directory, as its rank 0 was given it."""
    (rank0,) = ranks.processes(rank=0)
    env = Path(f"/proc/{rank0}/environ").read_bytes().split(b"\0")
    (var,) = [v for v in env if v.startswith(f"{STATUS_DIR_ENV}=".encode())]
    return Path(var.decode().partition("=")[2])
