"""Every rank runs the same plans on its shard of the model. Rank 0 (the scheduler's rank) wraps
its executor in LeaderExecutor, which broadcasts each plan before running it; the other ranks
run `follow`. With tensor parallelism the logits after each layer's all-reduce are the same on
every rank, so every rank samples the same tokens; rank 0 sends its tokens with the next plan and
a follower that sampled others stops with an error."""

from __future__ import annotations

import os
import signal
from typing import Any, NamedTuple

import mlx.core as mx
from batchsim.configs import ConfigError
from batchsim.scheduler.plan import StepPlan, StepResult
from batchsim.server.distributed.channel import STOP, PlanChannel
from batchsim.server.distributed.watchdog import Watchdog


class PlanMessage(NamedTuple):
    plan: StepPlan | None  # None: the run is over
    # Rank 0's tokens from the previous step, for the followers to check theirs against.
    previous_token_ids: tuple[tuple[int, ...], ...] | None


def shard_for(group: Any, name: str):
    """The prepare_model hook: mlx-lm's tensor-parallel `model.shard(group)`, or a refusal."""

    def shard(model: Any) -> Any:
        size = group.size()
        if not hasattr(model, "shard"):
            raise ConfigError(f"model {name}: mlx-lm's {type(model).__module__.split('.')[-1]} has "
                              "no tensor-parallel shard(); run it on one rank (pipeline mode is "
                              "not wired into the batched executor yet)")
        attn = model.layers[0].self_attn
        heads = (getattr(attn, "n_heads", None), getattr(attn, "n_kv_heads", None))
        if any(h is not None and h % size for h in heads):
            raise ConfigError(f"model {name}: {heads[0]} query / {heads[1]} KV heads do not split "
                              f"across {size} ranks")
        model.shard(group)
        # slice now: a lazy shard would run on the loading thread's stream
        mx.eval(model.parameters())
        return model

    return shard


class LeaderExecutor:
    """Rank 0's executor: broadcast the plan, then run it on rank 0's shard."""

    def __init__(self, inner: Any, channel: PlanChannel, watchdog: Watchdog):
        self.inner = inner
        self.caps = inner.caps
        self.channel = channel
        self.watchdog = watchdog
        self._previous: tuple[tuple[int, ...], ...] | None = None
        self._failure: Exception | None = None

    def __getattr__(self, name: str) -> Any:  # dtype, kv_bytes_per_token, pool, ...
        return getattr(self.inner, name)

    def execute(self, plan: StepPlan, max_elapsed_s: float = float("inf")) -> StepResult:
        self.watchdog.arm(f"rank 0: step {plan.step_index}")
        try:
            self.channel.send(PlanMessage(plan, self._previous))
            result = self.inner.execute(plan, max_elapsed_s)
        except Exception as exc:
            self._failure = exc  # a server's engine resets after a failed step: reset() says why
            raise
        finally:
            self.watchdog.disarm()
        self._previous = result.token_ids
        return result

    def kv_bytes(self) -> int:
        return self.inner.kv_bytes()

    def reset(self) -> None:
        cause = f" after: {self._failure}" if self._failure else ""
        raise RuntimeError(f"a multi-rank run cannot reset one rank's executor; it stops{cause}")

    def end_run(self) -> None:
        self.inner.end_run()

    def stop(self) -> None:
        """Tell the followers the run is over (with the last step's tokens to check)."""
        self.watchdog.arm("rank 0: the message that ends the run")
        try:
            self.channel.send(PlanMessage(STOP, self._previous))
        finally:
            self.watchdog.disarm()


def follow(inner: Any, channel: PlanChannel, watchdog: Watchdog,
           die_at_step: int | None = None) -> int:
    """A follower's loop: run every plan rank 0 sends until it says stop; returns the steps run.
    `die_at_step`: the fault tests' hook, this rank kills itself (SIGKILL) at that step."""
    previous: tuple[tuple[int, ...], ...] | None = None
    steps = 0
    while True:
        # Armed once rank 0 rang: a rank 0 that stops mid-message must not hold this one forever.
        message: PlanMessage = channel.recv(
            on_wake=lambda: watchdog.arm(f"rank {channel.rank}: a plan from rank 0"))
        watchdog.disarm()
        if message.previous_token_ids != previous:
            raise RuntimeError(f"rank {channel.rank} sampled other tokens than rank 0 at step "
                               f"{steps - 1}: the ranks diverged")
        if message.plan is STOP:
            return steps
        if steps == die_at_step:
            os.kill(os.getpid(), signal.SIGKILL)
        watchdog.arm(f"rank {channel.rank}: step {message.plan.step_index}")
        try:
            previous = inner.execute(message.plan).token_ids
        finally:
            watchdog.disarm()
        steps += 1
