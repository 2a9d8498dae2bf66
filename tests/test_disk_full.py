"""A full disk, as real processes: `run` whose records stop fitting mid-run keeps what it wrote
(whole lines), writes a summary marked interrupted with the reason, and exits 1 with one line;
full at the start or during `models build`: one line. The disk is "full" through RLIMIT_FSIZE
with SIGXFSZ ignored (writes past the limit fail with EFBIG); the records' writer treats every
OSError alike, which the ENOSPC test below holds on the writer itself."""

from __future__ import annotations

import errno
import json
import os
import resource
import signal
import subprocess
import sys
from pathlib import Path

from batchsim.server.results.records import StepRecord
from batchsim.server.results.run_files import STEPS, RecordStream

from tests.cli_calls import last_json
from tests.sim_records import records

GUARD_S = 120


def _limited(limit_bytes: int):
    def preexec() -> None:
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a write past the limit: EFBIG, not death
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit_bytes, limit_bytes))
    return preexec


def batchsim(home: Path, limit_bytes: int, *args: str) -> subprocess.CompletedProcess:
    """stdout and stderr are pipes: the limit applies to files only."""
    env = {**os.environ, "BATCHSIM_HOME": str(home), "HF_HUB_OFFLINE": "1"}
    return subprocess.run([sys.executable, "-m", "batchsim.scripts.cli", *args],
                          capture_output=True, check=False, text=True, env=env, timeout=GUARD_S,
                          preexec_fn=_limited(limit_bytes))


def assert_one_line_error(proc: subprocess.CompletedProcess, *words: str) -> str:
    assert proc.returncode == 1, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr and "terminate called" not in proc.stderr, proc.stderr
    last = proc.stderr.strip().splitlines()[-1]
    assert all(w in last for w in words), proc.stderr[-3000:]
    return last


def test_a_disk_full_mid_run_keeps_the_records_and_a_summary_that_says_why(tiny, batchsim_home,
                                                                           tmp_path):
    limit = 20_000  # steps.jsonl outgrows it after a few hundred steps
    proc = batchsim(batchsim_home, limit, "run", "--model", "tiny", "--num-prompts", "400",
                    "--request-rate", "50", "--input-len", "16", "--output-len", "8",
                    "--no-progress", "--out", str(tmp_path))
    assert_one_line_error(proc, "batchsim run: cannot write", "File too large", "run stopped")
    last = last_json(proc.stdout)
    assert last["interrupted"] is True and "File too large" in last["interrupt_reason"]
    run_dir = Path(last["run_dir"])
    saved = json.loads((run_dir / "summary.json").read_text())
    assert saved["interrupted"] is True and saved["interrupt_reason"] == last["interrupt_reason"]
    assert 0 < saved["completed"] < 400
    _reqs, steps = records(run_dir)  # every line whole and valid: no torn last line
    assert steps and len(steps) < saved["num_plans"]
    assert all((run_dir / n).stat().st_size <= limit for n in ("steps.jsonl", "requests.jsonl"))


def test_a_disk_full_at_the_start_is_one_line(tiny, batchsim_home, tmp_path):
    proc = batchsim(batchsim_home, 1_000, "run", "--model", "tiny", "--num-prompts", "4",
                    "--no-progress", "--out", str(tmp_path))
    assert_one_line_error(proc, "batchsim run: cannot write", "config.yaml", "File too large")


def test_a_disk_full_during_models_build_is_one_line_and_leaves_no_model(tmp_path):
    proc = batchsim(tmp_path, 100_000, "models", "build", "tiny")
    assert_one_line_error(proc, "batchsim models: cannot write", "tiny-float32")
    assert [p.name for p in (tmp_path / "models").iterdir()] == []  # no half-built directory


class _FullDisk:
    """A file that takes `room` more bytes, then fails as a full disk does (a short write first)."""

    def __init__(self, f, room: int):
        self.f, self.room = f, room

    def write(self, data) -> int:
        if self.room <= 0:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        n = self.f.write(bytes(data[:self.room]))
        self.room -= n
        return n

    def __getattr__(self, name: str):
        return getattr(self.f, name)


def test_enospc_cuts_the_records_back_to_whole_lines_and_stops_the_run_once(tmp_path):
    errors: list[OSError] = []
    stream = RecordStream(tmp_path, on_error=errors.append)
    stream._files[STEPS] = _FullDisk(stream._files[STEPS], room=300)
    step = StepRecord(0, 0.0, 0.01, 1, 4, 0, 0, 4, 0, 1024, 1024, 4, 256, 0, 0.01)
    line = len(json.dumps(step.to_json(), separators=(",", ":"))) + 1
    for _ in range(10):
        stream.add_step(step)
    stream.flush()
    stream.add_step(step)
    stream.close([])
    assert len(errors) == 1 and errors[0].errno == errno.ENOSPC
    assert str(errors[0]) == f"cannot write {tmp_path / STEPS}: No space left on device"
    text = (tmp_path / STEPS).read_text()
    assert len(text) == 300 // line * line and text.count("\n") == 300 // line
