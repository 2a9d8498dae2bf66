"""`batchsim run [CONFIG.yaml]`: replay a workload through the continuous-batching engine on real
weights (or the simulator) and report vLLM-compatible serving metrics."""

from __future__ import annotations

import argparse
import dataclasses
from pathlib import Path

from batchsim.scripts.common import err, out, positive_float
from batchsim.server.engine.run_config import RunConfig, load_run_config, with_run_overrides
from batchsim.workloads.spec import resolve_workload
from batchsim.workloads.lengths import parse_length
from batchsim.workloads.spec import TraceSpec


def rate(text: str) -> float:
    return float("inf") if text.strip().lower() in ("inf", "infinity") else positive_float(text)


def add_model_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("model and executor")
    g.add_argument("--model", help="zoo name (see `batchsim models`), model directory, or hub id "
                   "[default: smollm2-135m]")
    g.add_argument("--dtype", choices=["auto", "float32", "float16", "bfloat16"],
                   help="auto: float32 on the CPU backend (the only dtype using BLAS), float16 on GPUs")
    g.add_argument("--quantize", type=int, choices=[4, 8], help="4- or 8-bit weights (zoo models)")
    g.add_argument("--executor", choices=["mlx", "sim", "fake"],
                   help="mlx: real compute; sim: calibrated roofline on a virtual clock; "
                   "fake: zero-cost (measures scheduler overhead) [default: mlx]")
    g.add_argument("--device-profile", help="simulator device profile (configs/devices NAME or YAML)")
    g.add_argument("--memory-gb", type=positive_float,
                   help="memory budget for weights + KV cache in GiB (emulate a smaller machine); "
                   "default: MLX's working set on a GPU, 75%% of RAM on the CPU backend")


def add_scheduler_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("scheduler")
    g.add_argument("--max-num-seqs", type=int, help="largest batch (running requests) [default: 32]")
    g.add_argument("--max-num-batched-tokens", type=int, help="tokens per step [default: 2048]")
    g.add_argument("--prefill-step-size", type=int, help="prefill chunk, multiple of 256 [default: 512]")
    g.add_argument("--policy", choices=["decode-first", "prefill-first"], help="[default: decode-first]")


def add_workload_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("workload (overrides the YAML)")
    g.add_argument("--workload", help="built-in workload name (configs/workloads) or a workload YAML")
    g.add_argument("--num-prompts", type=int, help="requests to send")
    g.add_argument("--request-rate", type=rate, help="requests/s; 'inf' sends all at once")
    g.add_argument("--burstiness", type=positive_float, help="gamma shape: 1 = Poisson, <1 burstier")
    g.add_argument("--arrival", choices=["poisson", "gamma", "constant", "ramp", "closed", "trace"])
    g.add_argument("--concurrency", type=int, help="closed loop: keep this many requests in flight")
    g.add_argument("--max-concurrency", type=int, help="open loop: cap on requests in flight")
    g.add_argument("--input-len", type=parse_length, help="prompt lengths: N, uniform:MIN:MAX, "
                   "normal:MEAN:STD[:MAX], lognormal:MEAN:STD[:MAX], zipf:A:MIN:MAX")
    g.add_argument("--output-len", type=parse_length, help="output lengths (same forms)")
    g.add_argument("--seed", type=int, help="workload seed (arrivals, lengths, prompt ids)")
    g.add_argument("--trace", help="replay a trace: Azure CSV or Mooncake JSONL (path, or a file "
                   "in configs/traces)")
    g.add_argument("--time-scale", type=positive_float, help="trace time factor (0.1 = 10x faster)")
    g.add_argument("--max-input-len", type=int, help="cap trace prompt lengths")
    g.add_argument("--max-output-len", type=int, help="cap trace output lengths")
    g.add_argument("--ignore-eos", action=argparse.BooleanOptionalAction, default=None,
                   help="generate each request's full output length [default: on]")


def add_parser(p: argparse.ArgumentParser) -> None:
    p.add_argument("config", nargs="?", help="run config YAML (model/scheduler/workload sections) "
                   "or a workload YAML; default: the built-in default workload")
    add_model_args(p)
    add_scheduler_args(p)
    add_workload_args(p)
    g = p.add_argument_group("report")
    g.add_argument("--goodput", nargs="+", metavar="SLO:MS", help="SLOs, e.g. ttft:500 tpot:50 e2el:4000")
    g.add_argument("--percentiles", default="50,90,95,99", help="percentiles to report")
    g.add_argument("--out", default="runs", help="directory for run directories")
    g.add_argument("--target", help="an OpenAI-compatible base URL (e.g. http://127.0.0.1:8000/v1): "
                   "send the workload over HTTP instead of running in-process")
    g.add_argument("--no-progress", action="store_true", help="no live progress line")


