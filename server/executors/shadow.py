"""Times every plan of a real run on the simulator as well: the cost model's error on the very
steps that ran, apart from what queueing and scheduling make of it downstream, and which parts of
the predicted time (weights, attention, ...) that error is about."""

from __future__ import annotations

import dataclasses

from batchsim.scheduler.kv_bytes import CacheLayout
from batchsim.scheduler.plan import StepPlan, StepResult
from batchsim.server.executors.sim_executor import SimExecutor
from batchsim.server.perf.stepcost import StepCost, StepTime


class ShadowTimer:
    """An engine `on_step` hook: the same plan, in the same order, on a SimExecutor of its own
    (so its pool mirrors the real one), against the executor's measured time for that plan.
    `cache`: what the real pool holds by layer kind (the real session's cache_layout; None: dense),
    so joins, leaves and regrowth of sliding, linear-attention and MLA pools are priced as held."""

    def __init__(self, cost: StepCost, cache: CacheLayout | None = None):
        self.sim = SimExecutor(cost, cache=cache)
        self.measured_s: list[float] = []
        self.predicted_s: list[float] = []
        self.parts = StepTime(0.0, 0.0, 0.0, 0.0, 0.0, 0.0)  # summed over the predicted steps

    def __call__(self, engine, plan: StepPlan, result: StepResult) -> None:
        predicted = self.sim.execute(plan).step_durations_s
        # The real executor's time excludes the engine's own per-step work, so the shadow's does
        # too.
        overhead_s = self.sim.cost.step_overhead_s
        self.predicted_s.append(sum(predicted) - len(predicted) * overhead_s)
        self.measured_s.append(result.elapsed_s)
        self.parts += self._parts(plan, len(predicted), self.predicted_s[-1])

    def _parts(self, plan: StepPlan, num_steps: int, predicted_s: float) -> StepTime:
        """The plan's steps by part (each decode step reads one more token); copies are what the
        pool's joins, compaction and regrowth added to the first."""
        cost, rows = self.sim.cost, len(plan.decode_ids)
        width = max(plan.decode_positions) + 1 if rows else 0
        t = cost.step_time(rows, width, plan.prefills)
        for i in range(1, num_steps):
            t += cost.step_time(rows, width + i)
        joined_s = cost.engine.joined_s(plan.num_joined_directly)  # one-token prompts
        t = dataclasses.replace(t, step_overhead_s=0.0, host_request_s=t.host_request_s + joined_s)
        return dataclasses.replace(t, copy_s=max(predicted_s - t.total_s, 0.0))

    def error(self) -> float | None:
        """Predicted / measured - 1 over the whole run's executor time (None before any step)."""
        measured = sum(self.measured_s)
        return sum(self.predicted_s) / measured - 1 if measured > 0 else None
