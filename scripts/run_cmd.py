"""`batchsim run [CONFIG.yaml]`: replay a workload through the continuous-batching engine on real
weights (or the simulator) and report vLLM-compatible serving metrics."""

from __future__ import annotations

import argparse
import dataclasses
import shutil
import signal
from pathlib import Path
from typing import TYPE_CHECKING

from batchsim.configs import ConfigError
from batchsim.scheduler.config import KV_LAYOUTS, SchedulerSettings
from batchsim.scheduler.pool_geometry import KV_STEP, PAGE_TOKENS
from batchsim.scripts.common import (
    EXIT_SERVED_NOTHING,
    MAX_FLOAT,
    CommandFailed,
    add_field_argument,
    add_rank_arguments,
    bounded,
    err,
    out,
    positive_float,
)
from batchsim.scripts.spec_args import add_spec_args, spec_overrides
from batchsim.scripts.workload_args import add_sharing_args, sharing_from_args, trace_override
from batchsim.server.engine.run_config import (
    DTYPES,
    MAX_MEMORY_GB,
    RunConfig,
    load_run_config,
    with_run_overrides,
)
from batchsim.server.models.spec import KV_BITS, QUANT_BITS
from batchsim.workloads.lengths import LengthSpec, parse_length
from batchsim.workloads.spec import TraceSpec, WorkloadSpec, resolve_workload

if TYPE_CHECKING:
    from batchsim.server.engine.interrupts import Interrupts
    from batchsim.server.engine.session import Session


def rate(text: str) -> float:
    return float("inf") if text.strip().lower() in ("inf", "infinity") else _finite_rate(text)


_finite_rate = bounded(float, 0, MAX_FLOAT, lo_open=True)
_percentile = bounded(float, 0, 100)
_memory_gb = bounded(float, 0, MAX_MEMORY_GB, lo_open=True)


def length(text: str) -> LengthSpec:
    """parse_length for argparse: its ConfigError's message, not argparse's generic one."""
    try:
        return parse_length(text)
    except ConfigError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def percentiles(text: str) -> tuple[float, ...]:
    try:
        values = tuple(_percentile(x) for x in text.split(",") if x.strip())
    except argparse.ArgumentTypeError:
        values = ()
    if not values:
        raise argparse.ArgumentTypeError(f"expected comma-separated numbers in 0..100, "
                                         f"got {text!r}")
    return values


def add_model_args(p: argparse.ArgumentParser, simulated: bool = True):
    """The model and executor flags; returns their group, for a command's own (--kv-bits).
    simulated=False (serve): real compute only, no --executor or --device-profile."""
    g = p.add_argument_group("model and executor")
    add_field_argument(g, RunConfig, "model", "zoo name (see `batchsim models`), model directory, "
                       "or hub id")
    add_field_argument(g, RunConfig, "dtype", "auto: float32 on the CPU backend (the only dtype "
                       "using BLAS), float16 on GPUs", choices=list(DTYPES))
    add_field_argument(g, RunConfig, "quantize", "4- or 8-bit weights (zoo models)",
                       choices=list(QUANT_BITS))
    if simulated:
        add_field_argument(g, RunConfig, "executor", "mlx: real compute; sim: calibrated roofline "
                           "on a virtual clock; fake: zero-cost (measures scheduler overhead)")
        add_field_argument(g, RunConfig, "device_profile",
                           "simulator device profile (configs/devices NAME or YAML)")
    add_field_argument(g, RunConfig, "kv_layout", "the decode pool's full-attention and MLA "
                       "layers: padded rows (B x longest, in 256-token steps) or paged "
                       f"{PAGE_TOKENS}-token blocks per row (gathered each step)",
                       choices=list(KV_LAYOUTS))
    add_field_argument(g, RunConfig, "memory_gb", "memory budget for weights + KV cache in GiB "
                       "(emulate a smaller machine); default: MLX's working set on a GPU, 75%% of "
                       "RAM on the CPU backend", type=_memory_gb)
    return g


def add_kv_bits_arg(g: argparse._ArgumentGroup) -> None:
    add_field_argument(g, RunConfig, "kv_bits", "K/V held as mlx-lm's QuantizedKVCache at 4 or 8 "
                       "bits (group 64): full-attention layers, real or simulated",
                       choices=list(KV_BITS))


def add_engine_arg(g: argparse._ArgumentGroup) -> None:
    from batchsim.server.perf.engines import engine_help

    add_field_argument(g, RunConfig, "engine", engine_help())


