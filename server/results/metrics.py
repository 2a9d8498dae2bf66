"""Serving metrics: per-request and per-step records of a run, summarized with the definitions and
JSON keys of `vllm bench serve` (vllm/benchmarks/serve.py, `calculate_metrics`), plus batchsim's
batch/memory view, partly under mlx-lm's names (prompt_tps, generation_tps, peak_memory).

Latency metrics (TTFT, TPOT, ITL, E2EL, queue) cover completed requests only (status "finished",
vLLM's `success`); a rejected, aborted or unfinished request counts in `failed` and nowhere else.
Empty distributions report 0, as vLLM's `np.mean(x or 0)` does."""

from __future__ import annotations

import collections
import hashlib
import math
from collections.abc import Mapping, Sequence
from operator import attrgetter
from typing import Any

import numpy as np
from batchsim.configs import ConfigError
from batchsim.server.results import request_arrays
from batchsim.server.results.records import MS_PER_S as _MS
from batchsim.server.results.records import REQUEST_STATUSES, RequestRecord, StepRecord

SLO_KEYS = ("ttft", "tpot", "e2el")  # goodput SLOs, in milliseconds, as vLLM's --goodput
_GB = 1e9  # mlx-lm prints peak memory in GB of 1e9 bytes


def peak_memory_bytes(summary: Mapping[str, Any]) -> int | None:
    """Peak memory in bytes (older summaries: GB only); None if unmeasured or damaged."""
    value, gb = summary.get("peak_memory_bytes"), summary.get("peak_memory")
    if type(value) is int and 0 <= value < 1 << 63:
        return value
    if type(gb) in (int, float) and 0 <= gb < (1 << 63) / _GB:  # NaN fails both
        return round(gb * _GB)
    return None


def percentile_label(p: float) -> str:
    """vLLM's key spelling: 99 -> "99", 99.0 -> "99", 99.9 -> "99.9"."""
    return str(int(p)) if int(p) == p else str(p)


def parse_goodput(items: Sequence[str] | str) -> dict[str, float]:
    """["ttft:500", "tpot:50"] (or "ttft:500,tpot:50") -> {"ttft": 500.0, "tpot": 50.0}, in ms."""
    if isinstance(items, str):
        items = items.replace(",", " ").split()
    slo: dict[str, float] = {}
    for item in items:
        key, sep, value = item.partition(":")
        key = key.strip()
        try:
            ms = float(value) if sep else math.nan
        except ValueError:
            ms = math.nan
        if key not in SLO_KEYS or not ms >= 0:
            raise ConfigError(f"goodput {item!r}: expected KEY:MILLISECONDS (a number >= 0) "
                              f"with KEY one of {', '.join(SLO_KEYS)}")
        if key in slo:
            raise ConfigError(f"goodput {item!r}: {key} given twice")
        slo[key] = ms
    return slo


def _rate(count: float, duration_s: float) -> float:
    return count / duration_s if duration_s > 0 else 0.0


def distribution(
    name: str, values_s: Sequence[float] | np.ndarray, percentiles: Sequence[float],
    counted: tuple[np.ndarray, np.ndarray] | None = None, overwrite: bool = False,
) -> dict[str, float]:
    """mean/median/std (population) and linear-interpolated percentiles, in ms, as vLLM
    (`counted`: the values' sorted_counts, if the caller has them: order_stats'; `overwrite`:
    `values_s`, a float64 array the caller no longer needs, holds the std's deviations)."""
    # One array for the sums, one sorted copy for the order statistics (a simulated hour has a
    # million ITLs).
    x: Any = np.asarray(values_s, dtype=np.float64) if len(values_s) else 0  # vLLM: np.mean(x or 0)
    median, ranks = request_arrays.order_stats(x if len(values_s) else (), percentiles, counted)
    out = {
        f"mean_{name}_ms": float(np.mean(x)) * _MS,
        f"median_{name}_ms": median * _MS,
        f"std_{name}_ms": (request_arrays.std_overwriting(x) if overwrite and len(values_s)
                           else float(np.std(x))) * _MS,
    }
    for p, v in zip(percentiles, ranks):
        out[f"p{percentile_label(p)}_{name}_ms"] = v * _MS
    return out


