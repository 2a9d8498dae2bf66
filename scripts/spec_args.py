"""Speculative decoding's flags (run, serve, bench-decode): the drafter, K and how K follows the
batch; and the acceptance a simulated run, `size` or `sweep` prices (add_acceptance_args). The
rules on their combinations live in RunConfig."""

from __future__ import annotations

import argparse

from batchsim.configs import ConfigError
from batchsim.scheduler.config import SchedulerSettings
from batchsim.scripts.common import add_field_argument, bounded
from batchsim.server.engine.run_config import RunConfig
from batchsim.server.perf.spec_acceptance import (
    CURVES,
    PUBLISHED,
    Acceptance,
    from_run,
    parse_rates,
)


def add_spec_args(p: argparse.ArgumentParser, simulated: bool = True) -> argparse._ArgumentGroup:
    g = p.add_argument_group("speculative decoding (--executor mlx; or sim, with --acceptance)"
                             if simulated else "speculative decoding")
    add_field_argument(g, RunConfig, "spec_method", "ngram: prompt lookup (vLLM's, n-grams of "
                       "2-5 tokens matched in the prompt and output so far); draft: a second "
                       "model sharing the tokenizer (--draft-model)")
    add_field_argument(g, SchedulerSettings, "spec_tokens", "drafted tokens a row verifies per "
                       "step at most (K); needs --spec-method")
    add_field_argument(g, SchedulerSettings, "spec_policy", "shrink: K falls as the batch grows "
                       "(a step near 64 tokens); fixed: K at every batch the token budget allows",
                       choices=["shrink", "fixed"])
    add_field_argument(g, RunConfig, "draft_model", "the draft model for --spec-method draft: "
                       "zoo name (built in the target's dtype and --quantize), or a model "
                       "directory or hub id stored in the target's format")
    if simulated:
        add_acceptance_args(g, "--executor sim: ")
    return g


def add_acceptance_args(g: argparse._ArgumentGroup, where: str = "") -> None:
    """--acceptance, --acceptance-from, --acceptance-curve (server/perf/spec_acceptance.py)."""
    sources = "; ".join(f"{name}: {src}" for name, (_, src) in PUBLISHED.items())
    g.add_argument("--acceptance", default=None, metavar="A[,A2...]",
                   help=f"{where}per-position acceptance rates of the drafts (a run's "
                   "spec_decode_per_position_acceptance_rates); one rate A: A, A^2, A^3 ... "
                   "(each draft accepted with chance A after the ones before it)")
    g.add_argument("--acceptance-from", default=None, metavar="RUN_DIR",
                   help=f"{where}the per-position rates a speculative run measured (its "
                   "summary.json), instead of --acceptance")
    g.add_argument("--draft-share", type=bounded(float, 0, 1, lo_open=True), default=None,
                   metavar="D",
                   help=f"{where}the chance a row drafts at all in a step (the n-gram drafter "
                   "finds no match in most steps); with --acceptance-from: that run's drafts over "
                   "its rows' decode steps, else 1")
    g.add_argument("--acceptance-curve", choices=CURVES, default=None,
                   help=f"{where}how acceptance falls with the batch: flat (the default), or a "
                   f"published curve scaling the accepted drafts ({sources})")


def acceptance_inputs(args: argparse.Namespace) -> tuple[tuple[float, ...], float] | None:
    """(rates, draft share) from --acceptance or --acceptance-from and --draft-share (None: no
    rates given)."""
    given, run_dir = getattr(args, "acceptance", None), getattr(args, "acceptance_from", None)
    share = getattr(args, "draft_share", None)
    if given is not None and run_dir is not None:
        raise ConfigError("--acceptance and --acceptance-from are one input: give one")
    if given is None and run_dir is None:
        if share is not None or getattr(args, "acceptance_curve", None) is not None:
            raise ConfigError("--draft-share and --acceptance-curve need --acceptance or "
                              "--acceptance-from")
        return None
    rates, measured = from_run(run_dir) if run_dir is not None else (parse_rates(given), 1.0)
    return rates, measured if share is None else share  # --draft-share is bounded


def acceptance_of(args: argparse.Namespace) -> Acceptance | None:
    """The acceptance model of the flags (None: no rates given)."""
    inputs = acceptance_inputs(args)
    if inputs is None:
        return None
    return Acceptance(inputs[0], args.acceptance_curve or "flat", inputs[1])


def spec_overrides(args: argparse.Namespace) -> dict[str, object]:
    """The flags as with_run_overrides keys (None: not given)."""
    inputs = acceptance_inputs(args)
    return {"spec_method": getattr(args, "spec_method", None),
            "spec_acceptance": inputs[0] if inputs else None,
            "spec_draft_share": inputs[1] if inputs else None,
            "spec_acceptance_curve": getattr(args, "acceptance_curve", None),
            "draft_model": getattr(args, "draft_model", None),
            "scheduler.spec_tokens": getattr(args, "spec_tokens", None),
            "scheduler.spec_policy": getattr(args, "spec_policy", None)}
