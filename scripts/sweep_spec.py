"""`sweep --spec-tokens`: each batch again with n-gram speculation at each K, the speed-up over
plain batching per batch, and the first batch where speculation stops paying."""

from __future__ import annotations

import argparse
import dataclasses
from collections.abc import Callable

from batchsim.configs import ConfigError
from batchsim.scheduler.config import MAX_SPEC_TOKENS
from batchsim.scripts.common import fmt, ints_up_to
from batchsim.scripts.spec_args import acceptance_of, add_acceptance_args
from batchsim.server.engine.run_config import RunConfig
from batchsim.server.perf.spec_price import break_even_verdict

SPEC_KEYS = ("spec_decode_acceptance_rate", "spec_decode_acceptance_length",
             "spec_decode_num_drafts")
POINT_KEYS = ("decoded_batch", "queued", "overrun")  # did the speculative point run its batch
OVERRUN_NOTE = ("*: the speculative run overran (never decoded its batch together, or preempted "
                "or rejected; decoded: its largest batch): not counted for where it stops paying")


def gain_cell(entry: dict) -> float | str | None:
    """A speculative point's gain in the sweep table: starred, with its decoded batch, where it
    overran (OVERRUN_NOTE)."""
    if not entry["overrun"]:
        return entry["gain"]
    return f"{fmt(entry['gain'])}* (decoded {entry['decoded_batch']})"


def add_spec_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("speculative decoding against plain batching (n-gram drafts)")
    g.add_argument("--spec-tokens", type=ints_up_to(MAX_SPEC_TOKENS), default=[],
                   metavar="K[,K...]", help="also run each batch with K drafted tokens a row "
                   "verifies per step; --executor sim needs --acceptance or --acceptance-from")
    g.add_argument("--spec-policy", choices=["fixed", "shrink"], default="fixed",
                   help="fixed: K at every batch (to find where it stops paying); shrink: K "
                   "falls as the batch grows (scheduler/spec_budget.py) [default: fixed]")
    g.add_argument("--draft-model", default=None, metavar="M",
                   help="draft with model M (--spec-method draft; --executor sim prices K of its "
                   "decode forwards a step; default: the n-gram drafter)")
    add_acceptance_args(g, "--executor sim: ")


def spec_configs(cfg: RunConfig, args: argparse.Namespace) -> dict[int, RunConfig]:
    """K -> the base config speculating with K drafts (checked before the sweep runs)."""
    acceptance = acceptance_of(args)
    if not args.spec_tokens:
        if acceptance is not None or args.draft_model:
            raise ConfigError("--acceptance, --acceptance-from and --draft-model need "
                              "--spec-tokens K[,K...]")
        return {}
    rates, curve, share = ((acceptance.rates, acceptance.curve, acceptance.draft_share)
                           if acceptance else ((), "flat", 1.0))
    method = "draft" if args.draft_model else "ngram"
    return {k: dataclasses.replace(
        cfg, spec_method=method, draft_model=args.draft_model, spec_acceptance=rates,
        spec_acceptance_curve=curve, spec_draft_share=share,
        scheduler=dataclasses.replace(cfg.scheduler, spec_tokens=k, spec_policy=args.spec_policy))
        for k in sorted(set(args.spec_tokens))}


def spec_points(rows: list[dict], cfgs: dict[int, RunConfig], policy: str,
                run_point: Callable[[int, RunConfig, str], dict]) -> dict:
    """Each batch again at each K: the row's `spec` entries (gain: decode tok/s over plain
    batching's; output_gain: output tok/s, prefills included; the speculative run's own
    decoded_batch, queued and overrun, as the plain row's) and, per K, the first swept batch
    where speculation no longer beats it and what that answer is (spec_price.break_even_verdict:
    never_pays only where batch 1 was swept). A speculative point that overran (its draft
    model's rows can cap the batch below B) is not batch B: it never sets the break-even, and
    where plain batching ran that batch but speculation overran it, speculation winning below
    it reads capped_by_draft_memory_at_B, not pays_at_every_batch."""
    first_loss: dict[str, int | None] = {}
    capped: dict[str, int] = {}  # the first batch only speculation overran (its draft's memory)
    priced: dict[str, bool] = {}
    for k, cfg in cfgs.items():
        for row in rows:
            s = run_point(row["batch"], cfg, f"-k{k}")
            gain = (s["decode_tok_s"] or 0.0) / row["decode_tok_s"] if row["decode_tok_s"] else None
            row.setdefault("spec", []).append({
                "spec_tokens": k, "spec_policy": policy, "gain": gain,
                "output_gain": s["output_throughput"] / row["output_throughput"],
                **{key: s[key] for key in ("decode_tok_s", "decode_tok_s_source", "step_ms",
                                           "output_throughput", "median_tpot_ms", *SPEC_KEYS,
                                           *POINT_KEYS, "run_dir")}})
            if s["overrun"]:
                if not row["overrun"]:
                    capped.setdefault(str(k), row["batch"])
                continue
            priced[str(k)] = priced.get(str(k), False) or gain is not None
            if gain is not None and gain <= 1.0 and str(k) not in first_loss:
                first_loss[str(k)] = row["batch"]
        first_loss.setdefault(str(k), None)
    verdict = {k: break_even_verdict(b, priced.get(k, False)) for k, b in first_loss.items()}
    for k, batch in capped.items():  # it won where it ran, but could not run the larger batches
        if verdict[k] == "pays_at_every_batch":
            verdict[k] = f"capped_by_draft_memory_at_{batch}"
    for row in rows:
        for entry in row["spec"]:
            entry["spec_break_even_batch"] = first_loss[str(entry["spec_tokens"])]
            entry["spec_break_even"] = verdict[str(entry["spec_tokens"])]
    return {"spec_break_even_batch": first_loss, "spec_break_even": verdict}
