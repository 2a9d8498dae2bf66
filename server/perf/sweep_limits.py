"""Arithmetic of `batchsim sweep` (pure, no MLX): the analytic batch limit of a fixed-length
workload under a memory budget, the batch sizes to measure, and how to read the measured points
(a row per batch, overrun, agreement with the analytic limit, where throughput stops scaling)."""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence
from typing import Any

from batchsim.scheduler.kv_bytes import CacheLayout
from batchsim.scheduler.pool_geometry import KV_STEP, padded_batch_bytes, round_up
from batchsim.server.results.records import RequestRecord, StepRecord
from batchsim.server.results.timeline import admitted_per_step


def seq_kv_tokens(prompt_len: int, output_len: int) -> int:
    """Tokens of KV one sequence holds at its longest, padded to KV_STEP: prompt + output - 1 (the
    last sampled token is never fed back). Its private prefill cache, round_up(prompt), is never
    larger, so the decode pool at full length is the per-sequence peak."""
    return round_up(prompt_len + max(output_len - 1, 0), KV_STEP)


def batch_kv_bytes(batch: int, prompt_len: int, output_len: int, kv_bytes_per_token: int) -> int:
    """The decode pool of `batch` rows at full length with no spare rows (what the scheduler falls
    back to when the budget binds, see pool_geometry.next_geometry)."""
    length = prompt_len + max(output_len - 1, 0)
    return padded_batch_bytes([length] * batch, kv_bytes_per_token)


