"""Admission plans made without a StepBudget (scheduler/decode_plan.py with admit_plan.py) are
the plans the general path makes: every plan of a run equal with the fast path on and off, over an
overloaded queue (the simulated hour's case), a queue that drains, a pool capped at 8 rows, a
budget tight enough to preempt and to shrink first chunks, and heads the fast path hands back
(one-token prompts, prompts with cached blocks to reuse), heads admitted one after another into a
small quantized cache; and the fast path does make a good share of the plans where it can."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
from batchsim.scheduler import decode_plan
from batchsim.server.engine.run_config import RunConfig
from batchsim.server.engine.runner import run_workload
from batchsim.server.engine.session import open_session
from batchsim.workloads.lengths import LengthSpec
from batchsim.workloads.spec import WorkloadSpec, builtin_workload

from tests.plan_paths import hour_config, recorded_plans


def _small(spec: WorkloadSpec, **kw) -> RunConfig:
    return RunConfig(model="llama-3.2-1b", executor="sim", device_profile="M2 Max", quantize=4,
                     workload=spec, **kw)


def _fuzz119() -> RunConfig:
    """r4's fuzz config 119: heads admitted one after another into a small quantized cache, each
    admission's geometry sized for the longest row so far (admissions' len_later as it grows)."""
    spec = dataclasses.replace(builtin_workload("shared-prompt"), num_prompts=60, seed=119,
                               request_rate=50.0)
    base = RunConfig(model="qwen3-0.6b", executor="sim", device_profile="M2 Max", quantize=4,
                     workload=spec, memory_gb=0.6, kv_bits=4, ignore_eos=False)
    return dataclasses.replace(base, scheduler=dataclasses.replace(
        base.scheduler, max_num_seqs=7, max_num_batched_tokens=1000, prefill_step_size=256,
        row_step=4, prefix_cache="off"))


TIGHT = WorkloadSpec(name="mixed", num_prompts=80, request_rate=float("inf"), seed=1,
                     input_len=LengthSpec("uniform", min=16, max=900),
                     output_len=LengthSpec("uniform", min=1, max=160))
ONE_TOKEN = WorkloadSpec(name="one", num_prompts=40, request_rate=50.0, seed=2,
                         input_len=LengthSpec("uniform", min=1, max=3),
                         output_len=LengthSpec("uniform", min=2, max=40))
CASES = {
    # (run, the least share of plans the fast path makes)
    "overloaded": (hour_config(5.0, 300), 0.3),
    "draining": (hour_config(1.0, 60), 0.1),
    "small-pool": (hour_config(8.0, 120, max_num_seqs=8), 0.3),
    "tight": (_small(TIGHT, memory_gb=1.1), 0.05),
    "one-token-prompts": (_small(ONE_TOKEN), 0.05),
    "shared-prompt": (dataclasses.replace(hour_config(5.0, 120), workload=dataclasses.replace(
        builtin_workload("shared-prompt"), num_prompts=120, seed=3)), 0.0),
    # r4's fuzz config 119: heads admitted one after another in a small quantized cache, whose
    # admission geometry needs the longest row so far (len_later) kept as it grows
    "growing-rows": (_fuzz119(), 0.0),
}


def _plans(cfg: RunConfig, out: Path, monkeypatch, fast: bool) -> tuple[list, int, bytes]:
    """Every plan Scheduler.schedule returned, how many admitting ones the fast path made, and
    steps.jsonl (fast=False: every plan that could admit is the general path's)."""
    def run() -> Path:
        return run_workload(open_session(cfg), cfg.workload, out_dir=out, label="a",
                            timeline=False).run_dir

    plans, made, run_dir = recorded_plans(monkeypatch, decode_plan, "admissions", fast, run)
    return plans, sum(bool(a[1]) for a in made), (run_dir / "steps.jsonl").read_bytes()


@pytest.mark.parametrize("name", list(CASES))
def test_admission_plans_are_the_general_paths_plans(name, tmp_path, monkeypatch):
    cfg, share = CASES[name]
    fast, made, fast_steps = _plans(cfg, tmp_path / "fast", monkeypatch, fast=True)
    general, _, general_steps = _plans(cfg, tmp_path / "general", monkeypatch, fast=False)
    assert fast == general
    assert fast_steps == general_steps
    assert made >= share * len(fast), f"the fast path made {made} of {len(fast)} plans"
    if name == "overloaded":  # the hour's case: most plans that admit
        admitting = sum(bool(p.new_requests) for p in fast)
        assert made >= 0.9 * admitting, f"{made} fast of {admitting} admitting plans"