def add_scheduler_args(p: argparse.ArgumentParser, max_num_seqs: bool = True):
    """Scheduler flags, unset unless given (they override a config's `scheduler:`): the group."""
    g = p.add_argument_group("scheduler")
    if max_num_seqs:
        add_field_argument(g, SchedulerSettings, "max_num_seqs", "largest batch (running requests)")
    add_field_argument(g, SchedulerSettings, "max_num_batched_tokens", "tokens per step")
    add_field_argument(g, SchedulerSettings, "prefill_step_size",
                       f"prefill chunk, multiple of {KV_STEP}")
    add_field_argument(g, SchedulerSettings, "policy", "decode-first: every step decodes all "
                       "running requests; prefill-first: a step with prefill work only prefills")
    add_field_argument(g, SchedulerSettings, "prefix_cache", "reuse cached prompt blocks' KV")
    return g


def add_workload_args(p: argparse.ArgumentParser, defaults: WorkloadSpec | None = None) -> None:
    """Workload flags, unset unless given (they override the config's workload). The defaults shown
    are those of `defaults`: the workload a run without a config or --workload gets."""
    w = defaults or RunConfig().workload
    g = p.add_argument_group("workload (overrides the YAML)", "Unset flags keep the config's "
                             f"values; defaults shown: the built-in '{w.name}' workload's.")
    add_field_argument(g, w, "name", "built-in workload name (configs/workloads) or a workload "
                       "YAML", flag="--workload")
    add_field_argument(g, w, "num_prompts", "requests to send; with --trace: every row of the "
                       "trace unless given")
    add_field_argument(g, w, "request_rate", "requests/s; 'inf' sends all at once", type=rate)
    add_field_argument(g, w, "burstiness", "gamma shape: 1 = Poisson, <1 burstier",
                       type=positive_float)
    add_field_argument(g, w, "arrival", "arrival process")
    add_field_argument(g, w, "ramp_end_rate", "'ramp': the rate (requests/s) reached by the last "
                       "request, rising linearly from --request-rate (sets --arrival ramp)")
    add_field_argument(g, w, "concurrency", "closed loop: keep this many requests in flight")
    add_field_argument(g, w, "max_concurrency", "open loop: cap on requests in flight")
    add_field_argument(g, w, "input_len", "prompt lengths: N, uniform:MIN:MAX, "
                       "normal:MEAN:STD[:MAX], lognormal:MEAN:STD[:MAX], zipf:A:MIN:MAX",
                       type=length)
    add_field_argument(g, w, "output_len", "output lengths (same forms)", type=length)
    add_field_argument(g, w, "seed", "workload seed (arrivals, lengths, prompt ids)")
    g.add_argument("--trace", help="replay a trace: Azure CSV or Mooncake JSONL (path, or a file "
                   "in configs/traces)")
    add_field_argument(g, TraceSpec, "time_scale", "trace time factor (0.1 = 10x faster)",
                       type=positive_float)
    add_field_argument(g, TraceSpec, "max_input_len", "cap trace prompt lengths")
    add_field_argument(g, TraceSpec, "max_output_len", "cap trace output lengths")
    add_field_argument(g, RunConfig, "ignore_eos", "generate each request's full output length",
                       action=argparse.BooleanOptionalAction)
    add_sharing_args(g)


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
                   help="SLOs, e.g. ttft:500 tpot:50 e2el:4000")
    add_field_argument(g, RunConfig, "percentiles", "percentiles to report", type=percentiles)
    g.add_argument("--out", default="runs", help="directory for run directories")
    add_field_argument(g, RunConfig, "target", "an OpenAI-compatible base URL (e.g. "
                       "http://127.0.0.1:8000/v1): send the workload over HTTP instead of running "
                       "in-process; $OPENAI_API_KEY, if set, is sent as the bearer token")
    g.add_argument("--no-progress", action="store_true", help="no live progress line")
    g.add_argument("--no-timeline", action="store_true", help="no timeline.png in the run dir")
    add_rank_arguments(p, "run", "the KV budget is per rank; the summary's "
                       "output_tokens_sha256 compares runs token for token")


