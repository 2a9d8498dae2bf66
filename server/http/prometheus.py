"""`GET /metrics` of `batchsim serve` in the Prometheus text format (0.0.4), and the bounded
recorder behind it.

The engine's RunRecorder keeps every request and every step, which is what a run directory needs
and what a long-running server cannot afford. ServerRecorder takes its place on the server's
engine (same two hooks) and keeps counters and fixed-size histograms only, so memory stays flat
however many requests pass."""

from __future__ import annotations

import collections
from collections.abc import Iterable, Sequence
from typing import Any

from batchsim.scheduler.plan import StepPlan, StepResult
from batchsim.scheduler.request import Request
from batchsim.scheduler.scheduler import Scheduler
from batchsim.server.engine.memory import peak_resident_bytes, resident_bytes
from batchsim.server.results.spec_metrics import SpecCounts

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
STEP_BUCKETS_S = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)
BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256)


class Histogram:
    def __init__(self, buckets: Sequence[float]):
        self.buckets = tuple(buckets)
        self.counts = [0] * len(self.buckets)  # per bucket, not cumulative; +Inf is `count`
        self.sum = 0.0
        self.count = 0

    def observe(self, value: float, times: int = 1) -> None:
        for i, upper in enumerate(self.buckets):
            if value <= upper:
                self.counts[i] += times
                break
        self.sum += value * times
        self.count += times

    def samples(self, name: str) -> list[str]:
        lines, cumulative = [], 0
        for upper, n in zip(self.buckets, self.counts):
            cumulative += n
            lines.append(f'{name}_bucket{{le="{upper:g}"}} {cumulative}')
        lines.append(f'{name}_bucket{{le="+Inf"}} {self.count}')
        lines += [f"{name}_sum {self.sum:.9g}", f"{name}_count {self.count}"]
        return lines


class ServerRecorder:
    """The engine's recorder for a server: what /metrics reports, nothing per request."""

    def __init__(self) -> None:
        self.requests: dict[int, Request] = {}  # kept empty: the server tracks its own requests
        self.num_arrivals = 0
        self.num_steps = 0  # executed steps
        self.prompt_tokens = 0  # prefill tokens computed, recompute after preemption included
        self.generation_tokens = 0  # tokens emitted: the responses' completion tokens
        self.aborted_generation_tokens = 0  # of those, aborted requests' (client gone, shutdown)
        self.last_batch_size = 0  # requests decoded in the last step's forward pass
        self.max_batch_size = 0
        self.kv_bytes_measured = 0  # the executor's own count after the last step
        self.kv_account_mismatches = 0
        self.spec = SpecCounts()  # speculative decoding
        self.step_seconds = Histogram(STEP_BUCKETS_S)
        self.batch_size = Histogram(BATCH_BUCKETS)  # decode steps only
        self.request_outcomes: collections.Counter[str] = collections.Counter()
        self.http_responses: collections.Counter[int] = collections.Counter()
        self.client_disconnects = 0  # requests whose client left before any answer was sent
        self.client_gone = 0  # generation requests aborted because their client left

    def on_arrival(self, request: Request) -> None:
        self.num_arrivals += 1

    def on_step(self, plan: StepPlan, result: StepResult, start_s: float, ends_s: Sequence[float],
                scheduler: Scheduler) -> None:
        k = result.num_steps
        self.num_steps += k
        self.prompt_tokens += sum(c.num_tokens for c in plan.prefills)
        # Rows the scheduler cut at a stop (scheduler.cut_drafts) emitted their kept drafts only;
        # rows of requests aborted mid-step (scheduler.dropped_rows) emitted nothing.
        dropped = scheduler.dropped_rows
        kept_rows = len(result.sampled_ids) - len(dropped)
        self.generation_tokens += kept_rows * k - len(scheduler.cut_drafts)
        if result.accepted_ids is not None:
            accepted = result.accepted_ids
            self.generation_tokens += (sum(map(len, accepted))
                                       - sum(len(accepted[i]) for i in dropped))
            self.spec.add(result)
        batch = len(plan.decode_ids)
        self.last_batch_size = batch
        self.max_batch_size = max(self.max_batch_size, batch)
        if batch:
            self.batch_size.observe(batch, k)
        self.step_seconds.observe((ends_s[-1] - start_s) / k, k)
        self.kv_bytes_measured = result.kv_bytes
        self.kv_account_mismatches += result.kv_bytes != plan.kv_bytes


