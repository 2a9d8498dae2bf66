"""Serving metrics: per-request and per-step records of a run, summarized with the definitions and
JSON keys of `vllm bench serve` (vllm/benchmarks/serve.py, `calculate_metrics`), plus batchsim's
batch/memory view, partly under mlx-lm's names (prompt_tps, generation_tps, peak_memory).

Latency metrics (TTFT, TPOT, ITL, E2EL, queue) cover completed requests only (status "finished",
vLLM's `success`); a rejected, aborted or unfinished request counts in `failed` and nowhere else.
Empty distributions report 0, as vLLM's `np.mean(x or 0)` does."""

from __future__ import annotations

import collections
import dataclasses
import functools
import hashlib
import itertools
import math
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
from batchsim.configs import ConfigError
from batchsim.server.results import request_arrays

REQUEST_STATUSES = ("finished", "rejected", "aborted", "unfinished")
SLO_KEYS = ("ttft", "tpot", "e2el")  # goodput SLOs, in milliseconds, as vLLM's --goodput
_MS = 1000.0
_GB = 1e9  # mlx-lm prints peak memory in GB of 1e9 bytes


def peak_memory_bytes(summary: Mapping[str, Any]) -> int | None:
    """Peak memory in bytes (older summaries: GB only); None if unmeasured or damaged."""
    value, gb = summary.get("peak_memory_bytes"), summary.get("peak_memory")
    if type(value) is int and 0 <= value < 1 << 63:
        return value
    if type(gb) in (int, float) and 0 <= gb < (1 << 63) / _GB:  # NaN fails both
        return round(gb * _GB)
    return None


DERIVED_MS_KEYS = ("ttft_ms", "tpot_ms", "e2el_ms", "queue_ms")  # a request line's, after fields


@dataclasses.dataclass(frozen=True, slots=True)
class RequestRecord:
    """One request's timeline; times are seconds on the run's clock (0 = start of the run)."""

    request_id: int
    status: str  # one of REQUEST_STATUSES; "unfinished": still in flight when the run stopped
    arrival_s: float  # when the client sent it (vLLM's start_time)
    first_scheduled_s: float | None  # first step that ran it (a preemption does not reset it)
    token_times_s: tuple[float, ...]  # emission time of each output token, in order
    finished_s: float | None  # when it left the engine (finished, rejected or aborted)
    num_prompt_tokens: int
    num_output_tokens: int
    num_preemptions: int = 0
    finish_reason: str | None = None

    def __post_init__(self) -> None:
        if self.status not in REQUEST_STATUSES:
            raise ValueError(f"request {self.request_id}: status {self.status!r} "
                             f"not in {REQUEST_STATUSES}")
        if len(self.token_times_s) != self.num_output_tokens:
            raise ValueError(f"request {self.request_id}: {len(self.token_times_s)} token times "
                             f"for {self.num_output_tokens} output tokens")
        if self.status == "finished" and not self.token_times_s:
            raise ValueError(f"request {self.request_id}: finished without an output token")

    @property
    def ttft_s(self) -> float | None:
        """Arrival to first token, queueing and prefill included (vLLM's TTFT)."""
        return self.token_times_s[0] - self.arrival_s if self.token_times_s else None

    @property
    def e2el_s(self) -> float | None:
        """Arrival to the end of the response; the last token's time when finished_s is unknown."""
        if self.finished_s is not None:
            return self.finished_s - self.arrival_s
        return self.token_times_s[-1] - self.arrival_s if self.token_times_s else None

    @property
    def tpot_s(self) -> float | None:
        """(E2EL - TTFT) / (output tokens - 1); None below 2 tokens (vLLM leaves it out)."""
        ttft, e2el = self.ttft_s, self.e2el_s
        if self.num_output_tokens < 2 or ttft is None or e2el is None:
            return None
        return (e2el - ttft) / (self.num_output_tokens - 1)

    @property
    def itls_s(self) -> tuple[float, ...]:
        """Gaps between consecutive tokens; a preemption shows up as one long gap."""
        return tuple(b - a for a, b in itertools.pairwise(self.token_times_s))

    @property
    def queue_s(self) -> float | None:
        return None if self.first_scheduled_s is None else self.first_scheduled_s - self.arrival_s

    def derived_ms(self) -> tuple[float | None, ...]:
        """The values of DERIVED_MS_KEYS, as a record's line carries them after its fields."""
        return tuple(None if v is None else v * _MS
                     for v in (self.ttft_s, self.tpot_s, self.e2el_s, self.queue_s))

    def to_json(self) -> dict[str, Any]:
        row = {name: getattr(self, name) for name in _field_names(type(self))}
        row["token_times_s"] = list(self.token_times_s)
        row.update(zip(DERIVED_MS_KEYS, self.derived_ms()))
        return row  # ITLs are the differences of token_times_s (not stored twice)

    @classmethod
    def from_json(cls, row: Mapping[str, Any]) -> RequestRecord:
        return _from_row(cls, {**row, "token_times_s": tuple(row.get("token_times_s", ()))})


