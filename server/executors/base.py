"""The one interface between the scheduler's plans and whatever runs or predicts them."""

from __future__ import annotations

from typing import Protocol

from batchsim.scheduler.plan import StepPlan, StepResult


class Executor(Protocol):
    name: str  # "mlx" | "sim" | "fake"
    # Pure-decode steps one plan may stand for (1 unless the executor can skip ahead).
    max_lookahead_steps: int
    # Whether plans must carry token ids (real compute) or only counts (simulation).
    needs_token_ids: bool

    def execute(self, plan: StepPlan, max_elapsed_s: float = float("inf")) -> StepResult:
        """Run one plan. A multi-step plan runs the steps that start before `max_elapsed_s` (at
        least one): what arrives meanwhile waits for the next plan, as on a real server."""
        ...

    def kv_bytes(self) -> int:
        """KV bytes held now, counted from the executor's own state."""
        ...

    def reset(self) -> None:
        """Drop every request and all KV (after a failed step)."""
        ...
