"""Run records for tests: a small simulated run's config (`sim_config`), such a run finished on
disk (`finished_sim_run`) and copied to edit (`copy_run`), a run directory's
records read back line by line (`records`) or whole (`the_files`), a wait for a condition
(`wait_until`), hand-made records (`step_record`, `request_record`, `sweep_step`) for the code
that reads them, a stream sent one of each (`add_to`), and its writer processes counted as they
start (`counting_starts`)."""

from __future__ import annotations

import json
import shutil
import subprocess
import time
from pathlib import Path

from batchsim.server.engine.run_config import RunConfig
from batchsim.server.results import run_files, writer_side
from batchsim.server.results.record_writer import REQUESTS, STEPS
from batchsim.server.results.records import RequestRecord, StepRecord
from batchsim.workloads.lengths import LengthSpec
from batchsim.workloads.spec import WorkloadSpec


def sim_config(n: int = 60) -> RunConfig:
    # Mixed output lengths at a high rate: requests finish in another order than they arrive.
    spec = WorkloadSpec(name="mixed", num_prompts=n, request_rate=50.0, seed=1,
                        input_len=LengthSpec("uniform", min=16, max=400),
                        output_len=LengthSpec("uniform", min=1, max=120))
    return RunConfig(model="llama-3.2-1b", executor="sim", device_profile="M2 Max", quantize=4,
                     workload=spec)


def finished_sim_run(out: Path) -> Path:
    """The run directory of sim_config(n=12) run to its end under out."""
    from batchsim.server.engine.runner import run_workload
    from batchsim.server.engine.session import open_session

    session = open_session(sim_config(n=12))
    return run_workload(session, session.config.workload, out_dir=out, label="t").run_dir


def copy_run(run_dir: Path, tmp_path: Path) -> Path:
    """A copy of run_dir at tmp_path/run, to damage."""
    return Path(shutil.copytree(run_dir, tmp_path / "run"))


def file_bytes(path: Path) -> bytes:
    """The file's bytes, or none while it is not yet there."""
    return path.read_bytes() if path.exists() else b""


def the_files(run_dir: Path) -> tuple[bytes, bytes]:
    """steps.jsonl's and requests.jsonl's bytes."""
    return tuple((run_dir / n).read_bytes() for n in (STEPS, REQUESTS))


def wait_until(until, what: str, wait_s: float = 10.0, run: subprocess.Popen | None = None):
    """`until()`'s first true value, polled; fails after `wait_s` (a loaded machine's pauses:
    a passing test waits milliseconds), or at once if `run` ended meanwhile."""
    deadline = time.monotonic() + wait_s
    while not (value := until()):
        assert run is None or run.poll() is None, f"the run ended before {what}"
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.005)
    return value


def records(run_dir: Path) -> tuple[list[RequestRecord], list[StepRecord]]:
    """Every line of both files, each a valid record (a torn line fails here)."""
    rows = {n: [json.loads(x) for x in file_bytes(run_dir / n).decode().splitlines()]
            for n in ("requests.jsonl", "steps.jsonl")}
    return ([RequestRecord.from_json(r) for r in rows["requests.jsonl"]],
            [StepRecord.from_json(r) for r in rows["steps.jsonl"]])


def step_record(i: int, start: float, running: int, waiting: int, batch: int = 1,
                prefill: int = 0, preempted: int = 0) -> StepRecord:
    """A one-second step that starts at `start` s."""
    return StepRecord(i, start, start + 1.0, 1, batch, prefill, 1 if prefill else 0, running,
                      waiting, 1 << 20, 1 << 20, 4, 256, preempted, 1.0)


def request_record(rid: int, arrival: float, first: float | None) -> RequestRecord:
    """One token a second after `first` (finished), or none (unfinished) when first is None."""
    times = (first + 1.0,) if first is not None else ()
    return RequestRecord(rid, "finished" if times else "unfinished", arrival, first, times,
                         first + 1.0 if first is not None else None, 16, len(times))


def sweep_step(i: int, batch: int, prefill: int, running: int, waiting: int) -> StepRecord:
    """A 0.1 s step with 192-token prefill chunks and no KV bytes, as the sweep's limits read it."""
    return StepRecord(i, i * 0.1, i * 0.1 + 0.1, 1, batch, prefill, prefill // 192, running,
                      waiting, 0, None, 0, 0, 0)


def add_to(stream: run_files.RecordStream, i: int) -> None:
    """Request `i` (finished) and step `i`: a flush each step where FLUSH_EVERY_S is 0."""
    stream.add_request(request_record(i, float(i), float(i)))
    stream.add_step(step_record(i, float(i), 1, 0))


def counting_starts(monkeypatch) -> list:
    """Each writer process writer_side._started starts from now on (the WriterProcess), in order."""
    started, start = [], writer_side._started

    def counted(run_dir, files):
        started.append(start(run_dir, files))
        return started[-1]

    monkeypatch.setattr(writer_side, "_started", counted)
    return started
