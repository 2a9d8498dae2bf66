"""The flags `run` shares with `compare`, `sweep` and `serve` (model and executor, scheduler,
workload), and the run config they make."""

from __future__ import annotations

import argparse
import dataclasses
from pathlib import Path

from batchsim.configs import ConfigError
from batchsim.scheduler.config import KV_LAYOUTS, SchedulerSettings
from batchsim.scheduler.pool_geometry import KV_STEP, PAGE_TOKENS
from batchsim.scripts.common import (
    DTYPE_HELP,
    MAX_FLOAT,
    add_field_argument,
    bounded,
    positive_float,
)
from batchsim.scripts.spec_args import spec_overrides
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
from batchsim.workloads.spec import (
    TraceSpec,
    WorkloadSpec,
    builtin_workload_names,
    resolve_workload,
)


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
    add_field_argument(g, RunConfig, "dtype", DTYPE_HELP, choices=list(DTYPES))
    add_field_argument(g, RunConfig, "quantize", "4- or 8-bit weights (zoo models; default: "
                       "unquantized, in --dtype; a model directory or hub id: as stored)",
                       choices=list(QUANT_BITS))
    if simulated:
        add_field_argument(g, RunConfig, "executor", "mlx: real compute; sim: calibrated roofline "
                           "on a virtual clock; fake: zero-cost (measures scheduler overhead)")
        add_field_argument(g, RunConfig, "device_profile",
                           "--executor sim: a Mac from the catalog ('M2 Max', 'M2 Ultra 76c'), a "
                           "calibrated profile (configs/devices or $BATCHSIM_HOME/devices) or a "
                           "YAML path; default: the profile calibrated on this machine")
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
                       "bits (group 64): full-attention layers, real or simulated (default: "
                       "K/V in the compute dtype)",
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
    add_field_argument(g, w, "name", "built-in workload (configs/workloads: "
                       f"{', '.join(builtin_workload_names())}) or a workload YAML",
                       flag="--workload")
    add_field_argument(g, w, "num_prompts", "requests to send; with --trace: every row of the "
                       "trace unless given")
    add_field_argument(g, w, "request_rate", "requests/s; 'inf' sends all at once", type=rate)
    add_field_argument(g, w, "burstiness", "gamma shape: 1 = Poisson, <1 burstier",
                       type=positive_float)
    add_field_argument(g, w, "arrival", "arrival process")
    add_field_argument(g, w, "ramp_end_rate", "'ramp': the rate (requests/s) reached by the last "
                       "request, rising linearly from --request-rate (sets --arrival ramp)")
    add_field_argument(g, w, "concurrency", "closed loop: keep this many requests in flight")
    add_field_argument(g, w, "max_concurrency", "open loop: cap on requests in flight (default: "
                       "none)")
    add_field_argument(g, w, "input_len", "prompt lengths in tokens: N, uniform:MIN:MAX, "
                       "normal:MEAN:STD[:MAX], lognormal:MEAN:STD[:MAX], zipf:A:MIN:MAX",
                       type=length)
    add_field_argument(g, w, "output_len", "output lengths in tokens (same forms)", type=length)
    add_field_argument(g, w, "seed", "workload seed (arrivals, lengths, prompt ids)")
    g.add_argument("--trace", help="replay a trace: Azure CSV or Mooncake JSONL (path, or a file "
                   "in configs/traces)")
    add_field_argument(g, TraceSpec, "time_scale", "trace time factor (0.1 = 10x faster)",
                       type=positive_float)
    add_field_argument(g, TraceSpec, "max_input_len", "cap trace prompt lengths (tokens; "
                       "default: none)")
    add_field_argument(g, TraceSpec, "max_output_len", "cap trace output lengths (tokens; "
                       "default: none)")
    add_field_argument(g, RunConfig, "ignore_eos", "generate each request's full output length",
                       action=argparse.BooleanOptionalAction)
    add_sharing_args(g)


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
        # a replayed trace names the run (records, run directory) unless --workload does
        "name": Path(args.trace).stem if args.trace and not args.workload else None,
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
