"""A simulated open-loop run goes without asyncio (server/engine/virtual_run.py); it must leave
exactly what the asyncio path leaves: the same records byte for byte and the same summary, over
workloads that reach every case of the arrival timing (idle waits, arrivals within a plan,
arrivals at one instant, refusals, preemption, speculative steps), and stop on a signal with
valid records."""

from __future__ import annotations

import dataclasses
import errno
import json
import math
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from batchsim.server.engine import runner, virtual_clock, virtual_run
from batchsim.server.engine.run_config import RunConfig
from batchsim.server.engine.runner import run_workload
from batchsim.server.engine.session import open_session
from batchsim.server.results import run_files
from batchsim.workloads.lengths import LengthSpec
from batchsim.workloads.requests import build_requests
from batchsim.workloads.spec import TraceSpec, WorkloadSpec

# What differs between two runs of one workload: how long they took, and where they were written.
_WALL_KEYS = {"wall_s", "mean_plan_wall_ms", "sim_speedup", "run_dir", "env"}


def _config(workload: WorkloadSpec, scheduler: dict | None = None, **kwargs) -> RunConfig:
    sched = dataclasses.replace(RunConfig().scheduler, **(scheduler or {}))
    return RunConfig(model="llama-3.2-1b", executor="sim", device_profile="M2 Max", quantize=4,
                     workload=workload, scheduler=sched, **kwargs)


def _run(cfg: RunConfig, out: Path, on_step=None) -> tuple[dict, bytes, bytes]:
    session = open_session(cfg)
    outcome = run_workload(session, cfg.workload, out_dir=out, label="v", timeline=False,
                           on_step=on_step)
    run_dir = outcome.run_dir
    summary = {k: v for k, v in outcome.summary.items() if k not in _WALL_KEYS}
    return (summary, (run_dir / "steps.jsonl").read_bytes(),
            (run_dir / "requests.jsonl").read_bytes())


def _both(cfg: RunConfig, tmp_path: Path, monkeypatch) -> tuple[tuple, tuple]:
    """The run the plain loop makes, then the asyncio path's (which must be what it was)."""
    plain_runs = []
    real_run = virtual_run.VirtualRun.run

    def counted(self):
        plain_runs.append(self)
        return real_run(self)

    with monkeypatch.context() as m:
        m.setattr(virtual_run.VirtualRun, "run", counted)
        plain = _run(cfg, tmp_path / "plain")
    assert len(plain_runs) == 1  # it did take the plain loop
    with monkeypatch.context() as m:
        m.setattr(runner, "replays_exactly", lambda _arrivals: False)
        general = _run(cfg, tmp_path / "asyncio")
    return plain, general


MIXED = WorkloadSpec(name="mixed", num_prompts=80, request_rate=8.0, seed=1,
                     input_len=LengthSpec("uniform", min=16, max=900),
                     output_len=LengthSpec("uniform", min=1, max=160))


@pytest.mark.parametrize("case", ["poisson", "refusals", "all-at-once-tight", "gamma-prefix",
                                  "spec", "day-long-gaps"])
def test_the_plain_loop_leaves_the_records_of_the_asyncio_path(case, tmp_path, monkeypatch):
    workload, extra = MIXED, {}
    if case == "refusals":  # some prompts outgrow the KV budget: refused as they arrive
        workload = dataclasses.replace(MIXED, input_len=LengthSpec("uniform", min=16, max=40_000))
        extra = {"memory_gb": 1.6}
    elif case == "all-at-once-tight":  # preemptions: a KV budget a few requests fill
        workload = dataclasses.replace(MIXED, request_rate=float("inf"))
        extra = {"memory_gb": 1.1}
    elif case == "gamma-prefix":
        workload = dataclasses.replace(MIXED, arrival="gamma", burstiness=0.3, seed=5)
        extra = {"scheduler": {"prefix_cache": "on"}, "kv_layout": "paged"}
    elif case == "day-long-gaps":  # idle waits past asyncio's longest select (a day)
        workload = dataclasses.replace(MIXED, num_prompts=12, request_rate=1e-5)
    elif case == "spec":
        extra = {"spec_method": "ngram", "scheduler": {"spec_tokens": 3},
                 "spec_acceptance": (0.6, 0.4, 0.2)}
    plain, general = _both(_config(workload, **extra), tmp_path, monkeypatch)
    assert plain == general
    if case == "all-at-once-tight":
        assert plain[0]["num_preemptions"] > 0
    if case == "refusals":
        assert 0 < plain[0]["num_rejected"] < 40


def _group(t_ms: float) -> list[dict]:
    """Five requests at one instant, the first and fourth longer than the model's context
    (refused as they arrive)."""
    lengths = (300_000, 64, 200, 300_000, 90)
    return [{"timestamp": t_ms, "input_length": n, "output_length": 3 + i}
            for i, n in enumerate(lengths)]


