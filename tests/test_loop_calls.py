"""The simulated loop's Python calls a plan (issue 37: the simulated hour's wall time is mostly
Python frames, each some 500-1,000 instructions in CPython 3.11, not arithmetic). A short run of
the hour's workload (Llama-3.1-8B 4-bit on an M2 Ultra, 5 req/s, seed 3) with a run directory
counts the Python functions the loop calls, less writing records (RecordStream.flush and
RunRecorder.on_finish, which wall_s leaves out too), and stays under a budget: a change that adds
frames to every plan shows here. Counts are deterministic (no timing)."""

from __future__ import annotations

import dataclasses
import sys

from batchsim.server.engine.run_config import RunConfig
from batchsim.server.engine.runner import run_workload
from batchsim.server.engine.session import open_session
from batchsim.server.engine.virtual_run import VirtualRun
from batchsim.server.results.recorder import RunRecorder
from batchsim.server.results.run_files import RecordStream

REQUESTS = 400
# Python calls a plan in this run: 88.1 after pool_geometry.kv_steps gave next_geometry's
# rounding one source (5097585: one call a geometry_for) and lazy_rows (596aa7e); 85.6
# after VirtualRun's loop read has_work and next_arrival
# without their frames; 87.6 after KVManager.geometry_for remembered its answers per
# pool (90.8 before it); 91.9 after admit_plan.py (admissions without a StepBudget), 99.3
# before it; 99.1 after PrefixCache.stores_nothing, 101.9 before it (after
# decode_plan.py and VirtualRun's direct execute), 104.9 at 575be2e, 108.1 at 8495097, 128.9 at
# 3439bf9 (before 3eb9607 and 8495097 took frames out of the loop); the budget leaves ~3% for what
# the loop must gain.
MAX_CALLS_PER_PLAN = 89.0


def _count_calls(monkeypatch, tmp_path) -> tuple[int, int]:
    """(Python calls inside the loop less writing records, plans) of one short run."""
    base = RunConfig(model="llama-3.1-8b", executor="sim", device_profile="M2 Ultra", quantize=4)
    workload = dataclasses.replace(base.workload, num_prompts=REQUESTS, request_rate=5.0, seed=3)
    session = open_session(dataclasses.replace(base, workload=workload))
    uncounted = {RecordStream.flush.__code__, RunRecorder.on_finish.__code__}
    calls, inside = [0], []  # inside: the uncounted frames entered and not yet left

    def profile(frame, event, arg) -> None:
        if event == "call":
            if frame.f_code in uncounted:
                inside.append(frame)
            elif not inside:
                calls[0] += 1
        elif event == "return" and inside and inside[-1] is frame:
            inside.pop()

    loop = VirtualRun._loop

    def counted(run: VirtualRun, *args: object) -> None:
        sys.setprofile(profile)
        try:
            loop(run, *args)
        finally:
            sys.setprofile(None)

    monkeypatch.setattr(VirtualRun, "_loop", counted)
    outcome = run_workload(session, session.config.workload, out_dir=tmp_path, label="calls",
                           timeline=False)
    return calls[0], outcome.summary["num_plans"]


def test_the_simulated_loop_makes_few_python_calls_a_plan(monkeypatch, tmp_path):
    calls, plans = _count_calls(monkeypatch, tmp_path)
    assert plans > REQUESTS  # the run went through the loop (a plan or more per request)
    per_plan = calls / plans
    assert per_plan <= MAX_CALLS_PER_PLAN, (
        f"{per_plan:.1f} Python calls a plan in the simulated loop (budget {MAX_CALLS_PER_PLAN})")