def _output_lengths(done: Sequence[RequestRecord], percentiles: Sequence[float]) -> dict[str, Any]:
    """Output tokens per completed request (mean, median, percentiles, max) and why requests ended
    ("stop": EOS or a stop string, "length": max_tokens): natural lengths when EOS is honoured."""
    # One array (np.mean, order_stats and np.max each made one from a list)
    x: Any = np.fromiter(map(attrgetter("num_output_tokens"), done), np.int64, len(done))
    median, ranks = request_arrays.order_stats(x, percentiles)
    out: dict[str, Any] = {"mean_output_tokens": float(np.mean(x if len(x) else 0)),
                           "median_output_tokens": median}
    for p, v in zip(percentiles, ranks):
        out[f"p{percentile_label(p)}_output_tokens"] = v
    out["max_output_tokens"] = int(np.max(x if len(x) else 0))
    reasons = collections.Counter(map(str, map(attrgetter("finish_reason"), done)))
    out["finish_reasons"] = {k: reasons[k] for k in sorted(reasons)}
    return out


def _num_good(done: Sequence[RequestRecord], slo_ms: Mapping[str, float]) -> int:
    """vLLM: good when every given SLO holds (value <= SLO); a 1-token request has TPOT 0."""
    good = 0
    for r in done:
        value_s = {"ttft": r.ttft_s, "tpot": r.tpot_s or 0.0, "e2el": r.e2el_s}
        good += all(value_s[k] <= ms / _MS for k, ms in slo_ms.items())
    return good


def _peaks(arrival_s: np.ndarray, e2el_s: np.ndarray, times: tuple[np.ndarray, np.ndarray]
           ) -> dict[str, float | int]:
    """vLLM's peaks over 1 s buckets counted from the first completed request's arrival: the most
    output tokens emitted in a bucket, and the most requests active (arrived, not yet ended) at some
    moment of a bucket, which can exceed the true peak concurrency. Either maximum may come from a
    different bucket. Completed requests only (arrivals, E2ELs, token times' sorted_counts)."""
    if not len(arrival_s):
        return {"max_output_tokens_per_s": 0.0, "max_concurrent_requests": 0}
    t0 = arrival_s.min()
    ends = arrival_s + e2el_s  # vLLM: start_time + latency
    n = int(np.ceil(ends.max() - t0)) + 1
    # Only the occupied buckets are counted: a run may span 2e9 simulated s (jsonio.MAX_CLOCK_S).
    # Whole seconds as floats: a time past int64's range (a row 1e20 s out) is no invalid cast.
    # Per distinct token time (a step's tokens share one), weighted by its tokens.
    buckets, counts = np.trunc(times[0] - t0), times[1]
    kept = (buckets >= 0) & (buckets <= n - 1)  # n - 1: a float (1e20 + 1 is not)
    buckets, counts = buckets[kept], counts[kept]
    if buckets.size and n <= 4 * counts.sum():  # a count per second of the run: as cheap
        tokens_max = np.bincount(buckets.astype(np.int64), weights=counts).max()
    else:
        slot = np.unique(buckets, return_inverse=True)[1]
        tokens_max = np.bincount(slot, weights=counts).max() if buckets.size else 0
    # Requests active in bucket b: arrived in a bucket <= b and ended in a bucket >= b; the count
    # changes only at the buckets where one arrives (+1) or the bucket after one ends (-1).
    if ends.max() - t0 < 2.0**52:  # whole seconds exact as int64
        points = np.concatenate([np.trunc(arrival_s - t0).astype(np.int64),
                                 np.trunc(ends - t0).astype(np.int64) + 1])
    else:  # Python's integers, past int64
        points = np.array([int(x) for x in arrival_s - t0] + [int(x) + 1 for x in ends - t0])
    where, slot = np.unique(points, return_inverse=True)
    delta = np.bincount(slot, weights=np.repeat([1.0, -1.0], len(arrival_s)))
    active = np.cumsum(delta.astype(np.int64))
    return {"max_output_tokens_per_s": float(tokens_max),
            "max_concurrent_requests": int(active[where < n].max())}


