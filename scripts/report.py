"""The human-readable summary of a serving run (vLLM's "Serving Benchmark Result" block, then the
batch and memory view). The numbers come from server.results.metrics.summarize."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from batchsim.scripts.common import fmt, table
from batchsim.server.results.metrics import peak_memory_bytes
from rich.table import Table
from rich.text import Text

_GIB = float(1 << 30)  # as the run's header, timeline.png, --memory-gb and `size` give memory

_SECTIONS = (
    ("ttft", "TTFT", "Time to First Token"),
    ("tpot", "TPOT", "Time per Output Token (excl. 1st token)"),
    ("itl", "ITL", "Inter-token Latency"),
    ("e2el", "E2EL", "End-to-end Latency"),
    ("queue", "Queue", "Queue delay (arrival to first scheduled)"),
)
_THROUGHPUT_ROWS = (
    ("Output token throughput (tok/s)", "output_throughput"),
    ("Peak output token throughput (tok/s)", "max_output_tokens_per_s"),
    ("Peak concurrent requests", "max_concurrent_requests"),
    ("Total token throughput (tok/s)", "total_token_throughput"),
)
_BATCH_ROWS = (
    ("Mean decode batch size", "mean_batch_size"), ("Max decode batch size", "max_batch_size"),
    ("Engine steps", "num_engine_steps"), ("Preemptions", "num_preemptions"),
    ("Prompt tokens prefilled (incl. recompute)", "prompt_tokens"), ("Prompt tok/s", "prompt_tps"),
    ("Prefix cache hit rate", "prefix_cache_hit_rate"),
    ("Cached prompt tokens (not prefilled)", "cached_prompt_tokens"),
    ("Generation tokens", "generation_tokens"), ("Generation tok/s", "generation_tps"),
    ("Peak KV (GiB)", "peak_kv_bytes"), ("KV budget (GiB)", "kv_budget_bytes"),
)


def summary_table(summary: Mapping[str, Any]) -> Table:
    """vLLM's "Serving Benchmark Result" block, then the batch and memory view."""
    s = {**summary}
    s["peak_memory_bytes"] = peak_memory_bytes(s)
    for key in ("peak_kv_bytes", "kv_budget_bytes", "peak_memory_bytes"):
        s[key] = None if s.get(key) is None else s[key] / _GIB
    failed = (f"Failed requests ({s.get('num_rejected', 0)} rejected, "
              f"{s.get('num_aborted', 0)} aborted, {s.get('num_unfinished', 0)} unfinished)")
    rows: list[tuple[Any, Any] | None] = [
        ("Successful requests", s.get("completed")), (failed, s.get("failed")),
        ("Benchmark duration (s)", s.get("duration")),
        ("Total input tokens", s.get("total_input_tokens")),
        ("Total generated tokens", s.get("total_output_tokens")),
        ("Request throughput (req/s)", s.get("request_throughput")),
    ]
    if s.get("request_goodput") is not None:
        slo_ms = s.get("goodput_slo_ms") or {}
        slos = ", ".join(f"{k.upper()} <= {v:g} ms" for k, v in slo_ms.items())
        rows.append((f"Request goodput (req/s, {slos})", s["request_goodput"]))
    rows += [(label, s.get(key)) for label, key in _THROUGHPUT_ROWS]
    for key, label, header in _SECTIONS:
        suffix = f"_{key}_ms"
        rows += [None, (Text(header, "bold"), ""),
                 (f"Mean {label} (ms)", s.get(f"mean{suffix}")),
                 (f"Median {label} (ms)", s.get(f"median{suffix}"))]
        rows += [(f"P{k[1:-len(suffix)]} {label} (ms)", v) for k, v in s.items()
                 if k.startswith("p") and k[1:2].isdigit() and k.endswith(suffix)]
    rows += _output_length_rows(s)
    rows += [None, (Text("Batch and memory", "bold"), "")]
    rows += [(label, s.get(key)) for label, key in _BATCH_ROWS
             if key in s or not key.startswith(("prefix_", "cached_"))]  # a cache-less summary
    source = s.get("peak_memory_source") or "unknown"
    rows.append((f"Peak memory (GiB, {source})", s.get("peak_memory_bytes")))
    t = table("Serving Benchmark Result", ["metric", "value"], [])
    for row in rows:
        if row is None:
            t.add_section()
        else:
            t.add_row(row[0], fmt(row[1]))
    return t


def _output_length_rows(s: Mapping[str, Any]) -> list[tuple[Any, Any] | None]:
    """Output tokens per request and why requests ended (natural lengths when EOS is honoured)."""
    if s.get("median_output_tokens") is None:
        return []
    rows: list[tuple[Any, Any] | None] = [None, (Text("Output tokens per request", "bold"), ""),
                                          ("Mean", s.get("mean_output_tokens")),
                                          ("Median", s.get("median_output_tokens"))]
    rows += [(f"P{k[1:-len('_output_tokens')]}", v) for k, v in s.items()
             if k.startswith("p") and k[1:2].isdigit() and k.endswith("_output_tokens")]
    rows.append(("Max", s.get("max_output_tokens")))
    reasons = s.get("finish_reasons") or {}
    rows.append(("Finish reasons", ", ".join(f"{k} {v}" for k, v in reasons.items())))
    return rows
