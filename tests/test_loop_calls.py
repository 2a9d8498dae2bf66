"""The simulated loop's Python calls a plan (issue 37: the simulated hour's wall time is mostly
Python frames, each some 500-1,000 instructions in CPython 3.11, not arithmetic). A short run of
the hour's workload (Llama-3.1-8B 4-bit, 5 req/s, seed 3) on the shipped local calibrated profile
and on the hour's own M2 Ultra catalog profile, with a run directory, counts the Python functions
the loop calls, less writing records (RecordStream.flush and RunRecorder.on_finish, which wall_s
leaves out too), and stays under a budget: a change that adds frames to every plan shows here.
Counts are deterministic (no timing). The local profile has no fitted terms, so a refit (fit-macs
--write) does not move its count; the M2 Ultra's moved by up to 0.8 a plan with each refit
(review r4 item 1), inside its budget's 3%."""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path

import pytest
from batchsim.server.engine.run_config import RunConfig
from batchsim.server.engine.runner import run_workload
from batchsim.server.engine.session import open_session
from batchsim.server.engine.virtual_run import VirtualRun
from batchsim.server.executors.sim_executor import SimExecutor
from batchsim.server.results.recorder import RunRecorder
from batchsim.server.results.run_files import RecordStream

REQUESTS = 400
LOCAL = Path(__file__).parent.parent / "configs" / "devices" / "linux-x86_64-openblas-2core.yaml"
# Python calls a plan in this run: 84.99 (42,240 calls, 497 plans) at 16fdc21, the same with
# cd8de24's fit in place of 9ced22b's. The budget is that x 1.03. The M2 Ultra catalog profile's
# history (same workload): 128.9 at 3439bf9, 108.1 at 8495097, 104.9 at 575be2e, 99.3 before
# admit_plan.py, 91.9 after it, 86.2 at 2d63b66, 88.6 at 5097585 (kv_steps: +1.8), 88.1 after
# cd8de24's refit, 88.8 after 9ced22b's, 90.6 at 16fdc21 (89.7 there with cd8de24's fit).
# 74.18 (36,867 calls, 497 plans) after 1299da2..282396f (has_ops, geometry_for's key,
# Positions made inline, _join, admissions' pricing, _prefill, _advance_to, steps_left); 72.26
# (35,915) after f541dfb (add_request's admissible totals). The M2 Ultra's: 80.86, then 78.92
# (559 plans at 1e29cc2's refit, since undone by 4dd6226); fd6f282's fit: 77.62, 571 plans; 78.51
# (45,145 calls, 575 plans) at 1670efa's refit (the per-run cost marks). LazyRows.join_ready
# (rows join when their prefill ends): 72.24 (35,902), the M2 Ultra's 77.95 (44,820, 575 plans).
# 70.16 (34,872) and 76.15 (43,786) after 1ab4eb4 (chunk_fit's frame) and VirtualRun stamping
# finish times itself.
MAX_CALLS_PER_PLAN = 72.3  # 70.16 x 1.03
# The hour's own profile prices through the fitted Mac terms, which the local one never reaches
# (review r5 item 2): 90.1 a plan at 6e31016 (the fit of 200dc30); a refit moves it by up to 0.8,
# inside this budget's 3%.
MAX_CALLS_PER_PLAN_MAC = 78.5  # 76.15 x 1.03


def _count_calls(monkeypatch, tmp_path, profile_name: str) -> tuple[int, int]:
    """(Python calls inside the loop less writing records, plans) of one short run."""
    base = RunConfig(model="llama-3.1-8b", executor="sim", device_profile=profile_name,
                     quantize=4)
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


@pytest.mark.parametrize("profile_name, budget", [(str(LOCAL), MAX_CALLS_PER_PLAN),
                                                   ("M2 Ultra", MAX_CALLS_PER_PLAN_MAC)],
                         ids=["local", "m2-ultra"])
def test_the_simulated_loop_makes_few_python_calls_a_plan(monkeypatch, tmp_path, profile_name,
                                                           budget):
    calls, plans = _count_calls(monkeypatch, tmp_path, profile_name)
    assert plans > REQUESTS  # the run went through the loop (a plan or more per request)
    per_plan = calls / plans
    assert per_plan <= budget, (
        f"{per_plan:.1f} Python calls a plan in the simulated loop (budget {budget})")


@pytest.mark.parametrize("changes", [{"kv_layout": "paged"},
                                     {"spec_method": "ngram", "spec_acceptance": (0.7, 0.5)}],
                         ids=["paged", "speculative"])
def test_a_plan_enters_join_only_when_a_row_joins(monkeypatch, tmp_path, changes):
    """Paged and speculative plans come from the scheduler's general path (a new decode_ids
    tuple, plain positions every plan): execute asks in C whether a row is missing from the pool
    rather than entering _join (a frame) on every such plan to find none (about half of them)."""
    joins = []
    join = SimExecutor._join

    def counted(executor: SimExecutor, plan) -> float:
        before = len(executor.layout.in_pool)
        seconds = join(executor, plan)
        joins.append(len(executor.layout.in_pool) - before)
        return seconds

    monkeypatch.setattr(SimExecutor, "_join", counted)
    base = RunConfig(model="llama-3.1-8b", executor="sim", device_profile="M2 Ultra", quantize=4)
    if "spec_method" in changes:  # K drafted a row, with the method (checked together)
        changes = {**changes, "scheduler": dataclasses.replace(base.scheduler, spec_tokens=2)}
    base = dataclasses.replace(base, **changes)
    workload = dataclasses.replace(base.workload, num_prompts=100, request_rate=5.0, seed=3)
    session = open_session(dataclasses.replace(base, workload=workload))
    run_workload(session, session.config.workload, out_dir=tmp_path, label="joins",
                 timeline=False)
    assert joins and min(joins) > 0  # every _join joined a row