def _batch_view(
    requests: Sequence[RequestRecord], token_times: tuple[np.ndarray, ...],
    steps: Sequence[StepRecord], kv_budget_bytes: int | None, weight_bytes: int | None,
    peak_memory_bytes: int | None, col: dict[str, np.ndarray] | None = None,
    running_peak_kv_bytes: int | None = None,
) -> dict[str, Any]:
    """`token_times`: every request's token times, finished or not, as sorted_counts'."""
    col = col or request_arrays.step_columns(steps)
    decoding, num_steps = col["batch_size"] > 0, col["num_steps"]
    decode_steps = int(num_steps[decoding].sum())
    durations_s = col["end_s"] - col["start_s"]
    # Python's sum, step by step, as over the records (the same float)
    prompt_time_s = sum(durations_s[col["num_prefill_tokens"] > 0].tolist())
    # A step with both prefill and decode counts in both times (they share the forward pass).
    emits = request_arrays.emits_tokens(token_times[0], col["start_s"], col["end_s"])
    gen_time_s = sum(durations_s[decoding | emits].tolist())
    prompt_tokens = int((col["num_prefill_tokens"] * num_steps).sum())
    steps_kv = int(col["kv_bytes"].max()) if steps else 0
    peak_kv = steps_kv if running_peak_kv_bytes is None else running_peak_kv_bytes
    held = max(steps_kv, peak_kv)  # every KV byte held is at least either (a paged run's rows)
    measured = [s.kv_bytes_measured for s in steps if s.kv_bytes_measured is not None]
    peak, source = ((peak_memory_bytes, "measured") if peak_memory_bytes is not None
                    else (weight_bytes + held, "weights+kv") if weight_bytes is not None
                    else (None, None))  # weights+kv: an estimate, weights and every KV byte
    return {
        # Mean requests per decode forward pass, over the steps that decoded (a record with
        # num_steps > 1 counts that many times).
        "mean_batch_size": _rate(int((col["batch_size"] * num_steps).sum()), decode_steps),
        "max_batch_size": int(col["batch_size"].max()) if steps else 0,
        "num_engine_steps": int(num_steps.sum()),
        # Preemptions the scheduler decided, from the steps; the same total as the requests'
        # num_preemptions. Without step records (client-side runs) the requests' sum is used.
        "num_preemptions": int(col["num_preemptions"].sum()) if steps
        else sum(r.num_preemptions for r in requests),
        "peak_kv_bytes": peak_kv,  # a run's: its running requests' (KVManager.peak_running_bytes)
        "peak_kv_held_bytes": held,  # every KV byte held, the prefix cache's included
        "peak_kv_bytes_measured": max(measured) if measured else None,
        "kv_budget_bytes": kv_budget_bytes,
        "weight_bytes": weight_bytes,
        # mlx-lm's names. Prompt tokens include recompute after preemption; generation tokens are
        # every token emitted, failed requests included; each rate divides by the summed durations
        # of the steps that prefilled, or that decoded or sampled a token.
        "prompt_tokens": prompt_tokens,
        "prompt_tps": _rate(prompt_tokens, prompt_time_s),
        "generation_tokens": (generated := int(token_times[1].sum())),
        "generation_tps": _rate(generated, gen_time_s),
        "peak_memory_bytes": peak,
        "peak_memory": None if peak is None else peak / _GB,  # in GB (1e9): mlx-lm's, kept
        "peak_memory_source": source,  # "measured" | "weights+kv" (an estimate) | None
    }


