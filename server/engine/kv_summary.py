"""A run summary's keys only the scheduler knows: the prefix cache's counts (tokens counted at
each admission, vLLM's way). The running requests' peak KV (KVManager.peak_running_bytes), and the
KV held and estimated peak memory that follow from it, metrics.summarize computes from
`running_peak_kv_bytes`."""

from __future__ import annotations

from typing import Any

from batchsim.scheduler.scheduler import Scheduler


def kv_summary(scheduler: Scheduler) -> dict[str, Any]:
    """The keys to update metrics.summarize's summary with."""
    queries, hits, kv = scheduler.num_query_tokens, scheduler.num_hit_tokens, scheduler.kv
    return {"prefix_cache": kv.prefix is not None,
            "prefix_cache_hit_rate": hits / queries if queries else 0.0,
            "cached_prompt_tokens": hits, "prefilled_prompt_tokens": queries - hits,
            "peak_prefix_cache_bytes": getattr(kv.prefix, "peak_bytes", 0)}
