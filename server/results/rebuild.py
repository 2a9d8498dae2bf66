"""A run's summary rebuilt from its records: for a run that was killed before it wrote
summary.json (its complete lines are all there), or to check one that did."""

from __future__ import annotations

import dataclasses
import json
import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from batchsim.configs import ConfigError, load_yaml
from batchsim.server.platform.signals import stop_if_swallowed
from batchsim.server.results.json_text import jsonable
from batchsim.server.results.jsonio import MAX_CLOCK_S
from batchsim.server.results.metrics import peak_memory_bytes, summarize
from batchsim.server.results.records import RequestRecord, StepRecord
from batchsim.server.results.run_files import (
    CONFIG,
    REQUESTS,
    STEPS,
    SUMMARY,
    leftover_temps,
    not_a_file,
    read_rows,
    write_summary,
)
from batchsim.server.results.timeline import TIMELINE, Limits, run_title, timeline_title
from batchsim.server.results.timeline_draw import write_timeline

NOT_KEPT = "summary rebuilt but not kept"  # the note's words: summary.json cannot be written
# Facts the records cannot give back: a finished run's own summary keeps them.
# MAX_CLOCK_S (jsonio): a time past it is damage; times near a float's range overflow the
# statistics (a finished_s of 1e308: the square in np.std).
INT64_MAX = 2**63 - 1  # an int field's largest value: the summary reads them as np.int64
_FROM_THE_RUN = ("duration", "peak_memory_bytes", "peak_memory", "peak_memory_source",
                 "peak_rss_bytes", "peak_kv_bytes",  # the running requests' (the scheduler's)
                 "peak_kv_held_bytes")  # at least that (the records': the plans' peak)


def rebuild_summary(run_dir: Path, timeline: bool = True) -> tuple[dict[str, Any], list[str]]:
    """summary.json from the run directory's records, written back; with notes for the reader
    (torn lines skipped, the run never finished). A run without summary.json never finished:
    it is marked interrupted, and its duration is the span of its records. `timeline`: draw
    timeline.png again (False: the summary keeps the path it had)."""
    if not (run_dir / REQUESTS).is_file() and not (run_dir / STEPS).is_file():
        raise ConfigError(f"{run_dir}: not a run directory (no {REQUESTS} or {STEPS})")
    notes: list[str] = []
    seen = _files_now(run_dir)  # a run still going changes them while this reads
    if left := leftover_temps(run_dir):
        notes.append(f"{', '.join(left)}: temp file(s) a killed write left (or one under way): "
                     "not records, not read; safe to delete once nothing writes here")
    config = _read_config(run_dir / CONFIG, notes)
    old = _read_old_summary(run_dir / SUMMARY, notes)
    requests = _once_each(_records(run_dir / REQUESTS, RequestRecord, notes), notes)
    steps = _records(run_dir / STEPS, StepRecord, notes)
    cfg, resolved = _section(config, "config"), _section(config, "resolved")
    duration_s = old.get("duration")
    summary = summarize(
        requests, steps,
        duration_s=duration_s if _finite(duration_s) else _span_s(requests, steps),
        percentiles=_percentiles(cfg.get("percentiles")),
        goodput_slo_ms=_goodput(cfg.get("goodput")),
        kv_budget_bytes=_count(resolved.get("kv_budget_bytes")),
        weight_bytes=_count(resolved.get("weight_bytes")),
    )
    if old:
        summary = {**{k: (v if k in _FROM_THE_RUN or k not in summary else summary[k])
                      for k, v in old.items()},
                   **{k: v for k, v in summary.items() if k not in old}}
        if "peak_memory" in old:  # the run's, in bytes (a summary before peak_memory_bytes: GB)
            summary["peak_memory_bytes"] = peak_memory_bytes(old)
    else:
        summary.update(_from_config(config, steps, run_dir))
        expected = _workload(config).get("num_prompts")
        why = (f"{SUMMARY}: not a JSON object" if seen[SUMMARY] is not None  # when read
               else f"no {SUMMARY}: the run never finished")
        notes.append(f"{why}; marked interrupted ("
                     f"{len(requests)} requests recorded" + (f" of {expected}" if expected else "")
                     + "; requests still in flight left no record)")
    stop_if_swallowed()  # a Ctrl-C Python swallowed while reading: nothing drawn or written
    if _changed(run_dir, seen, notes, _WATCHED + (TIMELINE,)):  # the run's own files win
        return {**summary, "timeline_png": old.get("timeline_png")}, notes
    if timeline:
        summary["timeline_png"] = _timeline(run_dir, requests, steps, config, old, notes)
    else:
        summary.setdefault("timeline_png", None)
    stop_if_swallowed()  # ... while drawing: the summary as it was
    if _changed(run_dir, seen, notes, _WATCHED):  # (timeline.png: this one's, just drawn)
        return summary, notes
    try:
        write_summary(run_dir, jsonable(summary))
    except OSError as exc:  # a read-only run directory (an archive): the summary is still given
        notes.append(f"{NOT_KEPT}: {exc}")  # WriteFailed's own line: path and reason, once
    return summary, notes


