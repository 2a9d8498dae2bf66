"""The flags `run` shares with `compare`, `sweep` and `serve` (model and executor, scheduler; the
workload's are in workload_args.py), and the run config they make."""

from __future__ import annotations

import argparse

from batchsim.scheduler.config import KV_LAYOUTS, SchedulerSettings
from batchsim.scheduler.pool_geometry import KV_STEP, PAGE_TOKENS
from batchsim.scripts.common import (
    DTYPE_HELP,
    QUANTIZE_HELP,
    add_field_argument,
    bounded,
)
from batchsim.scripts.spec_args import spec_overrides
from batchsim.scripts.workload_args import workload_overrides
from batchsim.server.engine.run_config import (
    DTYPES,
    MAX_MEMORY_GB,
    RunConfig,
    load_run_config,
    with_run_overrides,
)
from batchsim.server.models.spec import KV_BITS, QUANT_BITS

_percentile = bounded(float, 0, 100)
_memory_gb = bounded(float, 0, MAX_MEMORY_GB, lo_open=True)


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
    add_field_argument(g, RunConfig, "quantize", QUANTIZE_HELP, choices=list(QUANT_BITS))
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
    add_field_argument(g, SchedulerSettings, "max_num_batched_tokens",
                       "most tokens one step runs, prefill and decode together")
    add_field_argument(g, SchedulerSettings, "prefill_step_size",
                       f"prefill chunk in tokens, a multiple of {KV_STEP}")
    add_field_argument(g, SchedulerSettings, "policy", "decode-first: every step decodes all "
                       "running requests; prefill-first: a step with prefill work only prefills")
    add_field_argument(g, SchedulerSettings, "prefix_cache", "reuse cached prompt blocks' KV")
    return g


def config_from_args(args: argparse.Namespace, default: RunConfig | None = None) -> RunConfig:
    """The run config: the YAML (else `default`, else RunConfig()), then the flags given."""
    from batchsim.server.results.metrics import parse_goodput

    cfg = load_run_config(args.config) if args.config else (default or RunConfig())
    cfg, workload = workload_overrides(args, cfg)
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