def config_from_args(args: argparse.Namespace) -> RunConfig:
    from batchsim.server.results.metrics import parse_goodput

    cfg = load_run_config(args.config) if args.config else RunConfig()
    if args.workload:
        cfg = dataclasses.replace(cfg, workload=resolve_workload(args.workload))
    trace = None
    if args.trace:
        trace = TraceSpec(path=args.trace, time_scale=args.time_scale or 1.0,
                          max_input_len=args.max_input_len, max_output_len=args.max_output_len)
    elif any(v is not None for v in (args.time_scale, args.max_input_len, args.max_output_len)):
        base = cfg.workload.trace
        if base is None:
            raise ValueError("--time-scale/--max-input-len/--max-output-len need --trace or a trace workload")
        trace = TraceSpec(**{**base.__dict__, **{k: v for k, v in dict(
            time_scale=args.time_scale, max_input_len=args.max_input_len,
            max_output_len=args.max_output_len).items() if v is not None}})
    workload = dict(
        num_prompts=args.num_prompts, request_rate=args.request_rate, burstiness=args.burstiness,
        arrival="trace" if args.trace else args.arrival, concurrency=args.concurrency,
        max_concurrency=args.max_concurrency, input_len=args.input_len, output_len=args.output_len,
        seed=args.seed, trace=trace,
    )
    if args.concurrency and not args.arrival:
        workload["arrival"] = "closed"
    if args.burstiness and not args.arrival and workload["arrival"] is None:
        workload["arrival"] = "gamma"
    return with_run_overrides(
        cfg, workload, model=args.model, dtype=args.dtype, quantize=args.quantize,
        executor=args.executor, device_profile=args.device_profile, memory_gb=args.memory_gb,
        ignore_eos=args.ignore_eos, target=args.target,
        goodput=parse_goodput(args.goodput) if args.goodput else None,
        percentiles=tuple(float(p) for p in args.percentiles.split(",")),
        **{"scheduler.max_num_seqs": args.max_num_seqs,
           "scheduler.max_num_batched_tokens": args.max_num_batched_tokens,
           "scheduler.prefill_step_size": args.prefill_step_size,
           "scheduler.policy": args.policy},
    )


def run(args: argparse.Namespace) -> dict:
    from batchsim.configs import ConfigError

    try:
        cfg = config_from_args(args)
    except (ValueError, TypeError) as exc:
        if isinstance(exc, ConfigError):
            raise
        raise ConfigError(str(exc)) from None
    if cfg.target:
        from batchsim.workloads.client.load import run_http

        return run_http(cfg, Path(args.out), progress=not args.no_progress)
    return run_in_process(cfg, Path(args.out), progress=not args.no_progress)


def run_in_process(cfg: RunConfig, out_dir: Path, progress: bool = True, label: str | None = None,
                   quiet: bool = False) -> dict:
    from batchsim.scripts.progress import RunProgress
    from batchsim.scripts.report import summary_table
    from batchsim.server.engine.runner import run_workload
    from batchsim.server.engine.session import open_session

    session = open_session(cfg)
    spec = cfg.workload
    label = label or f"{session.ref.name}-{spec.name}-{cfg.executor}"
    if not quiet:
        err.print(f"batchsim run: {session.ref.name} ({session.dtype}) on {cfg.executor}, workload "
                  f"{spec.name}: {spec.num_prompts} requests, max_num_seqs "
                  f"{cfg.scheduler.max_num_seqs}, KV budget {session.kv_budget_bytes / 2**30:.2f} GiB "
                  f"({session.budget_source})")
    with RunProgress(spec.num_prompts, label, enabled=progress and not quiet) as bar:
        outcome = run_workload(session, spec, out_dir=out_dir, label=label, on_step=bar.on_step)
    summary = outcome.summary
    if not quiet:
        out.print(summary_table(summary))
        if outcome.interrupted:
            out.print("[yellow]interrupted: records so far are in the run directory[/yellow]")
        out.print(f"run directory: {summary['run_dir']}")
    return summary
