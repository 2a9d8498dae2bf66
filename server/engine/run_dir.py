"""A run directory's files beside the streamed records (server/results/run_files.py):
config.yaml first, summary.json and timeline.png at the end, and all of them for a run stopped
before its model loaded."""

from __future__ import annotations

import dataclasses
import logging
from pathlib import Path
from typing import TYPE_CHECKING, Any

import yaml
from batchsim.server.results import run_files
from batchsim.server.results.json_text import jsonable
from batchsim.server.results.metrics import summarize
from batchsim.server.results.records import RequestRecord, StepRecord
from batchsim.server.results.run_files import RecordStream
from batchsim.server.results.timeline import (
    Limits,
    Panels,
    run_title,
    timeline_panels,
    timeline_title,
)
from batchsim.server.results.timeline_draw import write_timeline
from batchsim.workloads.spec import WorkloadSpec

if TYPE_CHECKING:
    import numpy as np
    from batchsim.server.engine.run_config import RunConfig
    from batchsim.server.engine.session import Session


def write_config(run_dir: Path, cfg: RunConfig, spec: WorkloadSpec,
                 session: Session | None) -> None:
    """config.yaml: the run's config with the workload that ran (`spec`, a sweep's point's own)
    under `config: workload:`, the one copy a rerun reads and an edit changes, and, once the
    model is open, what it resolved to."""
    resolved: dict[str, Any] = {"config": {**dataclasses.asdict(cfg),
                                           "workload": dataclasses.asdict(spec)}}
    if session is not None:
        resolved["resolved"] = {
            "model_path": str(session.ref.path), "dtype": session.dtype,
            "weight_bytes": session.weight_bytes,
            "memory_budget_bytes": session.memory_budget_bytes,
            "budget_source": session.budget_source,
            "kv_bytes_per_token": session.kv_bytes_per_token,
            "kv_budget_bytes": session.kv_budget_bytes,
            "scheduler": dataclasses.asdict(session.scheduler_config()),
        }
        resolved["env"] = session.environment()
    text = yaml.safe_dump(jsonable(resolved), sort_keys=False)
    run_files.replace_atomically(run_dir / run_files.CONFIG, text.encode())


def write_summary_noting_failures(run_dir: Path | None, summary: dict[str, Any],
                                  error: OSError | None) -> str | None:
    """summary.json if it can be written (run_files.write_summary); what could not be, the
    records' `error` included (a full disk), in one line; None if nothing failed."""
    problems = [str(error)] if error else []
    if run_dir:
        try:
            run_files.write_summary(run_dir, jsonable(summary))
        except OSError as exc:
            problems.append(str(exc))
    if not problems:
        return None
    kept = (getattr(error, "kept", run_files.WriteFailed.kept)
            if run_dir is None or run_dir.is_dir() else
            "its directory was removed or moved: its records went with it")
    return f"{'; '.join(problems)} (the run stopped; {kept})"


def draw_run_timeline(run_dir: Path, records: list[RequestRecord], steps: list[StepRecord],
                      session: Session, spec: WorkloadSpec) -> str | None:
    """timeline.png from the run's records; its path (None: not drawn, a warning says why)."""
    limits, title = _timeline_limits_title(records, session, spec)
    return noted(write_timeline(run_dir, records, steps, limits, title))


def run_timeline_panels(records: list[RequestRecord], steps: list[StepRecord],
                        session: Session, spec: WorkloadSpec,
                        token_times_s: np.ndarray | tuple[np.ndarray, np.ndarray],
                        col: dict[str, np.ndarray] | None = None) -> Panels:
    """What the run's timeline.png shows (for a drawing process)."""
    return timeline_panels(records, steps, *_timeline_limits_title(records, session, spec),
                           token_times_s, col)


def _timeline_limits_title(records: list[RequestRecord], session: Session,
                           spec: WorkloadSpec) -> tuple[Limits, str]:
    sched = session.scheduler_config()
    limits = Limits(session.kv_budget_bytes, sched.max_num_seqs, sched.max_num_batched_tokens)
    cfg = session.config
    what = run_title(session.ref.name, session.dtype, cfg.quantize, cfg.executor,
                     cfg.device_profile, cfg.engine, session.environment())
    return limits, timeline_title(what, dataclasses.asdict(spec), len(records))


def noted(drawn: tuple[str | None, str | None]) -> str | None:
    """A drawing's path; why it failed, as a warning."""
    path, why = drawn
    if why is not None:
        logging.getLogger("batchsim").warning(why)
    return path


def record_stopped_before_start(cfg: RunConfig, run_dir: Path, timeline: bool = True,
                                reason: str | None = None) -> dict[str, Any]:
    """A run stopped by a signal (`reason`, its name) before its model was loaded: empty records
    and a summary that says so, in the run directory already made for it."""
    write_config(run_dir, cfg, cfg.workload, None)
    RecordStream(run_dir).close([])
    summary = summarize([], [], duration_s=0.0, percentiles=cfg.percentiles,
                        goodput_slo_ms=cfg.goodput)
    summary.update({"model": cfg.model, "executor": cfg.executor, "workload": cfg.workload.name,
                    "interrupted": True, "interrupt_reason": reason, "run_dir": str(run_dir)})
    if timeline:
        summary["timeline_png"] = write_timeline(run_dir, [], [], Limits(),
                                                 f"{cfg.model}: stopped before it started")[0]
    run_files.write_summary(run_dir, jsonable(summary))
    return summary
