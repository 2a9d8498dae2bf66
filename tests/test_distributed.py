"""Decode across ranks (server/distributed): two real ranks over mlx.launch's ring backend on
loopback produce the same tokens as one; a dead rank ends the run with a clear error; different
model files and bad hostfiles are refused."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
from batchsim.configs import ConfigError
from batchsim.server.distributed import ring_log
from batchsim.server.results.metrics import output_tokens_sha256

from tests.cli_calls import last_json

ARGS = ["run", "--model", "tiny", "--request-rate", "inf", "--num-prompts", "6", "--input-len",
        "uniform:8:40", "--output-len", "uniform:4:12", "--max-num-seqs", "4", "--no-progress"]
HANG_GUARD_S = 120  # a hang fails the test instead of the suite


def _cli(args: list[str], out: Path, **env: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "batchsim.scripts.cli", *args, "--out", str(out)],
                          capture_output=True, check=False, text=True, timeout=HANG_GUARD_S,
                          env={**os.environ, **env}, stdin=subprocess.DEVNULL)


def _one_rank_summary(out: Path) -> dict:
    from batchsim.scripts import run_cmd
    from batchsim.scripts.cli import build_parser

    return run_cmd.run(build_parser().parse_args([*ARGS, "--out", str(out)]))


@pytest.mark.slow  # mlx.launch and two ranks starting: 10-15 s at load 6-10
def test_two_ranks_decode_the_same_tokens_as_one(tiny, tmp_path):
    one = _one_rank_summary(tmp_path / "one")
    (tmp_path / "tmp").mkdir()  # mlx.launch's mktemp files (a pid, the hostfile per rank) went here
    proc = _cli([*ARGS, "--ranks", "2"], tmp_path / "two", TMPDIR=str(tmp_path / "tmp"))
    assert proc.returncode == 0, proc.stderr[-2000:]
    # Nothing of the run outlives it but MLX's compiled-kernel cache ($TMPDIR/mlx), kept on purpose
    assert [p.name for p in (tmp_path / "tmp").iterdir() if p.name != "mlx"] == []
    two = last_json(proc.stdout)
    assert two["ranks"] == 2 and two["completed"] == 6
    assert two["total_output_tokens"] == one["total_output_tokens"]
    assert two["output_tokens_sha256"] == one["output_tokens_sha256"]
    assert two["kv_account_mismatches"] == 0
    # KV per rank: each rank holds half the KV heads, so half the bytes per token.
    (run_dir,) = (tmp_path / "two").iterdir()
    (one_dir,) = (tmp_path / "one").iterdir()
    kv = [json.loads(d.joinpath("steps.jsonl").read_text().splitlines()[0])["kv_bytes"]
          for d in (one_dir, run_dir)]
    assert kv[1] * 2 == kv[0]


@pytest.mark.slow  # mlx.launch and two ranks starting: 10-15 s at load 6-10
def test_a_dead_rank_ends_the_run_with_a_clear_error_and_valid_records(tiny, tmp_path):
    proc = _cli([*ARGS, "--ranks", "2"], tmp_path, BATCHSIM_FAULT_DIE_AT_STEP="2")
    assert proc.returncode == 1
    last = proc.stderr.strip().splitlines()[-1]
    assert "rank 1 died" in last, proc.stderr[-2000:]
    error = last_json(proc.stdout)["error"]
    assert error.startswith("rank 1 died")
    # Rank 0 kept what ran (it left no summary.json and an empty requests.jsonl before).
    (run_dir,) = tmp_path.iterdir()
    # The ring backend's "[ring] Socket 3 was closed by the peer" lines (about 20 of them) went
    # to a file in the run directory, counted in the error, not to the terminal.
    assert "[ring]" not in proc.stderr, proc.stderr[-2000:]
    ring = run_dir / ring_log.LOG_NAME
    count = len(ring.read_text().splitlines())
    assert error.endswith(f"records kept in {run_dir} (and {count} MLX ring messages, in {ring})")
    assert count > 1 and all(line.startswith("rank ") and "[ring] " in line
                             for line in ring.read_text().splitlines())
    summary = json.loads((run_dir / "summary.json").read_text())
    reason = summary["interrupt_reason"]  # mlx.launch's SIGTERM or the lost peer, whichever first
    assert summary["interrupted"] is True and ("mlx.launch" in reason or "peer rank" in reason)
    requests = [json.loads(line) for line in (run_dir / "requests.jsonl").read_text().splitlines()]
    steps = (run_dir / "steps.jsonl").read_text().splitlines()
    assert [r["request_id"] for r in requests] == list(range(6))
    assert summary["completed"] == sum(r["status"] == "finished" for r in requests) < 6
    assert summary["num_plans"] == len(steps) >= 2


def test_ranks_with_different_model_files_are_refused(tmp_path):
    from batchsim.server.distributed.channel import check_same_model, model_fingerprint

    for name, weights in (("a", b"\0" * 64), ("b", b"\0" * 63 + b"\1")):
        (tmp_path / name).mkdir()
        (tmp_path / name / "config.json").write_text("{}")
        (tmp_path / name / "model.safetensors").write_bytes(weights)
    a, b = model_fingerprint(tmp_path / "a"), model_fingerprint(tmp_path / "b")
    check_same_model([a, a, a], tmp_path / "a")
    with pytest.raises(ValueError, match=r"rank\(s\) 2 hold different model files"):
        check_same_model([a, a, b], tmp_path / "a")


@pytest.mark.parametrize("content, message", [
    ("not json", "Failed to parse hostfile"),
    ('[{"ssh": "mac1", "ips": ["10.0.0.1"]}]', "1 hosts for --ranks 2"),
    ('[{"ssh": "mac1", "ips": ["10.0.0.1"]}, {"ssh": "mac2"}]', "mac2 have no 'ips'"),
])
def test_a_bad_hostfile_is_a_one_line_error(tmp_path, content, message):
    from batchsim.server.distributed.launch import check_hostfile

    path = tmp_path / "hosts.json"
    path.write_text(content)
    with pytest.raises(ConfigError, match=message):
        check_hostfile(str(path), 2)
    with pytest.raises(ConfigError, match="doesn't exist"):
        check_hostfile(str(tmp_path / "missing.json"), 2)


@pytest.mark.parametrize("value", ["10s", "0", "-1", "nan", "inf"])
def test_a_bad_rank_timeout_is_one_line_before_any_rank_starts(monkeypatch, value):
    """BATCHSIM_RANK_TIMEOUT_S=10s raised a ValueError traceback after mlx.launch had started,
    before the launcher owned it (so nothing killed the ranks on the way out)."""
    from batchsim.server.distributed import launch

    def started(*_args, **_kw):
        raise AssertionError("mlx.launch started")

    monkeypatch.setenv("BATCHSIM_RANK_TIMEOUT_S", value)
    monkeypatch.setattr(launch, "OwnedLaunch", started)
    with pytest.raises(ConfigError, match="BATCHSIM_RANK_TIMEOUT_S"):
        launch.launch(["run"], 2, None)


def test_a_stopped_rank_is_seen_without_proc(monkeypatch):
    """The launcher's SIGSTOP check read /proc only, so on macOS (no /proc) a stopped rank 0
    hung the run again: `ps` answers there."""
    import signal

    from batchsim.server.distributed import owner

    class NoProc:
        def __init__(self, _path):
            pass

        def read_text(self):
            raise FileNotFoundError("no /proc here")

    monkeypatch.setattr(owner, "Path", NoProc)
    proc = subprocess.Popen(["sleep", "30"])
    try:
        assert not owner._stopped(proc.pid)
        os.kill(proc.pid, signal.SIGSTOP)  # delivered asynchronously: ps may still say S
        deadline = time.monotonic() + 10
        while not owner._stopped(proc.pid) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert owner._stopped(proc.pid)
    finally:
        proc.kill()
        proc.wait()


def test_the_launcher_names_the_dead_rank_before_those_it_took_down(tmp_path):
    from batchsim.server.distributed.launch import ranks_error

    (tmp_path / "rank0.json").write_text(json.dumps(
        {"ok": False, "error": "rank 0: lost a peer rank"}))
    (tmp_path / "rank2.json").write_text(json.dumps(
        {"ok": False, "error": "rank 2: stopped by mlx.launch", "terminated": True}))
    assert ranks_error(tmp_path, 3) == ("rank 1 died (killed or crashed before reporting); "
                                        "rank 0: lost a peer rank")
    for r in range(3):
        (tmp_path / f"rank{r}.json").write_text(json.dumps({"ok": True, "error": None}))
    assert ranks_error(tmp_path, 3) is None


def test_the_launcher_says_an_error_every_rank_saw_once_and_what_a_stopped_rank_waited_in(tmp_path):
    from batchsim.server.distributed.launch import ranks_error

    mismatch = "rank(s) 1 hold different model files than rank 0 (sha256 ...)"
    for r in (0, 1):
        (tmp_path / f"rank{r}.json").write_text(json.dumps({"ok": False,
                                                            "error": f"rank {r}: {mismatch}"}))
    assert ranks_error(tmp_path, 2) == f"ranks 0, 1: {mismatch}"
    # Rank 1 died; mlx.launch stopped rank 0 before it reported the lost peer itself.
    (tmp_path / "rank1.json").unlink()
    (tmp_path / "rank0.json").write_text(json.dumps({
        "ok": False, "terminated": True, "during": "step 2",
        "error": "rank 0: stopped by mlx.launch (another rank failed) during step 2, waiting on "
                 "its peers"}))
    assert ranks_error(tmp_path, 2) == (
        "rank 1 died (killed or crashed before reporting); rank 0: stopped by mlx.launch (another "
        "rank failed) during step 2, waiting on its peers")


def test_output_tokens_sha256_follows_request_ids_and_tokens():
    base = output_tokens_sha256({0: [5, 6], 1: [7]})
    assert output_tokens_sha256({1: [7], 0: [5, 6]}) == base  # request-id order, not insertion
    assert output_tokens_sha256({0: [5], 1: [6, 7]}) != base  # same tokens, other requests
    assert output_tokens_sha256({0: [5, 6], 1: [8]}) != base


def test_ring_lines_go_to_a_file_the_rest_through_as_it_comes(tmp_path):
    """mlx.launch hands over a rank's stderr in chunks that split lines anywhere."""
    log = tmp_path / ring_log.LOG_NAME
    rank = ring_log.RankStderr(1, log)
    shown = [rank.feed(chunk) for chunk in (
        "step 1\n[ri", "ng] Socket 3 was closed by the peer\n[", "ring] Sending to socket 4 fa",
        "iled with errno 32\nrank 1: a real error\n", "progress 10%\r", "progress 20%\r",
        "[rin")]
    assert shown == ["step 1\n", "", "", "rank 1: a real error\n", "progress 10%\r",
                     "progress 20%\r", ""]
    assert rank.flush() == "[rin"  # what a rank left unfinished is shown as its stream ends
    assert log.read_text() == ("rank 1: [ring] Socket 3 was closed by the peer\n"
                               "rank 1: [ring] Sending to socket 4 failed with errno 32\n")
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    note = ring_log.keep(tmp_path, str(run_dir))
    assert note == f" (and 2 MLX ring messages, in {run_dir / ring_log.LOG_NAME})"
    assert not log.exists() and (run_dir / ring_log.LOG_NAME).exists()
    assert ring_log.keep(tmp_path, str(run_dir)) == ""  # none: nothing to say
    ring_log.RankStderr(0, log).feed("[ring] x\n")
    elsewhere = ring_log.keep(tmp_path, None)  # no run directory (serve): a file of its own
    path = elsewhere.split(", in ")[1].rstrip(")")
    assert elsewhere.startswith(" (and 1 MLX ring message, in ") and Path(path).exists()
    Path(path).unlink()