@dataclasses.dataclass(slots=True)  # not frozen: one is built per plan, and freezing costs 5x
class StepRecord:
    """One engine step, or `num_steps` identical pure-decode steps run back to back. The counters
    batch_size and num_prefill_* are per step; the rest describe the record as a whole."""

    step_index: int
    start_s: float
    end_s: float  # end of the record's last step
    num_steps: int  # >= 1
    batch_size: int  # requests decoded in one forward pass
    num_prefill_tokens: int  # prompt (or recompute) tokens computed in the step
    num_prefill_requests: int
    num_running: int  # after the record
    num_waiting: int
    kv_bytes: int  # scheduler's account after the record
    kv_bytes_measured: int | None  # what the executor counted from its arrays; None: not measured
    pool_rows: int
    pool_capacity_tokens: int
    num_preemptions: int  # decided when the record's plan was made
    # Seconds the executor itself spent (its own clock); the rest of end_s - start_s is the engine
    # handing the step to the executor thread and back. Predicted, not measured, in simulation.
    compute_s: float | None = None
    # Requests the record's plan admitted from the queue, new or back from a preemption (None:
    # records written before the field; timeline.admitted_per_step counts them from requests).
    num_admitted: int | None = None

    def __post_init__(self) -> None:
        if self.num_steps < 1:
            raise ValueError(f"step {self.step_index}: num_steps must be >= 1, "
                             f"got {self.num_steps}")
        if self.end_s < self.start_s:
            raise ValueError(f"step {self.step_index}: ends at {self.end_s} before it starts")

    @property
    def duration_s(self) -> float:
        return self.end_s - self.start_s

    def to_json(self) -> dict[str, Any]:
        return {name: getattr(self, name) for name in _field_names(type(self))}

    @classmethod
    def from_json(cls, row: Mapping[str, Any]) -> StepRecord:
        return _from_row(cls, row)


@functools.cache
def _field_names(cls: type) -> tuple[str, ...]:
    return tuple(f.name for f in dataclasses.fields(cls))  # once: runs write a row per step


def _from_row(cls: Any, row: Mapping[str, Any]) -> Any:
    """Build a record from a JSONL row; derived keys (ttft_ms, ...) are ignored."""
    kwargs = {}
    for f in dataclasses.fields(cls):
        if f.name in row:
            kwargs[f.name] = row[f.name]
        elif f.default is dataclasses.MISSING:
            raise ValueError(f"{cls.__name__}: row has no {f.name!r}")
    return cls(**kwargs)


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
    name: str, values_s: Sequence[float] | np.ndarray, percentiles: Sequence[float]
) -> dict[str, float]:
    """mean/median/std (population) and linear-interpolated percentiles, in ms, as vLLM."""
    # One array for the sums, one sorted copy for the order statistics (a simulated hour has a
    # million ITLs).
    x: Any = np.asarray(values_s, dtype=np.float64) if len(values_s) else 0  # vLLM: np.mean(x or 0)
    median, ranks = request_arrays.order_stats(x if len(values_s) else (), percentiles)
    out = {
        f"mean_{name}_ms": float(np.mean(x)) * _MS,
        f"median_{name}_ms": median * _MS,
        f"std_{name}_ms": float(np.std(x)) * _MS,
    }
    for p, v in zip(percentiles, ranks):
        out[f"p{percentile_label(p)}_{name}_ms"] = v * _MS
    return out


