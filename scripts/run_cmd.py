"""`batchsim run [CONFIG.yaml]`: replay a workload through the continuous-batching engine on real
weights (or the simulator) and report vLLM-compatible serving metrics."""

from __future__ import annotations

import argparse
import contextlib
from pathlib import Path
from typing import TYPE_CHECKING

from batchsim.configs import ConfigError
from batchsim.scripts.common import (
    EXIT_SERVED_NOTHING,
    CommandFailed,
    add_field_argument,
    add_rank_arguments,
    err,
)
from batchsim.scripts.run_args import (
    add_engine_arg,
    add_kv_bits_arg,
    add_model_args,
    add_scheduler_args,
    config_from_args,
    percentiles,
)
from batchsim.scripts.run_view import ConsoleView, print_summary, warn_profile_mismatch
from batchsim.scripts.spec_args import add_spec_args
from batchsim.scripts.workload_args import add_workload_args
from batchsim.server.engine.run_config import RunConfig
from batchsim.server.results.drawing_start import end_early

if TYPE_CHECKING:
    from batchsim.server.results.timeline_draw import DrawingProcess


def add_parser(p: argparse.ArgumentParser) -> None:
    p.add_argument("config", nargs="?", help="run config YAML (model/scheduler/workload sections) "
                   "or a workload YAML; default: the built-in default workload")
    g = add_model_args(p)
    add_kv_bits_arg(g)
    add_engine_arg(g)
    add_scheduler_args(p)
    add_spec_args(p)
    add_workload_args(p)
    g = p.add_argument_group("report")
    g.add_argument("--goodput", nargs="+", metavar="SLO:MS",
                   help="SLOs in ms, e.g. ttft:500 tpot:50 e2el:4000: the summary adds "
                        "request_goodput, the requests/s that met every one")
    add_field_argument(g, RunConfig, "percentiles", "percentiles to report", type=percentiles)
    g.add_argument("--out", default="runs", help="directory for run directories")
    add_field_argument(g, RunConfig, "target", "an OpenAI-compatible base URL (e.g. "
                       "http://127.0.0.1:8000/v1): send the workload over HTTP instead of running "
                       "in-process; $OPENAI_API_KEY, if set, is sent as the bearer token")
    g.add_argument("--no-progress", action="store_true", help="no live progress line")
    g.add_argument("--no-timeline", action="store_true", help="no timeline.png in the run dir")
    add_rank_arguments(p, "run", "the KV budget is per rank; the summary's "
                       "output_tokens_sha256 compares runs token for token")




def run(args: argparse.Namespace) -> dict:
    try:
        cfg = config_from_args(args)
    except (ValueError, TypeError) as exc:
        if isinstance(exc, ConfigError):
            raise
        raise ConfigError(str(exc)) from None
    # A simulated run's timeline.png by a child process: it imports matplotlib while the run
    # opens and runs. A measured run's is drawn after it: nothing else runs while it decodes.
    apart = not args.no_timeline and cfg.executor == "sim"
    if cfg.target or not apart:
        end_early()  # the child the program started for a picture this run does not draw apart
    if args.ranks > 1 or args.hostfile:
        return _run_ranks(args, cfg)
    if cfg.target:
        from batchsim.server.results.jsonio import check_writable

        check_writable(Path(args.out))  # before the workload: its records would be lost
        summary = run_over_http(cfg, Path(args.out), progress=not args.no_progress)
        if summary["completed"] == 0 and summary["failed"] > 0 and not summary["interrupted"]:
            raise CommandFailed(_all_failed(summary), summary)
        return summary
    from batchsim.server.results.timeline_draw import DrawingProcess

    with DrawingProcess() if apart else contextlib.nullcontext(not args.no_timeline) as drawing:
        summary = _run_here(cfg, args, drawing)
    if summary["completed"] == 0 and not summary.get("interrupted"):
        raise CommandFailed(_served_nothing(summary, cfg.workload.num_prompts), summary,
                            EXIT_SERVED_NOTHING)
    return summary


