"""Helpers for the tests that check a scheduler fast path (decode_plan.py, admit_plan.py) against
the general path: a short simulated hour, and every plan a run made with a fast path on or off."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

from batchsim.scheduler import scheduler
from batchsim.server.engine.run_config import RunConfig


def hour_config(rate: float, prompts: int, **sched) -> RunConfig:
    """The simulated hour's workload (issue 37), shorter."""
    base = RunConfig(model="llama-3.1-8b", executor="sim", device_profile="M2 Ultra", quantize=4)
    workload = dataclasses.replace(base.workload, num_prompts=prompts, request_rate=rate, seed=3)
    return dataclasses.replace(base, workload=workload,
                               scheduler=dataclasses.replace(base.scheduler, **sched))


def recorded_plans(monkeypatch, owner: Any, name: str, fast: bool,
                   run: Callable[[], Any]) -> tuple[list, list, Any]:
    """Every plan Scheduler.schedule returned while `run()` ran, what the fast path `owner.name`
    returned each time it made something (fast=False: it makes nothing, so every plan is the
    general path's), and run()'s result."""
    plans, made = [], []
    real_schedule, real_fast = scheduler.Scheduler.schedule, getattr(owner, name)

    def schedule(self):
        plans.append(real_schedule(self))
        return plans[-1]

    def fast_path(*args):
        out = real_fast(*args) if fast else None
        if out is not None:
            made.append(out)
        return out

    with monkeypatch.context() as m:
        m.setattr(scheduler.Scheduler, "schedule", schedule)
        m.setattr(owner, name, fast_path)
        result = run()
    return plans, made, result
