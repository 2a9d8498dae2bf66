"""Decode throughput at a fixed batch, three ways on the same model and prompts:
- bare: a loop of model forward calls on one batched mlx-lm KVCache (the floor for any engine),
- executor: batchsim's scheduler + MLX executor (decode pool, one forward pass per step),
- executor_paged: the same with `--kv-layout paged` (blocks gathered per step),
- mlx_lm: mlx-lm's own continuous batching (`BatchGenerator`).
Each prepares its batch once (prefill, warm-up), then times windows of decode steps on demand, so
a benchmark can interleave the modes window by window."""

from __future__ import annotations

import time

import mlx.core as mx
import numpy as np
from batchsim.scheduler.config import SchedulerConfig
from batchsim.scheduler.kv_bytes import CacheLayout
from batchsim.scheduler.request import Request, SamplingParams
from batchsim.scheduler.scheduler import Scheduler
from batchsim.server.executors.mlx_executor import MLXExecutor
from mlx_lm.models.cache import make_prompt_cache

WARMUP_STEPS = 2
MAX_STEPS = 4096  # generation budget per sequence; a benchmark stops far earlier


def prompts(batch: int, context: int, vocab: int, seed: int = 0) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return rng.integers(0, vocab, size=(batch, context)).tolist()


class Bare:
    def __init__(self, model, batch: int, context: int, vocab: int):
        self.model, self.batch = model, batch
        self.cache = make_prompt_cache(model)
        x = mx.array(prompts(batch, context, vocab))
        self.y = mx.argmax(model(x, cache=self.cache)[:, -1, :], axis=-1)
        mx.eval(self.y)
        self.steps(WARMUP_STEPS)

    def steps(self, n: int) -> float:
        t0 = time.perf_counter()
        for _ in range(n):
            self.y = mx.argmax(self.model(self.y[:, None], cache=self.cache)[:, -1, :], axis=-1)
            mx.eval(self.y)
        return time.perf_counter() - t0


class Executor:
    def __init__(self, model, batch: int, context: int, vocab: int, kv_bytes_per_token: int,
                 cache_layout: CacheLayout | None = None, kv_layout: str = "padded"):
        self.batch = batch
        # The whole batch prefills in one step, as in the other two modes, so all three decode rows
        # at one position; rows that joined over several steps are `--continuous`'s case.
        self.sched = Scheduler(SchedulerConfig(
            kv_budget_bytes=1 << 50, kv_bytes_per_token=kv_bytes_per_token, max_model_len=1 << 20,
            max_num_seqs=batch, max_num_batched_tokens=max(2048, batch * context),
            prefill_step_size=512,
            cache_layout=cache_layout, kv_layout=kv_layout,
        ))
        self.ex = MLXExecutor(model, kv_layout=kv_layout)
        for i, ids in enumerate(prompts(batch, context, vocab)):
            sp = SamplingParams(max_tokens=MAX_STEPS, ignore_eos=True)
            self.sched.add_request(Request(i, context, sp, 0.0, prompt_token_ids=ids))
        while not self._full_decode():
            self._step()
        self.steps(WARMUP_STEPS)

    def _full_decode(self) -> bool:
        running = self.sched.running
        return len(running) == self.batch and all(
            r.num_tokens - r.num_computed_tokens == 1 for r in running)

    def _step(self) -> None:
        plan = self.sched.schedule()
        self.sched.update_from_output(plan, self.ex.execute(plan))

    def steps(self, n: int) -> float:
        t0 = time.perf_counter()
        for _ in range(n):
            self._step()
        return time.perf_counter() - t0


class MlxLmBatchGenerator:
    def __init__(self, model, batch: int, context: int, vocab: int):
        from mlx_lm.generate import BatchGenerator

        self.batch = batch
        self.gen = BatchGenerator(model, max_tokens=MAX_STEPS, completion_batch_size=batch,
                                  prefill_batch_size=batch, prefill_step_size=2048)
        self.gen.insert(prompts(batch, context, vocab))
        while len(self.gen._generation_batch) < batch:
            self.gen.next_generated()
        self.steps(WARMUP_STEPS)

    def steps(self, n: int) -> float:
        t0 = time.perf_counter()
        for _ in range(n):
            if len(self.gen.next_generated()) != self.batch:
                raise RuntimeError("mlx-lm's batch changed size during the benchmark")
        return time.perf_counter() - t0

    def close(self) -> None:
        self.gen.close()


def continuous_lengths(n: int, seed: int = 0, low: int = 16, high: int = 64) -> list[int]:
    return np.random.default_rng(seed).integers(low, high + 1, size=n).tolist()


def continuous_executor(model, batch: int, context: int, vocab: int, kv_bytes_per_token: int,
                        out_lens: list[int], cache_layout: CacheLayout | None = None,
                        spec: tuple | None = None) -> tuple[int, float]:
    """All requests queued at once, at most `batch` running: (tokens generated, seconds).
    `spec`: (drafter, K, policy) for speculative decoding (speculative.py)."""
    drafter, k, policy = spec or (None, 0, "shrink")
    sched = Scheduler(SchedulerConfig(
        kv_budget_bytes=1 << 50, kv_bytes_per_token=kv_bytes_per_token, max_model_len=1 << 20,
        max_num_seqs=batch, max_num_batched_tokens=2048, prefill_step_size=512,
        cache_layout=cache_layout, spec_tokens=k, spec_policy=policy,
    ))
    ex = MLXExecutor(model, drafter=drafter)
    for i, (ids, n) in enumerate(zip(prompts(len(out_lens), context, vocab, seed=1), out_lens)):
        sched.add_request(Request(i, context,
                                  SamplingParams(max_tokens=n, ignore_eos=True), 0.0, ids))
    t0 = time.perf_counter()
    while sched.has_work():
        plan = sched.schedule()
        sched.update_from_output(plan, ex.execute(plan))
    return sum(out_lens), time.perf_counter() - t0


def continuous_mlx_lm(model, batch: int, context: int, vocab: int,
                      out_lens: list[int]) -> tuple[int, float]:
    from mlx_lm.generate import BatchGenerator

    gen = BatchGenerator(model, max_tokens=max(out_lens), completion_batch_size=batch,
                         prefill_step_size=2048)
    try:
        gen.insert(prompts(len(out_lens), context, vocab, seed=1), max_tokens=out_lens)
        t0 = time.perf_counter()
        tokens, done = 0, 0
        while done < len(out_lens):
            responses = gen.next_generated()
            tokens += len(responses)
            done += sum(r.finish_reason is not None for r in responses)
        return tokens, time.perf_counter() - t0
    finally:
        gen.close()
