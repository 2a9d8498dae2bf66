"""`batchsim sweep`'s workload at each batch: the built-in one (B requests of --prompt-len +
--output-len tokens at once), or the user's own through the workload flags `run` takes
(workload_args.py), whose longest request sizes the analytic limit."""

from __future__ import annotations

import argparse
import dataclasses
import math

from batchsim.configs import ConfigError
from batchsim.scripts.workload_args import add_workload_args, workload_overrides
from batchsim.server.engine.run_config import RunConfig, with_run_overrides
from batchsim.workloads.lengths import LengthSpec
from batchsim.workloads.prefixes import SharingSpec
from batchsim.workloads.requests import RequestSpec
from batchsim.workloads.spec import WorkloadSpec
from batchsim.workloads.traces import read_trace

PROMPT_LEN = 192
# The built-in workload's defaults (a point sends B requests at once: num_prompts = B).
BUILT_IN = WorkloadSpec(name="sweep", request_rate=math.inf,
                        input_len=LengthSpec("fixed", value=PROMPT_LEN),
                        output_len=LengthSpec("fixed", value=64))
# Workload flags only a given workload takes (the built-in one sends B requests at once).
WORKLOAD_ONLY = ("num_prompts", "request_rate", "burstiness", "arrival", "ramp_end_rate",
                 "concurrency", "max_concurrency", "input_len", "time_scale", "max_input_len",
                 "max_output_len", "turns", "sessions")


def add_args(p: argparse.ArgumentParser) -> None:
    """`run`'s workload flags, with what they mean beside the built-in workload."""
    g = add_workload_args(p)
    g.title = "workload"
    g.description = ("With --workload or --trace, as in `run` (defaults shown: run's). Without, "
                     "each batch B runs the built-in workload: B requests of --prompt-len + "
                     "--output-len tokens at once, which takes only --output-len (N), --seed "
                     "and --shared-prefix-tokens (N of --prompt-len) of these. A workload's "
                     "sweep.jsonl rows (and --json) carry prompt_len and output_len null (no one "
                     "length) and its requests' longest_* (the request with the most tokens, "
                     "which sizes the analytic limit), mean_* and max_* prompt_len / output_len.")
    p._option_string_actions["--workload"].help = (
        "run this workload at each batch, max_num_seqs = B (a built-in: configs/workloads, or a "
        "workload YAML; default: none, B requests at once, below)")


def sweep_config(args: argparse.Namespace) -> RunConfig:
    """The base run config. Sets args.workload_spec (the user's workload, or None: the built-in
    one) and args.prompt_len / output_len (ints: the built-in workload's, or the longest request
    of the user's, which the analytic limit and --limit-batch size by)."""
    given = args.workload or args.trace
    cfg, workload = workload_overrides(args, RunConfig()) if given else (RunConfig(), {})
    cfg = with_run_overrides(cfg, workload, model=args.model, dtype=args.dtype,
                             quantize=args.quantize, kv_bits=args.kv_bits,
                             kv_layout=args.kv_layout, executor=args.executor,
                             device_profile=args.device_profile, memory_gb=args.memory_gb,
                             engine=args.engine, ignore_eos=args.ignore_eos,
                             **{"scheduler.prefix_cache": args.prefix_cache})
    args.workload_spec = cfg.workload if given else None
    if given:
        _longest_request(args, cfg.workload)
    else:
        _built_in_lengths(args)
    return cfg