def test_an_instant_s_arrivals_after_a_wait_that_lands_short(tmp_path, monkeypatch):
    """After an idle wait the virtual clock lands at now + (when - now), which floats put a hair
    short of `when` now and then (forced here on every wait, in both paths): asyncio then issues
    that instant's arrivals one per turn, before the engine wakes while each is refused, after
    its next plan is priced once one was queued. The plain loop does the same."""
    landed = virtual_clock.waited_s

    def short(now_s, timeout_s, capped_at_s):
        at_s = landed(now_s, timeout_s, capped_at_s)
        return math.nextafter(at_s, 0.0) if timeout_s > 0 else at_s

    monkeypatch.setattr(virtual_clock, "waited_s", short)  # both paths land by it
    trace = tmp_path / "instants.jsonl"
    rows = [row for t_ms in (0.0, 500.0, 1250.0, 3000.0) for row in _group(t_ms)]
    trace.write_text("".join(json.dumps(r) + "\n" for r in rows))
    workload = WorkloadSpec(name="instants", arrival="trace", num_prompts=len(rows),
                            trace=TraceSpec(path=str(trace), format="mooncake"))
    waits = []
    real_wait = virtual_run.VirtualRun._wait

    def seen(self):
        when = self._arrivals_s[self._next]
        late = real_wait(self)
        waits.append((self.now_s < when, late))
        return late

    monkeypatch.setattr(virtual_run.VirtualRun, "_wait", seen)
    plain, general = _both(_config(workload), tmp_path, monkeypatch)
    assert plain == general
    assert waits == [(False, False)] + [(True, True)] * 3  # at 0 s no wait; then short, late
    assert plain[0]["num_rejected"] == 8 and plain[0]["completed"] == 12


@pytest.mark.parametrize("plain", [True, False])
def test_ctrl_c_mid_run_stops_the_simulation_with_valid_records(plain, tmp_path, monkeypatch):
    if not plain:
        monkeypatch.setattr(runner, "replays_exactly", lambda _arrivals: False)
    steps_seen, last_decode = [], set()

    def interrupt(engine, plan, result):
        steps_seen.append(plan.step_index)
        last_decode.clear()
        last_decode.update(plan.decode_ids)
        if len(steps_seen) == 20:
            os.kill(os.getpid(), signal.SIGINT)

    session = open_session(_config(MIXED))
    outcome = run_workload(session, MIXED, out_dir=tmp_path, label="i", timeline=False,
                           on_step=interrupt)
    assert outcome.interrupted and outcome.summary["interrupt_reason"] == "SIGINT"
    assert 20 <= len(steps_seen) <= 22  # it stops at once (asyncio: within a turn or two)
    lines = (outcome.run_dir / "requests.jsonl").read_text().splitlines()
    rows = [json.loads(x) for x in lines]
    assert [r["request_id"] for r in rows] == sorted(r["request_id"] for r in rows)
    assert {r["status"] for r in rows} == {"finished", "unfinished"} and len(rows) < 80
    steps = (outcome.run_dir / "steps.jsonl").read_text().splitlines()
    assert len(steps) == outcome.summary["num_plans"] == len(steps_seen)
    # the last plan's decode rows have their tokens up to its end (lazy rows settled)
    last_end_s = json.loads(steps[-1])["end_s"]
    decoding = [r for r in rows if r["request_id"] in last_decode and r["status"] == "unfinished"]
    assert decoding and all(r["token_times_s"][-1] == last_end_s for r in decoding)


def test_which_arrivals_the_plain_loop_replays():
    assert virtual_run.replays_exactly([0.0, 0.0, 0.5, 0.5 + 1e-8, 3600.0])
    assert not virtual_run.replays_exactly([])
    assert not virtual_run.replays_exactly([0.0, 1.0, 0.5])  # out of order
    assert not virtual_run.replays_exactly([0.0, 1e-9])  # within asyncio's clock resolution
    assert not virtual_run.replays_exactly([0.0, float("nan")])
    assert not virtual_run.replays_exactly([0.0, 1e30])  # where a float's step outgrows 1 ns


def test_the_fast_paths_bound_is_its_own_not_the_workloads():
    """r7: virtual_run's bound was also named MAX_ARRIVAL_S (2**22 s), as jsonio's (1e9 s, the
    latest arrival a workload may have): arrivals between them run on the asyncio path."""
    from batchsim.server.results import jsonio

    bound_s = virtual_run.FAST_PATH_MAX_S
    assert 2 * math.ulp(bound_s) < virtual_run.MIN_GAP_S and bound_s < jsonio.MAX_ARRIVAL_S
    assert virtual_run.replays_exactly([0.0, bound_s - 1.0])
    assert not virtual_run.replays_exactly([0.0, bound_s])
    assert not virtual_run.replays_exactly([0.0, jsonio.MAX_ARRIVAL_S])


