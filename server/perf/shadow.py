"""Times every plan of a real run on the simulator as well: the cost model's error on the very
steps that ran, apart from what queueing and scheduling make of it downstream."""

from __future__ import annotations

from batchsim.scheduler.plan import StepPlan, StepResult
from batchsim.server.executors.sim_executor import SimExecutor
from batchsim.server.perf.stepcost import StepCost


class ShadowTimer:
    """An engine `on_step` hook: the same plan, in the same order, on a SimExecutor of its own
    (so its pool mirrors the real one), against the executor's measured time for that plan."""

    def __init__(self, cost: StepCost):
        self.sim = SimExecutor(cost)
        self.measured_s: list[float] = []
        self.predicted_s: list[float] = []

    def __call__(self, engine, plan: StepPlan, result: StepResult) -> None:
        predicted = self.sim.execute(plan).step_durations_s
        # The real executor's time excludes the engine's own per-step work, so the shadow's does too.
        self.predicted_s.append(sum(predicted) - len(predicted) * self.sim.cost.step_overhead_s)
        self.measured_s.append(result.elapsed_s)

    def error(self) -> float | None:
        """Predicted / measured - 1 over the whole run's executor time (None before any step)."""
        measured = sum(self.measured_s)
        return sum(self.predicted_s) / measured - 1 if measured > 0 else None
