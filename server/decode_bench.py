"""Decode throughput at a fixed batch, three ways on the same model and prompts:
- bare: a loop of model forward calls on one batched mlx-lm KVCache (the floor for any engine),
- executor: batchsim's scheduler + MLX executor (decode pool, one forward pass per step),
- mlx_lm: mlx-lm's own continuous batching (`BatchGenerator`).
Each returns decode tokens/s over `steps` steps after prefill and warm-up."""

from __future__ import annotations

import time

import mlx.core as mx
import numpy as np
from mlx_lm.models.cache import make_prompt_cache

from scheduler.config import SchedulerConfig
from scheduler.request import Request, SamplingParams
from scheduler.scheduler import Scheduler
from server.mlx_executor import MLXExecutor

WARMUP_STEPS = 2


def prompts(batch: int, context: int, vocab: int, seed: int = 0) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return rng.integers(0, vocab, size=(batch, context)).tolist()


def bare(model, batch: int, context: int, steps: int, vocab: int) -> float:
    cache = make_prompt_cache(model)
    x = mx.array(prompts(batch, context, vocab))
    y = mx.argmax(model(x, cache=cache)[:, -1, :], axis=-1)
    mx.eval(y)
    for i in range(WARMUP_STEPS + steps):
        if i == WARMUP_STEPS:
            t0 = time.perf_counter()
        y = mx.argmax(model(y[:, None], cache=cache)[:, -1, :], axis=-1)
        mx.eval(y)
    return batch * steps / (time.perf_counter() - t0)


def executor(model, batch: int, context: int, steps: int, vocab: int, kv_bytes_per_token: int) -> float:
    cfg = SchedulerConfig(
        kv_budget_bytes=1 << 50, kv_bytes_per_token=kv_bytes_per_token, max_model_len=1 << 20,
        max_num_seqs=batch, max_num_batched_tokens=max(2048, batch), prefill_step_size=512,
    )
    sched, ex = Scheduler(cfg), MLXExecutor(model)
    for i, ids in enumerate(prompts(batch, context, vocab)):
        sp = SamplingParams(max_tokens=steps + WARMUP_STEPS + 2, ignore_eos=True)
        sched.add_request(Request(i, context, sp, 0.0, prompt_token_ids=ids))
    decoded = 0
    while decoded < WARMUP_STEPS + steps:
        plan = sched.schedule()
        full = len(plan.decode_ids) == batch and not plan.prefills
        if full and decoded == WARMUP_STEPS:
            t0 = time.perf_counter()
        sched.update_from_output(plan, ex.execute(plan))
        decoded += full
    return batch * steps / (time.perf_counter() - t0)


def mlx_lm_batch_generator(model, batch: int, context: int, steps: int, vocab: int) -> float:
    from mlx_lm.generate import BatchGenerator

    gen = BatchGenerator(model, max_tokens=steps + WARMUP_STEPS + 4, completion_batch_size=batch,
                         prefill_batch_size=batch, prefill_step_size=2048)
    try:
        gen.insert(prompts(batch, context, vocab))
        decoded = 0
        while decoded < WARMUP_STEPS + steps:
            full = len(gen._generation_batch) == batch  # noqa: SLF001 (no public batch-size accessor)
            if full and decoded == WARMUP_STEPS:
                t0 = time.perf_counter()
            responses = gen.next_generated()
            decoded += full and len(responses) == batch
        return batch * steps / (time.perf_counter() - t0)
    finally:
        gen.close()
