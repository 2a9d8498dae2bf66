"""The one interface between the scheduler's plans and whatever runs or predicts them."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

from batchsim.scheduler.plan import StepPlan, StepResult


@dataclass(frozen=True)
class ExecutorCaps:
    """What an executor can do; code asks these, never the executor's kind."""

    # Runs the model on the device: MLX memory statistics describe it, a server can serve it.
    real_compute: bool
    # Step durations are predicted, not waited for: the engine advances a virtual clock.
    virtual_time: bool
    # Pure-decode steps one plan may stand for (1 unless the executor can skip ahead).
    max_lookahead_steps: int
    # Plans must carry token ids (real compute), not only counts (simulation).
    needs_token_ids: bool


class ExecutorLost(RuntimeError):
    """A step failed for a reason its message says in full (a peer rank lost): a server logs it
    in one line, not as a traceback."""


class Executor(Protocol):
    caps: ExecutorCaps

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

    def end_run(self) -> None:
        """The run is over: drop its requests and KV, and finish what the calling thread queued
        (the engine's thread and its MLX streams end with the run; `validate` runs its next case
        on this executor from another thread)."""
        ...