def summarize(
    requests: Sequence[RequestRecord],
    steps: Sequence[StepRecord],
    *,
    duration_s: float,
    percentiles: Sequence[float] = (50, 90, 95, 99),
    goodput_slo_ms: Mapping[str, float] | None = None,
    kv_budget_bytes: int | None = None,
    weight_bytes: int | None = None,
    peak_memory_bytes: int | None = None,
    peak_rss_bytes: int | None = None,
    run_tokens: request_arrays.RunTokens | None = None,
    step_columns: dict[str, np.ndarray] | None = None,
    running_peak_kv_bytes: int | None = None,  # KVManager.peak_running_bytes (None: the steps')
) -> dict[str, Any]:
    """One run's summary. `duration_s` is the benchmark duration (vLLM: start until the last request
    ends); every throughput divides by it, and is 0 when it is 0. `request_goodput` is None unless
    SLOs are given, as in vLLM's JSON. `run_tokens`: the RunTokens of `requests` (every request
    finished: its counts and ITLs without the token times), `step_columns`:
    request_arrays.step_columns(steps, ...) with its STEP_INTS at least, if the caller has them."""
    slo = parse_goodput([f"{k}:{v}" for k, v in goodput_slo_ms.items()]) if goodput_slo_ms else None
    done = [r for r in requests if r.status == "finished"]
    every, itl, mine, itl_counts, first_last_s = _token_arrays(
        requests, len(done) == len(requests), run_tokens)
    lat = request_arrays.latencies_s(done, first_last_s)  # queue: arrival to first scheduled
    statuses = collections.Counter(map(attrgetter("status"), requests))  # no generator's frames
    total_in = sum(map(attrgetter("num_prompt_tokens"), done))
    total_out = sum(map(attrgetter("num_output_tokens"), done))
    out: dict[str, Any] = {
        "duration": duration_s,
        "completed": len(done),
        "failed": len(requests) - len(done),
        **{f"num_{s}": statuses[s] for s in REQUEST_STATUSES[1:]},
        "total_input_tokens": total_in,
        "total_output_tokens": total_out,
        "request_throughput": _rate(len(done), duration_s),
        "request_goodput": None if slo is None else _rate(_num_good(done, slo), duration_s),
        "goodput_slo_ms": slo,
        "output_throughput": _rate(total_out, duration_s),
        "total_token_throughput": _rate(total_in + total_out, duration_s),
        **_peaks(lat["arrival"], lat["e2el"], every if mine is None else mine),
    }
    latencies_s = {"ttft": lat["ttft"], "tpot": lat["tpot"],
                   "itl": itl,  # pooled over requests, as vLLM
                   "e2el": lat["e2el"], "queue": lat["queue"]}
    for name, values in latencies_s.items():
        out.update(distribution(name, values, percentiles,  # type: ignore[arg-type]
                                itl_counts if name == "itl" else None, name == "itl"))
    out.update(_output_lengths(done, percentiles))
    if "p99_queue_ms" not in out:  # always reported, whatever the percentiles
        out["p99_queue_ms"] = request_arrays.order_stats(latencies_s["queue"], (99,))[1][0] * _MS
    out.update(_batch_view(requests, every, steps, kv_budget_bytes, weight_bytes,
                           peak_memory_bytes, step_columns, running_peak_kv_bytes))
    out["peak_rss_bytes"] = peak_rss_bytes  # the process's peak resident memory (real compute)
    return out


def _token_arrays(requests: Sequence[RequestRecord], all_finished: bool,
                  run_tokens: request_arrays.RunTokens | None) -> tuple[Any, ...]:
    """_finished_tokens' three, then the ITLs' sorted_counts and the requests' first and last
    token times where the run's RunTokens give them (every request finished), else None."""
    if run_tokens is not None and all_finished:
        return (run_tokens.counts(), run_tokens.itls(), None, run_tokens.itl_counts(),
                run_tokens.first_last_s())
    return (*_finished_tokens(requests, run_tokens.times() if run_tokens else None, all_finished),
            None, None)


def _finished_tokens(requests: Sequence[RequestRecord],
                     token_times_s: tuple[np.ndarray, ...] | None, all_finished: bool
                     ) -> tuple[tuple[np.ndarray, np.ndarray], np.ndarray,
                                tuple[np.ndarray, np.ndarray] | None]:
    """Every token time's sorted_counts, the finished requests' ITLs, and their token times'
    sorted_counts (None: every token is a finished request's, as where `all_finished`)."""
    all_times, all_owner, *ranked = token_times_s or request_arrays.token_times(requests)
    mine = None  # None: every token
    if not all_finished:
        finished = np.array([r.status == "finished" for r in requests], dtype=bool)
        mine = None if (m := finished[all_owner]).all() else m
    times, owner = (all_times, all_owner) if mine is None else (all_times[mine], all_owner[mine])
    every = ranked[0] if ranked else request_arrays.sorted_counts(np.sort(all_times))
    return every, request_arrays.itls(times, owner), (
        None if mine is None else request_arrays.sorted_counts(np.sort(times)))


def output_tokens_sha256(output_ids: Mapping[int, Sequence[int]]) -> str:
    """sha256 over request ids and their output token ids, in request-id order: two runs with the
    same digest produced the same tokens for every request."""
    h = hashlib.sha256()
    for rid in sorted(output_ids):
        h.update(f"{rid}:{','.join(map(str, output_ids[rid]))};".encode())
    return h.hexdigest()