def config_from_args(args: argparse.Namespace, default: RunConfig | None = None) -> RunConfig:
    """The run config: the YAML (else `default`, else RunConfig()), then the flags given."""
    from batchsim.server.results.metrics import parse_goodput

    cfg = load_run_config(args.config) if args.config else (default or RunConfig())
    if args.workload:
        cfg = dataclasses.replace(cfg, workload=resolve_workload(args.workload))
    workload = {
        "num_prompts": args.num_prompts, "request_rate": args.request_rate,
        "burstiness": args.burstiness,
        "arrival": "trace" if args.trace else args.arrival, "concurrency": args.concurrency,
        "ramp_end_rate": args.ramp_end_rate,
        "max_concurrency": args.max_concurrency, "input_len": args.input_len,
        "output_len": args.output_len,
        "seed": args.seed, "trace": trace_override(args, cfg),
    }
    cfg = sharing_from_args(args, cfg, workload)
    if args.trace and args.num_prompts is None:  # --trace FILE replays all of FILE
        from batchsim.workloads.requests import trace_length

        workload["num_prompts"] = trace_length(workload["trace"])
    if args.concurrency and not args.arrival:
        workload["arrival"] = "closed"
    if args.ramp_end_rate and not args.arrival:
        workload["arrival"] = "ramp"
    if args.burstiness and not args.arrival and workload["arrival"] is None:
        workload["arrival"] = "gamma"
    if args.ignore_eos and (workload.get("chat") or cfg.workload.chat) is not None:
        raise ConfigError("--ignore-eos: the chat workload honours EOS (replies end where the "
                          "model ends them); use a synthetic workload to generate full lengths")
    return with_run_overrides(
        cfg, workload, model=args.model, dtype=args.dtype, quantize=args.quantize,
        kv_bits=getattr(args, "kv_bits", None), kv_layout=args.kv_layout,
        executor=args.executor, device_profile=args.device_profile, memory_gb=args.memory_gb,
        engine=getattr(args, "engine", None),
        ignore_eos=args.ignore_eos, target=args.target, percentiles=args.percentiles,
        goodput=parse_goodput(args.goodput) if args.goodput else None,
        **scheduler_overrides(args),
    )


def scheduler_overrides(args: argparse.Namespace) -> dict[str, object]:
    """The scheduler and speculative decoding flags as with_run_overrides keys (None: not given)."""
    keys = ("max_num_seqs", "max_num_batched_tokens", "prefill_step_size", "policy", "prefix_cache")
    return {f"scheduler.{n}": getattr(args, n, None) for n in keys} | spec_overrides(args)


def run(args: argparse.Namespace) -> dict:
    try:
        cfg = config_from_args(args)
    except (ValueError, TypeError) as exc:
        if isinstance(exc, ConfigError):
            raise
        raise ConfigError(str(exc)) from None
    if args.ranks > 1 or args.hostfile:
        return _run_ranks(args, cfg)
    if cfg.target:
        from batchsim.server.results.jsonio import check_writable

        check_writable(Path(args.out))  # before the workload: its records would be lost
        summary = run_over_http(cfg, Path(args.out), progress=not args.no_progress)
        if summary["completed"] == 0 and summary["failed"] > 0:
            raise CommandFailed(_all_failed(summary), summary)
        return summary
    from batchsim.server.engine.interrupts import Interrupts

    warn_profile_mismatch(cfg)
    # SIGTERM as Ctrl-C: either stops the run and leaves its records and summary.
    summary = run_in_process(cfg, Path(args.out), progress=not args.no_progress,
                             interrupts=Interrupts(), timeline=not args.no_timeline)
    if summary["completed"] == 0 and not summary.get("interrupted"):
        raise CommandFailed(_served_nothing(summary, cfg.workload.num_prompts), summary,
                            EXIT_SERVED_NOTHING)
    return summary


def _all_failed(summary: dict) -> str:
    """Why every request over HTTP failed, with the fix when the status says it."""
    statuses = summary["http_statuses"]
    text = (f"all {summary['failed']} requests to {summary['endpoint']} failed "
            f"(HTTP statuses: {statuses})")
    if "401" in statuses or "403" in statuses:
        text += ("; the server wants an API key: set OPENAI_API_KEY (sent as "
                 "`Authorization: Bearer KEY`)")
    return text


def _served_nothing(summary: dict, num_prompts: int) -> str:
    """The first rejected request's reason, from the run's requests.jsonl."""
    import json

    reason = "see requests.jsonl"
    with (Path(summary["run_dir"]) / "requests.jsonl").open() as f:
        rejected = [r for r in map(json.loads, f) if r.get("status") == "rejected"]
    if rejected:
        reason = f"the first: {rejected[0].get('finish_reason')}"
    return (f"served nothing: {summary.get('num_rejected', 0)} of {num_prompts} requests rejected "
            f"({reason}); records in {summary['run_dir']}")


def _run_ranks(args: argparse.Namespace, cfg: RunConfig) -> dict | None:
    from batchsim.server.distributed import rank

    if cfg.executor != "mlx" or cfg.target:
        raise ConfigError("--ranks runs the real executor in-process (--executor mlx, no "
                          "--target); simulate clusters with `batchsim size --macs N`")
    if rank.is_rank_process():
        return rank.run_rank(cfg, lambda s: run_session(s, Path(args.out), not args.no_progress))
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


