"""Decode-only plans made without a StepBudget (scheduler/decode_plan.py) are the plans the
general path makes: the same records byte for byte with the fast path on and off, over an
overloaded queue (rows at max_num_seqs, the simulated hour's case), a queue that drains (no one
waiting), a budget tight enough to preempt (the fast path hands the plan back) and a prefix cache
that evicts (chat sessions in a tight budget: the plans themselves, with their cache ops); and the
fast path does make a good share of the plans, never for a real executor's, speculative or paged
run (it needs lazy simulated rows). Likewise a plan's prefix-cache ops skipped when they would do
nothing (PrefixCache.has_ops)."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
from batchsim.scheduler import decode_plan, prefix_cache, scheduler
from batchsim.scheduler.config import SchedulerSettings
from batchsim.server.engine.run_config import RunConfig
from batchsim.server.engine.runner import run_workload
from batchsim.server.engine.session import open_session
from batchsim.workloads.lengths import LengthSpec
from batchsim.workloads.spec import WorkloadSpec, builtin_workload

from tests.plan_paths import hour_config, recorded_plans


def _records(cfg: RunConfig, out: Path) -> tuple[bytes, bytes, int]:
    session = open_session(cfg)
    outcome = run_workload(session, cfg.workload, out_dir=out, label="d", timeline=False)
    run_dir = outcome.run_dir
    return ((run_dir / "steps.jsonl").read_bytes(), (run_dir / "requests.jsonl").read_bytes(),
            outcome.summary["num_preemptions"])


# tests/test_virtual_run.py's all-at-once-tight: a KV budget a few requests fill
TIGHT = WorkloadSpec(name="mixed", num_prompts=80, request_rate=float("inf"), seed=1,
                     input_len=LengthSpec("uniform", min=16, max=900),
                     output_len=LengthSpec("uniform", min=1, max=160))
CASES = {
    # (run, whether it preempts, the least share of plans the fast path makes)
    "overloaded": (hour_config(5.0, 300), False, 0.3),
    "draining": (hour_config(1.0, 60), False, 0.3),
    "preempting": (RunConfig(model="llama-3.2-1b", executor="sim", device_profile="M2 Max",
                             quantize=4, workload=TIGHT, memory_gb=1.1), True, 0.05),
    "small-pool": (hour_config(8.0, 120, max_num_seqs=8), False, 0.3),
}


@pytest.mark.parametrize("name", list(CASES))
def test_decode_plans_are_the_general_paths_plans(name, tmp_path, monkeypatch):
    cfg, preempts, share = CASES[name]
    made = [0]
    real = decode_plan.decode_plan

    def counted(*args):
        planned = real(*args)
        made[0] += planned is not None
        return planned

    with monkeypatch.context() as m:
        m.setattr(scheduler, "decode_plan", counted)
        fast = _records(cfg, tmp_path / "fast")
    with monkeypatch.context() as m:
        m.setattr(scheduler, "decode_plan", lambda *_args: None)
        general = _records(cfg, tmp_path / "general")
    assert fast == general
    assert (fast[2] > 0) == preempts  # the case reached what it is named for
    steps = fast[0].count(b"\n")
    assert made[0] >= share * steps, f"the fast path made {made[0]} of {steps} plans"


@pytest.mark.parametrize("workload", ["default", "shared-prompt", "chat-sessions"])
def test_prefix_cache_ops_are_skipped_only_when_they_do_nothing(workload, tmp_path, monkeypatch):
    """The hour's workload has no shared segments: no plan takes the cache's ops (each admission
    used to); workloads that share blocks take them. Records equal with the skip on and off."""
    spec = dataclasses.replace(builtin_workload(workload), num_prompts=120, seed=3)
    cfg = dataclasses.replace(hour_config(5.0, 120), workload=spec)
    taken = [0]
    real = prefix_cache.PrefixCache.take_ops

    def counted(self):
        taken[0] += 1
        return real(self)

    with monkeypatch.context() as m:
        m.setattr(prefix_cache.PrefixCache, "take_ops", counted)
        skipping = _records(cfg, tmp_path / "skip")
    has_ops = prefix_cache.PrefixCache.has_ops  # (pending's and take_ops' test: no chunks)
    with monkeypatch.context() as m:
        m.setattr(prefix_cache.PrefixCache, "has_ops",  # every plan with chunks takes the ops
                  lambda self, chunks, requests: bool(chunks) or has_ops(self, (), requests))
        general = _records(cfg, tmp_path / "general")
    assert skipping == general
    assert (taken[0] == 0) == (workload == "default")


def _plans(cfg: RunConfig, out: Path, monkeypatch, fast: bool) -> tuple[list, list]:
    """Every plan Scheduler.schedule returned in the run, and those the fast path made."""
    plans, made, _ = recorded_plans(monkeypatch, scheduler, "decode_plan", fast,
                                    lambda: _records(cfg, out))
    return plans, [planned[0] for planned in made]


def test_fast_plans_that_evict_cached_blocks_are_the_general_paths_plans(tmp_path, monkeypatch):
    """Chat sessions in 1.2 GiB: committing a fast plan's geometry evicts prefix-cache blocks, so
    the plan carries cache ops (decode_plan's kv.prefix.has_ops branch)."""
    spec = dataclasses.replace(builtin_workload("chat-sessions"), num_prompts=150, seed=3)
    cfg = RunConfig(model="llama-3.2-1b", executor="sim", device_profile="M2 Max", quantize=4,
                    workload=spec, memory_gb=1.2)
    fast, made = _plans(cfg, tmp_path / "fast", monkeypatch, fast=True)
    general, _ = _plans(cfg, tmp_path / "general", monkeypatch, fast=False)
    assert fast == general
    assert any(plan.cache_ops is not None for plan in made), f"{len(made)} fast plans, no ops"


def _gated_runs() -> dict[str, RunConfig]:
    spec = WorkloadSpec(name="gate", num_prompts=12, request_rate=20.0, seed=3,
                        input_len=LengthSpec("fixed", value=24),
                        output_len=LengthSpec("uniform", min=2, max=30))
    sim = {"model": "llama-3.2-1b", "executor": "sim", "device_profile": "M2 Max",
           "workload": spec}
    return {
        "mlx": RunConfig(model="tiny", dtype="float32", workload=spec),
        "speculative": RunConfig(**sim, spec_method="ngram", spec_acceptance=(0.7,),
                                 scheduler=SchedulerSettings(spec_tokens=2)),
        "paged": RunConfig(**sim, kv_layout="paged"),
        "plain": RunConfig(**sim),  # the control: the same workload does take the fast path
    }


@pytest.mark.parametrize("name", ["mlx", "speculative", "paged", "plain"])
def test_the_fast_path_needs_lazy_simulated_rows(name, tiny, tmp_path, monkeypatch):
    """The gating is implicit (real rows have token ids and prompts, drafted rows accepted ids,
    paged rows read every counter: none joins the lazy rows): the outcome, pinned."""
    del tiny  # built for the mlx run
    plans, made = _plans(_gated_runs()[name], tmp_path, monkeypatch, fast=True)
    assert len(plans) > 1
    assert bool(made) == (name == "plain"), f"{len(made)} of {len(plans)} plans made fast"
