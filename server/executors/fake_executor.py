"""An executor that computes nothing: deterministic tokens, a fixed (default zero) step time, and
the KV bytes the plan says. It drives policy tests and measures the scheduler's own overhead."""

from __future__ import annotations

import math

from batchsim.scheduler.plan import StepPlan, StepResult
from batchsim.scheduler.pool_geometry import PAGE_TOKENS
from batchsim.server.executors.base import ExecutorCaps


class FakeExecutor:
    def __init__(self, step_s: float = 0.0, vocab_size: int = 32000, max_lookahead_steps: int = 1,
                 virtual_time: bool = False):
        # Either clock: `batchsim run --executor fake` runs in real time (the engine's own
        # overhead is what it measures); policy tests skip the waiting.
        self.caps = ExecutorCaps(real_compute=False, virtual_time=virtual_time,
                                 max_lookahead_steps=max_lookahead_steps, needs_token_ids=False)
        self.step_s = step_s
        self.vocab_size = vocab_size
        self._kv_bytes = 0
        self.positions: dict[int, int] = {}  # request id -> tokens cached (checks plan consistency)

    @staticmethod
    def token_for(request_id: int, position: int, vocab_size: int) -> int:
        """The token a request 'samples' at a position: same alone or batched, before or after a
        preemption, like greedy decoding on a real model."""
        return (request_id * 7919 + position * 104729) % vocab_size

    def execute(self, plan: StepPlan, max_elapsed_s: float = float("inf")) -> StepResult:
        for rid in plan.free_ids:
            self.positions.pop(rid, None)
        for new in plan.new_requests:  # a prefix-cache hit: its blocks are already computed
            self.positions[new.request_id] = len(new.cached_hashes) * PAGE_TOKENS
        steps = 1
        if plan.num_steps > 1 and self.step_s > 0:
            horizon_steps = max_elapsed_s / self.step_s  # run the steps that start before it
            steps = (plan.num_steps if horizon_steps >= plan.num_steps
                     else max(1, math.ceil(horizon_steps)))
        elif plan.num_steps > 1:
            steps = plan.num_steps
        prefill_sampled: list[int] = []
        for chunk in plan.prefills:
            if self.positions.get(chunk.request_id) != chunk.start:
                raise AssertionError(f"request {chunk.request_id}: chunk at {chunk.start}, cache "
                                     f"holds {self.positions.get(chunk.request_id)}")
            self.positions[chunk.request_id] = chunk.start + chunk.num_tokens
            if chunk.sample:
                prefill_sampled.append(chunk.request_id)
        for rid, pos in zip(plan.decode_ids, plan.decode_positions):
            if self.positions.get(rid) != pos:
                raise AssertionError(f"request {rid}: decode at {pos}, cache holds "
                                     f"{self.positions.get(rid)}")
            self.positions[rid] = pos + steps
        tokens = []  # in StepResult's order: the decode rows, then the sampling prefills
        for s in range(steps):
            row = [self.token_for(rid, pos + s + 1, self.vocab_size)
                   for rid, pos in zip(plan.decode_ids, plan.decode_positions)]
            row += [self.token_for(rid, self.positions[rid], self.vocab_size)
                    for rid in prefill_sampled]
            tokens.append(tuple(row))
        self._kv_bytes = plan.kv_bytes
        sampled = (*plan.decode_ids, *prefill_sampled)
        return StepResult(plan.step_index, sampled, tuple(tokens),
                          tuple([self.step_s] * steps), plan.kv_bytes)

    def end_run(self) -> None:
        self.reset()

    def reset(self) -> None:
        self.positions.clear()
        self._kv_bytes = 0

    def kv_bytes(self) -> int:
        return self._kv_bytes