def _output_lengths(done: Sequence[RequestRecord], percentiles: Sequence[float]) -> dict[str, Any]:
    """Output tokens per completed request (mean, median, percentiles, max) and why requests ended
    ("stop": EOS or a stop string, "length": max_tokens): natural lengths when EOS is honoured."""
    x: Any = [r.num_output_tokens for r in done] or 0
    median, ranks = request_arrays.order_stats(x or (), percentiles)
    out: dict[str, Any] = {"mean_output_tokens": float(np.mean(x)),
                           "median_output_tokens": median}
    for p, v in zip(percentiles, ranks):
        out[f"p{percentile_label(p)}_output_tokens"] = v
    out["max_output_tokens"] = int(np.max(x))
    reasons = collections.Counter(str(r.finish_reason) for r in done)
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
    token_times_s: tuple[np.ndarray, ...] | None = None,
    step_columns: dict[str, np.ndarray] | None = None,
    running_peak_kv_bytes: int | None = None,  # KVManager.peak_running_bytes (None: the steps')
) -> dict[str, Any]:
    """One run's summary. `duration_s` is the benchmark duration (vLLM: start until the last request
    ends); every throughput divides by it, and is 0 when it is 0. `request_goodput` is None unless
    SLOs are given, as in vLLM's JSON. `token_times_s`: request_arrays.token_times(requests) (times
    in s, their requests' indices; and their sorted_counts: RunTokens.times'), `step_columns`:
    request_arrays.step_columns(steps, ...) with its STEP_INTS at least, if the caller has them."""
    slo = parse_goodput([f"{k}:{v}" for k, v in goodput_slo_ms.items()]) if goodput_slo_ms else None
    done = [r for r in requests if r.status == "finished"]
    all_times, all_owner, *ranked = token_times_s or request_arrays.token_times(requests)
    finished = np.array([r.status == "finished" for r in requests], dtype=bool)
    mine = None if finished.all() or (m := finished[all_owner]).all() else m  # None: every token
    times, owner = (all_times, all_owner) if mine is None else (all_times[mine], all_owner[mine])
    every = ranked[0] if ranked else request_arrays.sorted_counts(np.sort(all_times))
    lat = request_arrays.latencies_s(done)  # queue: arrival to first scheduled
    statuses = collections.Counter(r.status for r in requests)
    total_in = sum(r.num_prompt_tokens for r in done)
    total_out = sum(r.num_output_tokens for r in done)
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
        **_peaks(lat["arrival"], lat["e2el"],
                 every if mine is None else request_arrays.sorted_counts(np.sort(times))),
    }
    latencies_s = {"ttft": lat["ttft"], "tpot": lat["tpot"],
                   "itl": request_arrays.itls(times, owner),  # pooled over requests, as vLLM
                   "e2el": lat["e2el"], "queue": lat["queue"]}
    for name, values in latencies_s.items():
        out.update(distribution(name, values, percentiles))  # type: ignore[arg-type]
    out.update(_output_lengths(done, percentiles))
    if "p99_queue_ms" not in out:  # always reported, whatever the percentiles
        out["p99_queue_ms"] = request_arrays.order_stats(latencies_s["queue"], (99,))[1][0] * _MS
    out.update(_batch_view(requests, every, steps, kv_budget_bytes, weight_bytes,
                           peak_memory_bytes, step_columns, running_peak_kv_bytes))
    out["peak_rss_bytes"] = peak_rss_bytes  # the process's peak resident memory (real compute)
    return out


def output_tokens_sha256(output_ids: Mapping[int, Sequence[int]]) -> str:
    """sha256 over request ids and their output token ids, in request-id order: two runs with the
    same digest produced the same tokens for every request."""
    h = hashlib.sha256()
    for rid in sorted(output_ids):
        h.update(f"{rid}:{','.join(map(str, output_ids[rid]))};".encode())
    return h.hexdigest()