def warn_profile_mismatch(cfg: RunConfig) -> None:
    """One yellow stderr line when a simulated run's profile was calibrated on another machine."""
    from batchsim.server.perf.devices import config_warning

    warning = config_warning(cfg)
    if warning:
        err.print(f"[yellow]{warning}[/yellow]", soft_wrap=True)


def run_over_http(cfg: RunConfig, out_dir: Path, progress: bool = True) -> dict:
    from batchsim.scripts.progress import RunProgress
    from batchsim.workloads.client.load import run_http
    from batchsim.workloads.client.prompts import open_prompt_maker
    from batchsim.workloads.client.stream import endpoint

    prompts = open_prompt_maker(cfg)
    spec = cfg.workload
    err.print(f"batchsim run: {spec.num_prompts} requests of workload {spec.name} to "
              f"{endpoint(cfg.target or '').url} (prompts from {prompts.describe()})")
    with RunProgress(spec.num_prompts, f"http {spec.name}", enabled=progress) as bar:
        summary = run_http(cfg, out_dir, prompts, on_answer=bar.advance)
    _print_summary(summary)
    return summary


def run_in_process(cfg: RunConfig, out_dir: Path, progress: bool = True, label: str | None = None,
                   quiet: bool = False, interrupts: Interrupts | None = None,
                   timeline: bool = True) -> dict:
    """The run directory is made first (an unwritable out_dir fails before the model loads); a
    signal `interrupts` handles (default: Ctrl-C) stops the run at any point with its records."""
    from batchsim.server.engine.interrupts import Interrupts
    from batchsim.server.results.jsonio import new_run_dir

    spec = cfg.workload
    label = label or f"{cfg.model}-{spec.name}-{cfg.executor}"  # cfg.model: the session's ref.name
    with interrupts or Interrupts((signal.SIGINT,)) as stop:
        run_dir = new_run_dir(out_dir, label)
        return _open_and_run(cfg, run_dir, label, stop, progress and not quiet, quiet, timeline)


def _open_and_run(cfg: RunConfig, run_dir: Path, label: str, stop: Interrupts, progress: bool,
                  quiet: bool, timeline: bool = True) -> dict:
    from batchsim.server.engine.runner import record_stopped_before_start
    from batchsim.server.engine.session import open_session

    try:
        session = open_session(cfg)
    except KeyboardInterrupt:  # a signal while the model loads: nothing ran, and it says so
        with stop.answered_by():
            summary = record_stopped_before_start(cfg, run_dir, timeline)
            if not quiet:
                _print_summary(summary)
            return summary
    except BaseException:
        shutil.rmtree(run_dir, ignore_errors=True)  # still empty: a bad config leaves no trace
        raise
    return _run_opened(session, run_dir, label, stop, progress, quiet, timeline)


def run_session(session: Session, out_dir: Path, progress: bool = True) -> dict:
    """A session opened elsewhere (a rank's shard of the model) run as `run_in_process` runs one."""
    from batchsim.server.engine.interrupts import Interrupts
    from batchsim.server.results.jsonio import new_run_dir

    label = f"{session.ref.name}-{session.config.workload.name}-{session.config.executor}"
    with Interrupts((signal.SIGINT,)) as stop:
        return _run_opened(session, new_run_dir(out_dir, label), label, stop, progress, False)


def _run_opened(session: Session, run_dir: Path, label: str, stop: Interrupts, progress: bool,
                quiet: bool, timeline: bool = True) -> dict:
    from batchsim.scripts.progress import RunProgress
    from batchsim.server.engine.runner import run_workload

    cfg, spec = session.config, session.config.workload
    with stop.answered_by():
        if not quiet:
            err.print(f"batchsim run: {session.ref.name} ({session.dtype}) on {cfg.executor}, "
                      f"workload {spec.name}: {spec.num_prompts} requests, max_num_seqs "
                      f"{cfg.scheduler.max_num_seqs}, KV budget "
                      f"{session.kv_budget_bytes / 2**30:.2f} GiB ({session.budget_source})")
        with RunProgress(spec.num_prompts, label, enabled=progress) as bar:
            outcome = run_workload(session, spec, out_dir=None, label=label, on_step=bar.on_step,
                                   run_dir=run_dir, interrupts=stop, timeline=timeline)
        if not quiet:
            _print_summary(outcome.summary)
        if outcome.records_error:  # a full disk: the run stopped, what it wrote is kept
            raise CommandFailed(outcome.records_error, outcome.summary)
        return outcome.summary


def _print_summary(summary: dict) -> None:
    from batchsim.scripts.report import summary_table

    out.print(summary_table(summary))
    if summary.get("interrupted"):
        out.print("[yellow]interrupted: records so far are in the run directory[/yellow]")
    out.print(f"run directory: {summary['run_dir']}")
