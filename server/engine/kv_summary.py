"""A run summary's keys only the scheduler knows: the prefix cache's counts (tokens counted at
each admission, vLLM's way) and the running requests' peak KV (KVManager.peak_running_bytes), and
what follows from that peak: every KV byte held is at least it (a simulated paged run's rows hold
a plain prompt's blocks its pool does not model), and so is an estimated peak memory."""

from __future__ import annotations

from typing import Any

from batchsim.scheduler.scheduler import Scheduler
from batchsim.server.results.metrics import _GB


def kv_summary(scheduler: Scheduler, summary: dict[str, Any]) -> dict[str, Any]:
    """The keys to update `summary` (metrics.summarize's, from the records) with."""
    queries, hits, kv = scheduler.num_query_tokens, scheduler.num_hit_tokens, scheduler.kv
    held = max(summary["peak_kv_held_bytes"], kv.peak_running_bytes)
    out = {"prefix_cache": kv.prefix is not None, "peak_kv_bytes": kv.peak_running_bytes,
           "peak_kv_held_bytes": held,
           "prefix_cache_hit_rate": hits / queries if queries else 0.0,
           "cached_prompt_tokens": hits, "prefilled_prompt_tokens": queries - hits,
           "peak_prefix_cache_bytes": getattr(kv.prefix, "peak_bytes", 0)}
    if summary["peak_memory_source"] == "weights+kv":  # the estimate: weights and every KV byte
        peak = summary["weight_bytes"] + held
        out.update(peak_memory_bytes=peak, peak_memory=peak / _GB)
    return out