def _run_here(cfg: RunConfig, args: argparse.Namespace, drawing: bool | DrawingProcess) -> dict:
    from batchsim.server.engine.run_path import RecordsLost, run_config

    warn_profile_mismatch(cfg)
    try:  # SIGTERM, SIGHUP as Ctrl-C: each stops the run and leaves its records and summary
        return run_config(cfg, Path(args.out), ConsoleView(progress=not args.no_progress),
                          timeline=drawing)
    except RecordsLost as exc:
        raise CommandFailed(str(exc), exc.summary) from None


def _all_failed(summary: dict) -> str:
    """Why every request over HTTP failed, with the fix when the status says it."""
    statuses = summary["http_statuses"]
    counted = ", ".join(f"{n} x {status}" for status, n in statuses.items())  # not a dict's repr
    text = f"all {summary['failed']} requests to {summary['endpoint']} failed (HTTP {counted})"
    if "401" in statuses or "403" in statuses:
        text += ("; the server wants an API key: set OPENAI_API_KEY (sent as "
                 "`Authorization: Bearer KEY`)")
    if "404" in statuses and "/v1" not in summary["endpoint"]:  # the usual slip: no /v1
        text += (f"; OpenAI-compatible servers (batchsim serve too) answer under /v1: try "
                 f"--target {_with_v1(summary['target'])}")
    return f"{text}; the first: {_first(summary, 'error')}"  # a 200 that sent no [DONE] ...


def _with_v1(target: str) -> str:
    """`target` with /v1 after its base, before the endpoint it named (if it named one)."""
    from batchsim.workloads.client.stream import endpoint

    named = endpoint(target)
    named_suffix = named.url.removeprefix(named.base) if named.url == target.rstrip("/") else ""
    return f"{named.base}/v1{named_suffix}"


def _served_nothing(summary: dict, num_prompts: int) -> str:
    """The first rejected request's reason, from the run's requests.jsonl."""
    return (f"served nothing: {summary.get('num_rejected', 0)} of {num_prompts} requests rejected "
            f"(the first: {_first(summary, 'finish_reason', 'rejected')}); records in "
            f"{summary['run_dir']}")


def _first(summary: dict, field: str, status: str | None = None) -> str:
    """`field` of the run's first request (of `status`) that has one, from its requests.jsonl."""
    import json

    with (Path(summary["run_dir"]) / "requests.jsonl").open() as f:
        for row in map(json.loads, f):
            if row.get(field) and status in (None, row.get("status")):
                return str(row[field])
    return "see requests.jsonl"


def _run_ranks(args: argparse.Namespace, cfg: RunConfig) -> dict | None:
    from batchsim.server.distributed import rank

    if cfg.executor != "mlx" or cfg.target:
        raise ConfigError("--ranks runs the real executor in-process (--executor mlx, no "
                          "--target); simulate clusters with `batchsim size --macs N`")
    if rank.is_rank_process():
        return rank.run_rank(cfg, Path(args.out), ConsoleView(progress=not args.no_progress))
    import sys

    from batchsim.server.distributed.launch import launch, prebuild
    from batchsim.server.platform.env import default_dtype

    dtype = cfg.dtype if cfg.dtype != "auto" else default_dtype()
    prebuild(cfg.model, dtype, cfg.quantize, args.ranks, local=not args.hostfile)
    try:
        launch(getattr(args, "_argv", None) or sys.argv[1:], args.ranks, args.hostfile)
    except RuntimeError as exc:
        raise CommandFailed(str(exc), {"error": str(exc), "ranks": args.ranks}) from None
    return None  # rank 0 printed the summary


def run_over_http(cfg: RunConfig, out_dir: Path, progress: bool = True) -> dict:
    from batchsim.scripts.progress import RunProgress
    from batchsim.workloads.client.load import run_http
    from batchsim.workloads.client.prompts import open_prompt_maker
    from batchsim.workloads.client.stream import endpoint

    prompts = open_prompt_maker(cfg)
    spec = cfg.workload
    err.print(f"batchsim run: {spec.num_prompts} requests of workload {spec.name} to "
              f"{endpoint(cfg.target or '').url} (prompts from {prompts.describe()})", markup=False)
    with RunProgress(spec.num_prompts, f"http {spec.name}", enabled=progress) as bar:
        summary = run_http(cfg, out_dir, prompts, on_answer=bar.advance)
    print_summary(summary)
    return summary