def _longest_request(args: argparse.Namespace, workload: WorkloadSpec) -> None:
    if args.prompt_len is not None:
        raise ConfigError("--prompt-len sizes sweep's built-in workload; with --workload or "
                          "--trace give --input-len")
    from batchsim.workloads.requests import build_requests

    requests = build_requests(workload)
    r = max(requests, key=lambda r: r.prompt_len + r.output_len)
    if r.output_len < 2:  # one output token is sampled by the prefill: nothing would decode
        raise ConfigError(f"{_whose(workload, r)}: the workload's longest request "
                          f"({r.prompt_len}+{r.output_len} tokens), which sizes sweep's batches, "
                          "decodes nothing after its prefill; it needs >= 2 output tokens")
    args.prompt_len, args.output_len = r.prompt_len, r.output_len
    args.lengths = {"prompt_len": None, "output_len": None,
                    "longest_prompt_len": r.prompt_len, "longest_output_len": r.output_len}
    for key in ("prompt_len", "output_len"):
        values = [getattr(q, key) for q in requests]
        args.lengths[f"mean_{key}"] = sum(values) / len(values)
        args.lengths[f"max_{key}"] = max(values)


def _whose(workload: WorkloadSpec, r: RequestSpec) -> str:
    """Where request `r` comes from: its trace file, row (from 0, as trace.start counts) and
    field, or the workload."""
    trace = workload.trace
    if workload.arrival != "trace" or trace is None or workload.sharing is not None:
        return f"workload {workload.name}"
    rows = read_trace(trace.path, trace.format, trace.start, workload.num_prompts)
    j = sorted(range(len(rows)), key=lambda k: rows[k].t_s)[r.index]  # requests: by arrival
    return f"trace {trace.path}: row {trace.start + j}, output_length {rows[j].output_len}"


def _built_in_lengths(args: argparse.Namespace) -> None:
    """The built-in workload's flags, checked and made ints."""
    alone = [f"--{k.replace('_', '-')}" for k in WORKLOAD_ONLY if getattr(args, k) is not None]
    if alone:
        raise ConfigError(f"{', '.join(alone)}: only with --workload or --trace (sweep's built-in "
                          "workload sends B requests of --prompt-len + --output-len tokens at "
                          "once)")
    out = args.output_len or BUILT_IN.output_len
    if out.dist != "fixed":
        raise ConfigError(f"--output-len: sweep's built-in workload takes a number of tokens, "
                          f"not {out.dist}:...; give --workload for lengths that vary")
    args.prompt_len = args.prompt_len or PROMPT_LEN
    args.output_len = out.value
    args.lengths = {"prompt_len": args.prompt_len, "output_len": args.output_len}
    args.seed = BUILT_IN.seed if args.seed is None else args.seed
    args.shared_prefix_tokens = args.shared_prefix_tokens or 0
    if args.shared_prefix_tokens >= args.prompt_len:
        raise ConfigError(f"--shared-prefix-tokens {args.shared_prefix_tokens} must be under "
                          f"--prompt-len {args.prompt_len} (every prompt has its own tokens too)")


def built_in(args: argparse.Namespace, batch: int) -> WorkloadSpec:
    """B requests of --prompt-len + --output-len tokens at once."""
    shared = args.shared_prefix_tokens
    return dataclasses.replace(
        BUILT_IN, name=f"sweep-b{batch}", num_prompts=batch,
        input_len=LengthSpec("fixed", value=args.prompt_len - shared),
        output_len=LengthSpec("fixed", value=args.output_len), seed=args.seed,
        sharing=SharingSpec(system_tokens=shared) if shared else None)


def workload_meta(args: argparse.Namespace) -> dict:
    """The workload the points ran and its lengths (args.lengths: every request's prompt_len and
    output_len under the built-in one; a workload's longest_*, mean_* and max_*)."""
    w = args.workload_spec
    if w is None:
        return {"workload": None, "seed": args.seed,
                "shared_prefix_tokens": args.shared_prefix_tokens, **args.lengths}
    return {"workload": w.name, "seed": w.seed, "num_prompts": w.num_prompts,
            "shared_prefix_tokens": None, **args.lengths}


def context(meta: dict) -> str:
    """'192+64' (every request's), or a workload's 'longest 300+16' (what sizes the limit)."""
    if meta["workload"] is None:
        return f"{meta['prompt_len']}+{meta['output_len']}"
    return f"longest {meta['longest_prompt_len']}+{meta['longest_output_len']}"
