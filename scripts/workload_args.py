"""The workload flags of every command that takes them (run, compare, sweep): a WorkloadSpec
field each, a trace's, and prompts that share prefixes (workloads/prefixes.py); and the config
overrides they make."""

from __future__ import annotations

import argparse
import dataclasses
from pathlib import Path
from typing import Any

from batchsim.configs import ConfigError
from batchsim.scripts.common import (
    MAX_FLOAT,
    add_field_argument,
    bounded,
    non_negative_int,
    positive_float,
    positive_int,
)
from batchsim.server.engine.run_config import RunConfig
from batchsim.workloads.lengths import LengthSpec, parse_length
from batchsim.workloads.prefixes import sharing_with
from batchsim.workloads.spec import (
    TraceSpec,
    WorkloadSpec,
    builtin_workload_names,
    resolve_workload,
)


def add_sharing_args(g: argparse._ArgumentGroup) -> None:
    """Unset: the workload's `sharing` (none in most built-ins); a trace shares by its hash_ids."""
    g.add_argument("--shared-prefix-tokens", type=non_negative_int, metavar="N",
                   help="every prompt starts with the same N-token system prompt, then "
                        "--input-len tokens of its own (0: none; default: the workload's, none in "
                        "most built-ins)")
    g.add_argument("--turns", type=positive_int, metavar="N",
                   help="chat sessions of N turns: turn k resends turns 1..k-1 and their replies "
                        "(--input-len: a turn's new user tokens, --output-len: its reply; default: "
                        "the workload's, none in most built-ins)")
    g.add_argument("--sessions", type=positive_int, metavar="N",
                   help="chat sessions interleaved: turn k of N sessions, then turn k+1 (the "
                        "built-in 'chat-sessions' workload: 8; default: the workload's)")


def sharing_from_args(args: argparse.Namespace, cfg: RunConfig,
                      workload: dict[str, Any]) -> RunConfig:
    """Put the sharing the flags give into `workload` (the overrides); the config returned has
    its own sharing dropped when the flags turn it off."""
    sharing = sharing_with(cfg.workload.sharing, system_tokens=args.shared_prefix_tokens,
                           turns=args.turns, sessions=args.sessions)
    if sharing is cfg.workload.sharing:  # no flag given
        return cfg
    workload["sharing"] = sharing  # None (they share nothing) is not an override: dropped below
    return dataclasses.replace(cfg, workload=dataclasses.replace(cfg.workload, sharing=None))


def trace_override(args: argparse.Namespace, cfg: RunConfig) -> TraceSpec | None:
    """--trace, or the trace flags applied to the config's own trace."""
    given = {k: v for k, v in {"time_scale": args.time_scale, "max_input_len": args.max_input_len,
                               "max_output_len": args.max_output_len}.items() if v is not None}
    if args.trace:
        return TraceSpec(path=args.trace, **given)
    if not given:
        return None
    if cfg.workload.trace is None:
        raise ValueError("--time-scale/--max-input-len/--max-output-len need --trace or a trace "
                         "workload")
    return dataclasses.replace(cfg.workload.trace, **given)


def rate(text: str) -> float:
    return float("inf") if text.strip().lower() in ("inf", "infinity") else _finite_rate(text)


_finite_rate = bounded(float, 0, MAX_FLOAT, lo_open=True)


def length(text: str) -> LengthSpec:
    """parse_length for argparse: its ConfigError's message, not argparse's generic one."""
    try:
        return parse_length(text)
    except ConfigError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def add_workload_args(p: argparse.ArgumentParser,
                      defaults: WorkloadSpec | None = None) -> argparse._ArgumentGroup:
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
                       "request, rising linearly from --request-rate (sets --arrival ramp; "
                       "default: none, a constant rate)")
    add_field_argument(g, w, "concurrency", "closed loop: keep this many requests in flight (sets "
                       "--arrival closed; default: none, an open loop)")
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
    return g


def workload_overrides(args: argparse.Namespace,
                       cfg: RunConfig) -> tuple[RunConfig, dict[str, Any]]:
    """The config with --workload's workload (if given), and the other workload flags as
    with_run_overrides' workload keys (None: not given)."""
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
    return cfg, workload