def analytic_max_batch(memory_budget_bytes: int, weight_bytes: int, prompt_len: int,
                       output_len: int, kv_bytes_per_token: int,
                       draft: CacheLayout | None = None) -> int:
    """The largest batch whose weights + KV at full length fit the budget (0: not even one);
    `draft`: a draft model's cache, one padded row beside each sequence (CacheLayout.draft)."""
    per_seq = _seq_bytes(prompt_len, output_len, kv_bytes_per_token, draft)
    return max(0, (memory_budget_bytes - weight_bytes) // per_seq)


def budget_for_limit(limit_batch: int, weight_bytes: int, prompt_len: int, output_len: int,
                     kv_bytes_per_token: int, draft: CacheLayout | None = None) -> int:
    """A memory budget whose analytic limit (analytic_max_batch, `draft` as there) is exactly
    `limit_batch`: weights + limit_batch sequences + half a sequence, so byte rounding cannot
    move the limit."""
    per_seq = _seq_bytes(prompt_len, output_len, kv_bytes_per_token, draft)
    return weight_bytes + limit_batch * per_seq + per_seq // 2


def _seq_bytes(prompt_len: int, output_len: int, kv_bytes_per_token: int,
               draft: CacheLayout | None) -> int:
    """One sequence's KV at full length, with its draft model's padded row if any."""
    per_seq = batch_kv_bytes(1, prompt_len, output_len, kv_bytes_per_token)
    if draft is not None:
        per_seq += draft.seq_bytes(seq_kv_tokens(prompt_len, output_len))
    return per_seq


def default_batches(limit_batch: int, max_batch: int, *more_limits: int) -> list[int]:
    """1, 2, 4, ... up to the first power of two past the largest limit + 2, plus limit - 1 ..
    limit + 2 of each limit (a sweep with a draft model: plain batching's and the speculative
    points'); everything capped at max_batch."""
    limits = (limit_batch, *more_limits)
    points = {lim + d for lim in limits for d in (-1, 0, 1, 2)}
    b = 1
    while True:
        points.add(b)
        if b > max(limits) + 2:
            break
        b *= 2
    return sorted(p for p in points if 1 <= p <= max_batch)


def _position(batches: Sequence[int], batch: int | None) -> int:
    """Index of `batch` in the sorted list; len(batches) for None (past the end)."""
    return len(batches) if batch is None else list(batches).index(batch)


def analytic_first_overrun(batches: Sequence[int], limit_batch: int) -> int | None:
    """The first listed batch above the analytic limit (None: every listed batch fits)."""
    return next((b for b in batches if b > limit_batch), None)


def agree_within_one_step(batches: Sequence[int], limit_batch: int,
                          measured_overrun: int | None) -> bool:
    """The first listed batch past the analytic limit and the first one measured to queue or
    preempt are the same point or neighbours in the list (None counts as 'past the end')."""
    analytic = _position(batches, analytic_first_overrun(batches, limit_batch))
    return abs(analytic - _position(batches, measured_overrun)) <= 1


def scaling_stop(batches: Sequence[int], decoded_batches: Sequence[int],
                 tok_s: Sequence[float | None], min_gain: float) -> int | None:
    """The first point (its requested batch) whose decode tok/s gains less than `min_gain` per
    doubling of the decoded batch over the previous point; a point that decoded no larger batch
    than the previous one has stopped by definition. Points without a rate are skipped."""
    prev: tuple[int, float] | None = None
    for b, decoded, rate in zip(batches, decoded_batches, tok_s):
        if rate is None or decoded <= 0:
            continue
        if prev is not None:
            prev_decoded, prev_rate = prev
            if decoded <= prev_decoded:
                return b
            if rate < prev_rate * (1 + min_gain * math.log2(decoded / prev_decoded)):
                return b
        prev = (decoded, rate)
    return None


def steady_decode(steps: list[StepRecord], batch: int) -> tuple[float | None, float | None]:
    """(decode tok/s, step ms): the median over pure-decode steps of `batch` rows."""
    step_s = [s.duration_s / s.num_steps for s in steps
              if s.batch_size == batch and s.num_prefill_tokens == 0 and s.duration_s > 0]
    if not step_s:
        return None, None
    mid = statistics.median(step_s)
    return batch / mid, mid * 1e3


def memory_wait_steps(steps: Sequence[StepRecord], admitted: Sequence[int], batch: int,
                      max_num_batched_tokens: int, next_chunk: int) -> int:
    """Plans that left a request waiting although a seat and the token budget for another prefill
    chunk were free: the KV budget held it back (not the per-step token budget). A request that
    waits after a step may have arrived during it (a real run's arrivals come while a step runs):
    only the next plan shows whether it was held. That plan saw the previous step's waiting
    requests and admitted `admitted` of them (admitted_per_step)."""
    return sum(1 for before, s, n in zip(steps, steps[1:], admitted[1:])
               if n < before.num_waiting and before.num_running + n < batch
               and s.batch_size + s.num_prefill_tokens + next_chunk <= max_num_batched_tokens)


def point_row(batch: int, summary: dict[str, Any], steps: list[StepRecord],
              requests: list[RequestRecord], max_num_batched_tokens: int, next_chunk: int,
              active_bytes: int | None) -> dict:
    """One sweep point from its run's summary and step records. Overrun: the batch was never
    decoded together (queued), or a request was preempted or rejected."""
    decoded = summary["max_batch_size"]
    tok_s, step_ms = steady_decode(steps, decoded)
    source = "steady"
    if tok_s is None:
        tok_s, source = summary["generation_tps"] or None, "generation_tps"
    queued = decoded < batch  # never decoded all B together: memory capped the batch
    preempted = summary["num_preemptions"] > 0
    rejected = summary["num_rejected"] > 0
    return {
        "batch": batch, "decoded_batch": decoded, "decode_tok_s": tok_s,
        "decode_tok_s_source": source, "step_ms": step_ms,
        "median_tpot_ms": summary["median_tpot_ms"],
        "output_throughput": summary["output_throughput"],
        "kv_bytes": summary["peak_kv_held_bytes"],  # every byte held, as kv_bytes_measured counts
        "kv_bytes_measured": summary["peak_kv_bytes_measured"],
        "peak_memory_bytes": summary["peak_memory_bytes"],
        "peak_memory_source": summary["peak_memory_source"], "active_memory_bytes": active_bytes,
        "queued": queued, "preempted": preempted, "rejected": rejected,
        "overrun": queued or preempted or rejected,
        "num_preemptions": summary["num_preemptions"],
        "memory_wait_steps": memory_wait_steps(steps, admitted_per_step(steps, requests), batch,
                                               max_num_batched_tokens, next_chunk),
        "p99_queue_ms": summary["p99_queue_ms"], "completed": summary["completed"],
        "duration_s": summary["duration"], "run_dir": summary["run_dir"],
    }


def mean_decode_width(prompt_len: int, output_len: int) -> float:
    """Mean tokens a sweep request's decode steps read: positions prompt .. prompt + output - 2,
    each reading itself too (the first output token comes from the prefill). A pure-decode step
    costs base + per-token x width, so `batchsim size --context` this predicts the sweep's
    steady decode tok/s."""
    return prompt_len + output_len / 2