def _metric(name: str, kind: str, help_text: str, samples: Iterable[str]) -> list[str]:
    return [f"# HELP {name} {help_text}", f"# TYPE {name} {kind}", *samples]


def _labelled(name: str, counts: dict[Any, int], label: str, known: Iterable[Any]) -> list[str]:
    keys = list(dict.fromkeys([*known, *sorted(counts)]))
    return [f'{name}{{{label}="{k}"}} {counts.get(k, 0)}' for k in keys]


def mlx_memory_gauges() -> list[tuple[str, str, int]]:
    """MLX's allocator: what is in use, and what it keeps cached for reuse (which RSS includes)."""
    import mlx.core as mx  # already loaded by the executor; imported late for non-server users

    return [("batchsim_mlx_active_bytes", "MLX memory in use.", mx.get_active_memory()),
            ("batchsim_mlx_cache_bytes", "MLX buffer cache: freed, kept for reuse.",
             mx.get_cache_memory()),
            ("batchsim_mlx_peak_bytes", "MLX peak memory in use since start.",
             mx.get_peak_memory())]


def render(rec: ServerRecorder, scheduler: Scheduler, *, kv_budget_bytes: int, max_queue: int,
           inflight: int, memory_budget_bytes: int = 0,
           extra_gauges: Sequence[tuple[str, str, int]] = ()) -> str:
    gauges = [
        ("batchsim_requests_running", "Requests admitted and holding KV.", len(scheduler.running)),
        ("batchsim_requests_waiting", "Requests queued for admission.", len(scheduler.waiting)),
        ("batchsim_requests_inflight", "HTTP generation requests being answered.", inflight),
        ("batchsim_max_queue", "Waiting requests beyond which new ones get 429.", max_queue),
        ("batchsim_kv_bytes", "KV bytes held, scheduler's account.", scheduler.kv.kv_bytes),
        ("batchsim_kv_bytes_measured", "KV bytes the executor held after the last step.",
         rec.kv_bytes_measured),
        ("batchsim_kv_budget_bytes", "KV budget: memory budget minus weights.", kv_budget_bytes),
        ("batchsim_memory_budget_bytes", "Memory budget: weights + KV (--memory-gb).",
         memory_budget_bytes),
        ("batchsim_decode_batch_size", "Requests decoded in the last step.", rec.last_batch_size),
        ("batchsim_decode_batch_size_max", "Most requests decoded in one step.",
         rec.max_batch_size),
    ]
    rss = resident_bytes()
    if rss is not None:
        gauges.append(("process_resident_memory_bytes", "Resident memory of the server.", rss))
    peak_rss = peak_resident_bytes()
    if peak_rss is not None:
        gauges.append(("process_resident_memory_peak_bytes",
                       "Peak resident memory of the server since start.", peak_rss))
    gauges += extra_gauges
    counters = _counters(rec, scheduler) + _spec_counters(rec.spec)
    lines = _prefix_cache_lines(scheduler)
    for name, help_text, value in gauges:
        lines += _metric(name, "gauge", help_text, [f"{name} {value}"])
    for name, help_text, value in counters:
        lines += _metric(name, "counter", help_text, [f"{name} {value}"])
    lines += _metric("batchsim_requests_total", "counter", "Generation requests by outcome.",
                     _labelled("batchsim_requests_total", rec.request_outcomes, "status",
                               ("finished", "aborted", "rejected")))
    lines += _metric("batchsim_http_responses_total", "counter", "HTTP responses by status code.",
                     _labelled("batchsim_http_responses_total", rec.http_responses, "code", ()))
    if rec.spec.num_drafts:
        lines += _metric("batchsim_spec_decode_per_position_acceptance_rate", "gauge",
                         "Share of drafts whose token at this position was accepted.",
                         [f'batchsim_spec_decode_per_position_acceptance_rate{{position="{i}"}} '
                          f"{r:.6g}" for i, r in enumerate(
                              rec.spec.summary()["spec_decode_per_position_acceptance_rates"])])
    lines += _metric("batchsim_step_seconds", "histogram", "Engine step latency.",
                     rec.step_seconds.samples("batchsim_step_seconds"))
    lines += _metric("batchsim_decode_batch_size_steps", "histogram",
                     "Requests per decode step.", rec.batch_size.samples(
                         "batchsim_decode_batch_size_steps"))
    return "\n".join(lines) + "\n"