_WATCHED = (SUMMARY, STEPS, REQUESTS)  # what a run still going writes (and timeline.png)


def _files_now(run_dir: Path) -> dict[str, tuple[int, int, int] | None]:
    """Each of a run's files (_WATCHED and timeline.png): (inode, size, mtime) or None."""
    files: dict[str, tuple[int, int, int] | None] = {}
    for name in (*_WATCHED, TIMELINE):
        try:
            st = (run_dir / name).stat()
            files[name] = (st.st_ino, st.st_size, st.st_mtime_ns)
        except OSError:
            files[name] = None
    return files


def _changed(run_dir: Path, seen: dict, notes: list[str], names: tuple[str, ...]) -> bool:
    """Whether any of `names` changed since `seen` (a run still writes here): noted."""
    now = _files_now(run_dir)
    if all(now[name] == seen[name] for name in names):
        return False
    notes.append(f"{run_dir}: its files changed while read (a run still going?): the summary "
                 "above is from what was read; nothing written")
    return True


def _timeline(run_dir: Path, requests: list[RequestRecord], steps: list[StepRecord],
              config: dict[str, Any], old: dict[str, Any], notes: list[str]) -> str | None:
    """timeline.png drawn again from the records; the path as the run's summary gave it."""
    resolved = _section(config, "resolved")
    scheduler = _section(resolved, "scheduler")
    limits = Limits(_count(resolved.get("kv_budget_bytes")),
                    _count(scheduler.get("max_num_seqs")),
                    _count(scheduler.get("max_num_batched_tokens")))
    cfg = _section(config, "config")
    what = run_title(_text(cfg.get("model")) or "run", _text(old.get("dtype")),
                     _count(cfg.get("quantize")), _text(cfg.get("executor")),
                     _text(cfg.get("device_profile")), _text(cfg.get("engine")),
                     _section(old, "env"))
    title = timeline_title(what, _workload(config), len(requests))
    title += " (redrawn by batchsim report)"
    path, why = write_timeline(run_dir, requests, steps, limits, title)
    if why is not None:
        notes.append(why)
    return old.get("timeline_png", path) if path is not None else None


def _read_config(path: Path, notes: list[str]) -> dict[str, Any]:
    if not path.is_file():  # a pipe or a device: said, not read (load_yaml would wait on one)
        notes.append(f"{CONFIG}: {not_a_file(path)}; model and budget fields left out")
        return {}
    try:  # the project's one loader: an alias bomb or deep nesting is refused, not a hang
        data = load_yaml(path)
    except ConfigError as exc:
        data, why = {}, " ".join(str(exc).removeprefix(f"{path}: ").split())[:80]  # one line
    else:
        why = "empty" if not data else ""
    if why:
        notes.append(f"{CONFIG}: not a run's config ({why}); model and budget fields left out")
    return data


def _workload(config: dict[str, Any]) -> dict[str, Any]:
    """The workload that ran: `config: workload:` (run_dir.write_config), or the top-level copy
    a run directory written before 2026-12 kept it in."""
    return _section(config, "workload") or _section(_section(config, "config"), "workload")


def _section(data: dict[str, Any], key: str) -> dict[str, Any]:
    value = data.get(key)
    return value if isinstance(value, dict) else {}


def _finite(value: Any) -> bool:
    if not isinstance(value, (int, float)) or isinstance(value, bool):
        return False
    try:
        return math.isfinite(value)
    except OverflowError:  # an int past a float's range (10**400)
        return False


def _text(value: Any) -> str | None:
    """A name read back from a file the user may have damaged: a string, or nothing."""
    return value if isinstance(value, str) else None


def _count(value: Any) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) and value >= 0 else None