@pytest.mark.parametrize("server, signals", [(True, 0), (True, 1), (False, 1)])
def test_ring_lines_without_an_error_to_name_them_go_with_the_run(tmp_path, monkeypatch, server,
                                                                   signals):
    """A peer's "[ring] ... closed by the peer" as a run ends, or as Ctrl-C stops it, was moved to
    a /tmp/batchsim-*-mlx_ring.log that no message named."""
    import tempfile

    from batchsim.server.distributed import launch

    class Ended:  # mlx.launch as it ends: both ranks fine, one ring line logged
        def __init__(self, _cmd, status_dir: Path, _mode, _timeout_s):
            self.status_dir, self.signals = status_dir, signals
            self.killed: list[int] = []
            self.stopped: list[int] = []

        def wait(self) -> int:
            for r in range(2):
                (self.status_dir / f"rank{r}.json").write_text('{"ok": true, "error": null}')
            ring_log.RankStderr(1, self.status_dir / ring_log.LOG_NAME).feed("[ring] Socket 3 "
                                                                             "was closed\n")
            return 0

        def kill(self) -> None:
            pass

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    monkeypatch.setattr(launch, "OwnedLaunch", Ended)
    if server or not signals:
        launch.launch(["serve"], 2, None, server=server)
    else:
        with pytest.raises(KeyboardInterrupt):
            launch.launch(["run"], 2, None, server=server)
    assert not list(tmp_path.iterdir())