def _prefix_cache_lines(scheduler: Scheduler) -> list[str]:
    """vLLM's prefix-cache counters (in tokens), and the cache's bytes."""
    prefix = scheduler.kv.prefix
    return [*_metric("batchsim_prefix_cache_queries_total", "counter", "Prompt tokens admitted "
                     "requests had to compute (prefix-cache queries).",
                     [f"batchsim_prefix_cache_queries_total {scheduler.num_query_tokens}"]),
            *_metric("batchsim_prefix_cache_hits_total", "counter",
                     "Of those, tokens the prefix cache held.",
                     [f"batchsim_prefix_cache_hits_total {scheduler.num_hit_tokens}"]),
            *_metric("batchsim_prefix_cache_bytes", "gauge", "KV bytes of cached prompt blocks.",
                     [f"batchsim_prefix_cache_bytes {prefix.nbytes if prefix else 0}"]),
            *_metric("batchsim_prefix_cache_blocks", "gauge", "Cached prompt blocks.",
                     [f"batchsim_prefix_cache_blocks {len(prefix.blocks) if prefix else 0}"])]


def _counters(rec: ServerRecorder, scheduler: Scheduler) -> list[tuple[str, str, int]]:
    return [
        ("batchsim_preemptions_total", "Requests preempted (KV freed, recomputed later).",
         scheduler.num_preemptions),
        ("batchsim_prompt_tokens_total", "Prefill tokens computed, recompute included.",
         rec.prompt_tokens),
        ("batchsim_generation_tokens_total", "Tokens emitted.", rec.generation_tokens),
        ("batchsim_aborted_generation_tokens_total",
         "Of those, requests' aborted before they finished (client gone, shutdown, error).",
         rec.aborted_generation_tokens),
        ("batchsim_steps_total", "Engine steps executed.", rec.num_steps),
        ("batchsim_kv_account_mismatches_total",
         "Steps where the executor's KV bytes differed from the scheduler's.",
         rec.kv_account_mismatches),
        ("batchsim_http_client_disconnects_total",
         "Requests whose client left before any answer was sent.", rec.client_disconnects),
        ("batchsim_requests_client_gone_total",
         "Generation requests aborted because their client left mid-request.", rec.client_gone),
    ]


def _spec_counters(spec: SpecCounts) -> list[tuple[str, str, int]]:
    """vLLM's spec_decode counters (num_drafts, num_draft_tokens, num_accepted_tokens)."""
    return [("batchsim_spec_decode_num_drafts_total",
             "Speculative drafts verified (rows with >= 1 drafted token, per step).",
             spec.num_drafts),
            ("batchsim_spec_decode_num_draft_tokens_total", "Drafted tokens verified.",
             spec.draft_tokens),
            ("batchsim_spec_decode_num_accepted_tokens_total", "Drafted tokens accepted.",
             spec.accepted_tokens)]


def parse(text: str) -> dict[str, float]:
    """Samples of a text exposition, by name with labels ('name{k="v"}'): for tests and the soak."""
    samples = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, _, value = line.rpartition(" ")
            samples[name] = float(value)
    return samples