def _percentiles(value: Any) -> tuple[float, ...]:
    ok = isinstance(value, list) and value and all(_finite(v) and 0 <= v <= 100 for v in value)
    return tuple(value) if ok else (50, 90, 95, 99)


def _goodput(value: Any) -> dict[str, float] | None:
    ok = isinstance(value, dict) and all(_finite(v) and v >= 0 for v in value.values())
    return value if ok and value else None


def _read_old_summary(path: Path, notes: list[str]) -> dict[str, Any]:
    if not path.is_file():
        return {}
    try:
        data = json.loads(path.read_text())
    except (ValueError, RecursionError):
        return {}  # said as for a list or a number: not a JSON object
    return data if isinstance(data, dict) else {}


def _records(path: Path, cls: Any, notes: list[str]) -> list[Any]:
    """The file's records; one whose fields are not what the run writes is skipped, with a note."""
    out, bad = [], []
    for i, row in enumerate(read_rows(path, notes), 1):
        try:
            record = cls.from_json(row)
        except (ValueError, TypeError):
            record = None
        if record is not None and _plausible(record):
            out.append(record)
        else:
            bad.append(i)
    if bad:
        shown = ", ".join(map(str, bad[:5])) + (", ..." if len(bad) > 5 else "")
        notes.append(f"{path.name}: skipped {len(bad)} record(s) with missing or impossible "
                     f"fields (non-finite, negative, a count not an int within int64, a time "
                     f"past {MAX_CLOCK_S:.0e} s, a token before its arrival; record {shown})")
    return out


def _plausible(record: Any) -> bool:
    """Each numeric field a finite number >= 0 (counts, bytes, times on the run's clock; or None
    where the record allows it), an int field an int that fits int64 (the summary's arrays: a
    kv_bytes of 1e20 overflowed them, a count of 96.7 was cut to 96), no time (a field named *_s)
    past MAX_CLOCK_S, and no token before its request arrived, as written."""
    for f in dataclasses.fields(record):
        value, kind = getattr(record, f.name), str(f.type).split(" ")[0]
        if value is None and "None" in str(f.type):
            continue
        if kind.startswith("tuple[float"):
            if not isinstance(value, tuple) or not all(map(_at_least_0, value)):
                return False
        elif (kind == "int" and not _int64_count(value)
              or kind == "float" and not _at_least_0(value)
              or kind == "str" and not isinstance(value, str)):
            return False
        times_s = value if isinstance(value, tuple) else (value,)
        if f.name.endswith("_s") and any(t > MAX_CLOCK_S for t in times_s):
            return False
    tokens_s = getattr(record, "token_times_s", ())  # an arrival at -1e308 overflowed numpy
    return not tokens_s or min(tokens_s) >= record.arrival_s


def _at_least_0(value: Any) -> bool:
    """A float field (a time) as a run writes it: finite and >= 0 (float64 columns)."""
    return _finite(value) and value >= 0


def _int64_count(value: Any) -> bool:
    """An int field: the summary reads it as an int64 column (request_arrays.step_columns), so a
    count past INT64_MAX is damage (OverflowError), and 96.7 is not a count."""
    return _count(value) is not None and value <= INT64_MAX


def _once_each(requests: list[RequestRecord], notes: list[str]) -> list[RequestRecord]:
    """One record per request id (the first); duplicates are counted once, with a note."""
    seen: dict[int, RequestRecord] = {}
    for r in requests:
        seen.setdefault(r.request_id, r)
    if len(seen) < len(requests):
        notes.append(f"{REQUESTS}: {len(requests) - len(seen)} duplicated request record(s) "
                     "counted once")
    return list(seen.values())


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
    cfg, resolved = _section(config, "config"), _section(config, "resolved")
    return {
        "model": cfg.get("model"), "dtype": resolved.get("dtype"),
        "quantize_bits": cfg.get("quantize"), "executor": cfg.get("executor"),
        "workload": _workload(config).get("name"),
        "max_num_seqs": _section(resolved, "scheduler").get("max_num_seqs"),
        "memory_budget_bytes": resolved.get("memory_budget_bytes"),
        "budget_source": resolved.get("budget_source"),
        "num_steps": sum(s.num_steps for s in steps), "num_plans": len(steps),
        "kv_account_mismatches": sum(s.kv_bytes_measured != s.kv_bytes for s in steps),
        "interrupted": True, "run_dir": str(run_dir), "env": config.get("env"),
    }
