"""Speculative decoding's flags (run, serve, bench-decode): the drafter, K and how K follows the
batch. The rules on their combinations live in RunConfig."""

from __future__ import annotations

import argparse

from batchsim.scheduler.config import SchedulerSettings
from batchsim.scripts.common import add_field_argument
from batchsim.server.engine.run_config import RunConfig


def add_spec_args(p: argparse.ArgumentParser) -> argparse._ArgumentGroup:
    g = p.add_argument_group("speculative decoding (greedy rows; --executor mlx)")
    add_field_argument(g, RunConfig, "spec_method", "ngram: prompt lookup (vLLM's, n-grams of "
                       "2-5 tokens matched in the prompt and output so far); draft: a second "
                       "model sharing the tokenizer (--draft-model)")
    add_field_argument(g, SchedulerSettings, "spec_tokens", "drafted tokens a row verifies per "
                       "step at most (K); needs --spec-method")
    add_field_argument(g, SchedulerSettings, "spec_policy", "shrink: K falls as the batch grows "
                       "(a step near 64 tokens); fixed: K at every batch the token budget allows",
                       choices=["shrink", "fixed"])
    add_field_argument(g, RunConfig, "draft_model", "the draft model for --spec-method draft: "
                       "zoo name or model directory")
    return g


def spec_overrides(args: argparse.Namespace) -> dict[str, object]:
    """The flags as with_run_overrides keys (None: not given)."""
    return {"spec_method": getattr(args, "spec_method", None),
            "draft_model": getattr(args, "draft_model", None),
            "scheduler.spec_tokens": getattr(args, "spec_tokens", None),
            "scheduler.spec_policy": getattr(args, "spec_policy", None)}