def test_a_remote_ranks_ring_lines_on_its_ssh_stdout_go_to_the_file_too(tmp_path, capsys):
    """mlx.launch runs a remote rank under `ssh -tt`: its stderr comes on its stdout, CR LF."""
    import types

    class Process:  # mlx.launch's RemoteProcess, as far as ring_log.install uses it
        def __init__(self, _rank: int, host: str, *_args):
            self._is_local = host == "127.0.0.1"

        def preprocess_output(self, data: str, is_stdout: bool = False) -> str:
            return data

        @property
        def exit_status(self) -> tuple:
            return 0, False

    launch = types.SimpleNamespace(RemoteProcess=Process)
    ring_log.install(launch, str(tmp_path))
    remote, local = (launch.RemoteProcess(r, host) for r, host in ((1, "mac2"), (0, "127.0.0.1")))
    assert remote.preprocess_output("step 1\r\n[ring] Socket 3 was closed by the peer\r\n[ri",
                                    True) == "step 1\r\n"
    assert remote.preprocess_output("ng] Sending to socket 4 failed\r\n{", True) == "{"
    assert remote.preprocess_output("[ring] x\n", False) == ""  # its own stderr, if any
    assert local.preprocess_output("[ring] y\n", True) == "[ring] y\n"  # a local stdout: as is
    remote.preprocess_output("[ri", True)
    assert remote.exit_status == (0, False) and capsys.readouterr().out == "[ri"
    assert (tmp_path / ring_log.LOG_NAME).read_text() == (
        "rank 1: [ring] Socket 3 was closed by the peer\n"
        "rank 1: [ring] Sending to socket 4 failed\n"
        "rank 1: [ring] x\n")
