"""Workload flags beyond a WorkloadSpec field each, for every command that takes the workload
flags (run, compare): a trace's, and prompts that share prefixes (workloads/prefixes.py)."""

from __future__ import annotations

import argparse
import dataclasses
from typing import Any

from batchsim.scripts.common import non_negative_int, positive_int
from batchsim.server.engine.run_config import RunConfig
from batchsim.workloads.prefixes import sharing_with
from batchsim.workloads.spec import TraceSpec


def add_sharing_args(g: argparse._ArgumentGroup) -> None:
    """Unset: the workload's `sharing` (none in most built-ins); a trace shares by its hash_ids."""
    g.add_argument("--shared-prefix-tokens", type=non_negative_int, metavar="N",
                   help="every prompt starts with the same N-token system prompt, then "
                        "--input-len tokens of its own (0: none)")
    g.add_argument("--turns", type=positive_int, metavar="N",
                   help="chat sessions of N turns: turn k resends turns 1..k-1 and their replies "
                        "(--input-len: a turn's new user tokens, --output-len: its reply)")
    g.add_argument("--sessions", type=positive_int, metavar="N",
                   help="chat sessions interleaved: turn k of N sessions, then turn k+1 (the "
                        "built-in 'chat-sessions' workload: 8)")


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