class _FillsUp:
    """A file that takes `room` bytes, then fails as a full disk does."""

    def __init__(self, f, room: int) -> None:
        self._f, self._room = f, room

    def write(self, data: bytes) -> int:
        if len(data) > self._room:
            raise OSError(errno.ENOSPC, "No space left on device")
        self._room -= len(data)
        return self._f.write(data)

    def __getattr__(self, name):
        return getattr(self._f, name)


def test_a_full_disk_stops_the_plain_loop_with_the_records_so_far(tmp_path, monkeypatch):
    monkeypatch.setattr(run_files, "FLUSH_EVERY_S", 0.0)  # every step written as it ends
    opened = run_files.RecordStream.__init__

    def small_disk(self, *args, **kwargs):
        opened(self, *args, **kwargs)
        self._files[run_files.STEPS] = _FillsUp(self._files[run_files.STEPS], 20_000)

    monkeypatch.setattr(run_files.RecordStream, "__init__", small_disk)
    session = open_session(_config(MIXED))
    outcome = run_workload(session, MIXED, out_dir=tmp_path, label="full", timeline=False)
    assert outcome.interrupted and "No space left" in outcome.summary["interrupt_reason"]
    lines = (outcome.run_dir / "steps.jsonl").read_text().splitlines()
    assert lines and all(json.loads(x)["step_index"] >= 0 for x in lines)  # whole records
    assert len(outcome.steps) <= len(lines) + 1 < 127  # it stopped at once (a full run: 127)


def test_the_plain_loop_runs_without_the_collector_and_turns_it_back_on(tmp_path):
    """The loop keeps what it allocates to the end of the run: the collector is off while it runs
    (its passes found nothing), on again after it, whether it ends or fails."""
    import gc

    seen = []
    frozen = gc.get_freeze_count()
    session = open_session(_config(MIXED))
    run_workload(session, MIXED, out_dir=tmp_path, label="gc", timeline=False,
                 on_step=lambda *_: seen.append(gc.isenabled()))
    assert seen and not any(seen)
    assert gc.isenabled() and gc.get_freeze_count() == frozen  # what it froze is unfrozen

    def fails(*_):
        raise RuntimeError("boom")

    session = open_session(_config(MIXED))
    with pytest.raises(RuntimeError, match="boom"):
        run_workload(session, MIXED, out_dir=tmp_path, label="gc2", timeline=False,
                     on_step=fails)
    assert gc.isenabled() and gc.get_freeze_count() == frozen


def test_the_workloads_requests_are_built_without_the_collectors_passes(tmp_path, monkeypatch):
    """A run keeps its requests to the end: building them (18,000 for the simulated hour) went
    through 26 collections, half of _Run's 47 ms. They are built under the run's long-lived heap
    (young generation collected rarely), and the collector's settings are back after the run."""
    import gc

    made = []

    def counted(spec):
        before = sum(s["collections"] for s in gc.get_stats())
        requests = build_requests(spec)
        made.append(sum(s["collections"] for s in gc.get_stats()) - before)
        return requests

    monkeypatch.setattr(runner, "build_requests", counted)
    threshold = gc.get_threshold()
    spec = dataclasses.replace(MIXED, num_prompts=5000, request_rate=math.inf)
    run_workload(open_session(_config(spec)), spec, out_dir=tmp_path, label="gc3",
                 timeline=False)
    assert made == [0] and gc.get_threshold() == threshold


def test_the_virtual_clock_waits_at_most_what_asyncio_waits():
    """virtual_clock holds asyncio's longest wait without loading asyncio: the two must agree, or
    the plain loop and the event loop land an idle wait of over a day at different times."""
    import asyncio

    assert asyncio.base_events.MAXIMUM_SELECT_TIMEOUT == virtual_clock.MAX_WAIT_S


def test_a_simulated_open_loop_run_never_loads_asyncio(tmp_path):
    """The plain loop needs no event loop, so the program does not load asyncio (about 20 ms of the
    simulated hour's start): a module on this path that imports it again fails this."""
    hook = tmp_path / "hook"
    hook.mkdir()
    (hook / "sitecustomize.py").write_text(
        "import atexit, sys\n"
        "atexit.register(lambda: print('asyncio loaded:', 'asyncio' in sys.modules))\n")
    command = [sys.executable, "-m", "batchsim.scripts.cli", "run", "--executor", "sim",
               "--device-profile", "M2 Max", "--model", "llama-3.2-1b", "--num-prompts", "20",
               "--request-rate", "8", "--no-progress", "--out", str(tmp_path / "runs")]
    done = subprocess.run(command, capture_output=True, text=True, timeout=120, check=False,
                          env={**os.environ, "PYTHONPATH": str(hook)})
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines()[-1] == "asyncio loaded: False"
    (run_dir,) = (tmp_path / "runs").iterdir()
    assert (run_dir / "timeline.png").is_file()  # the whole run, its picture too
