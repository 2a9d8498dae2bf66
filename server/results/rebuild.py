"""A run's summary rebuilt from its records: for a run that was killed before it wrote
summary.json (its complete lines are all there), or to check one that did."""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import yaml
from batchsim.configs import ConfigError
from batchsim.server.results.jsonio import jsonable
from batchsim.server.results.metrics import RequestRecord, StepRecord, summarize
from batchsim.server.results.run_files import (
    CONFIG,
    REQUESTS,
    STEPS,
    SUMMARY,
    read_rows,
    write_summary,
)

# Facts the records cannot give back: a finished run's own summary keeps them.
_FROM_THE_RUN = ("duration", "peak_memory", "peak_memory_source")


def rebuild_summary(run_dir: Path) -> tuple[dict[str, Any], list[str]]:
    """summary.json from the run directory's records, written back; with notes for the reader
    (torn lines skipped, the run never finished). A run without summary.json never finished:
    it is marked interrupted, and its duration is the span of its records."""
    if not (run_dir / REQUESTS).is_file() and not (run_dir / STEPS).is_file():
        raise ConfigError(f"{run_dir}: not a run directory (no {REQUESTS} or {STEPS})")
    notes: list[str] = []
    config = _read_config(run_dir / CONFIG, notes)
    old = _read_old_summary(run_dir / SUMMARY, notes)
    requests = _records(run_dir / REQUESTS, RequestRecord, notes)
    steps = _records(run_dir / STEPS, StepRecord, notes)
    cfg, resolved = config.get("config") or {}, config.get("resolved") or {}
    summary = summarize(
        requests, steps, duration_s=old.get("duration", _span_s(requests, steps)),
        percentiles=cfg.get("percentiles") or (50, 90, 95, 99), goodput_slo_ms=cfg.get("goodput"),
        kv_budget_bytes=resolved.get("kv_budget_bytes"), weight_bytes=resolved.get("weight_bytes"),
    )
    if old:
        summary = {**{k: (v if k in _FROM_THE_RUN or k not in summary else summary[k])
                      for k, v in old.items()},
                   **{k: v for k, v in summary.items() if k not in old}}
    else:
        summary.update(_from_config(config, steps, run_dir))
        expected = (config.get("workload") or {}).get("num_prompts")
        notes.append(f"no {SUMMARY}: the run never finished; marked interrupted ("
                     f"{len(requests)} requests recorded" + (f" of {expected}" if expected else "")
                     + "; requests still in flight left no record)")
    write_summary(run_dir, jsonable(summary))
    return summary, notes


def _read_config(path: Path, notes: list[str]) -> dict[str, Any]:
    if not path.is_file():
        notes.append(f"{CONFIG}: missing; model and budget fields left out")
        return {}
    data = yaml.safe_load(path.read_text())
    return data if isinstance(data, dict) else {}


def _read_old_summary(path: Path, notes: list[str]) -> dict[str, Any]:
    if not path.is_file():
        return {}
    try:
        data = json.loads(path.read_text())
    except ValueError:
        notes.append(f"{SUMMARY}: not valid JSON; rebuilt as for a run that never finished")
        return {}
    return data if isinstance(data, dict) else {}


def _records(path: Path, cls: Any, notes: list[str]) -> list[Any]:
    out = []
    try:
        for i, row in enumerate(read_rows(path, notes), 1):
            try:
                out.append(cls.from_json(row))
            except (ValueError, TypeError) as exc:
                raise ValueError(f"{path}: record {i}: {exc}") from None
    except ValueError as exc:
        raise ConfigError(str(exc)) from None
    return out


def _span_s(requests: Sequence[RequestRecord], steps: Sequence[StepRecord]) -> float:
    """The last moment the records know of (the run's clock starts at 0)."""
    times = [s.end_s for s in steps[-1:]]
    for r in requests:
        times += [r.arrival_s, *r.token_times_s[-1:]]
        if r.finished_s is not None:
            times.append(r.finished_s)
    return max(times, default=0.0)


def _from_config(config: dict[str, Any], steps: Sequence[StepRecord],
                 run_dir: Path) -> dict[str, Any]:
    """What the run's summary says beside the metrics, as far as config.yaml tells it."""
    cfg, resolved = config.get("config") or {}, config.get("resolved") or {}
    return {
        "model": cfg.get("model"), "dtype": resolved.get("dtype"),
        "quantize_bits": cfg.get("quantize"), "executor": cfg.get("executor"),
        "workload": (config.get("workload") or {}).get("name"),
        "max_num_seqs": (resolved.get("scheduler") or {}).get("max_num_seqs"),
        "memory_budget_bytes": resolved.get("memory_budget_bytes"),
        "budget_source": resolved.get("budget_source"),
        "num_steps": sum(s.num_steps for s in steps), "num_plans": len(steps),
        "kv_account_mismatches": sum(s.kv_bytes_measured != s.kv_bytes for s in steps),
        "interrupted": True, "run_dir": str(run_dir), "env": config.get("env"),
    }
