"""`batchsim sweep`: step the batch limit (max_num_seqs = B) under one memory budget, over a
fixed-length workload (B requests arriving at once) or the user's own (--workload, --trace: the
same workload flags as `run`), and find the batch that breaks local serving: the analytic limit
(weights + B padded KV rows at full length fit; a workload's: its longest request's) against the
first batch the engine could not run together (queued; a workload's: while requests waited with
a seat free; or preempted), and where decode tok/s stopped scaling. With --spec-tokens, each
batch runs again with n-gram speculation at each K: the speed-up over plain batching per batch
and the first batch where speculation stops paying (spec_break_even_batch)."""

from __future__ import annotations

import argparse
import dataclasses
from pathlib import Path

from batchsim.configs import ConfigError
from batchsim.scheduler.config import SchedulerSettings
from batchsim.scheduler.pool_geometry import KV_STEP
from batchsim.scripts import sweep_spec, sweep_view, sweep_workload
from batchsim.scripts.common import (
    MAX_BATCH,
    add_field_argument,
    append_jsonl,
    bounded,
    ints_up_to,
    out,
    positive_float,
    positive_int,
    run_stoppable,
    stop_if_interrupted,
    timestamp,
)
from batchsim.scripts.run_args import add_engine_arg, add_kv_bits_arg, add_model_args
from batchsim.scripts.run_view import warn_profile_mismatch
from batchsim.server.engine.run_config import RunConfig
from batchsim.server.perf import sweep_limits as sweep_math
from batchsim.server.platform.units import GIB

_batch = bounded(int, 1, MAX_BATCH)


def add_parser(p: argparse.ArgumentParser) -> None:
    p.description = (f"{p.description}. Analytic limit: the largest batch B whose weights + B "
                     f"padded KV rows of round_up(prompt + output - 1, {KV_STEP}) tokens fit the "
                     "budget. Measured overrun: the first batch the engine never decoded together "
                     "(requests queued for memory) or had to preempt.")
    g = add_model_args(p)
    add_kv_bits_arg(g)
    add_engine_arg(g)
    # The shared flag's help names the device default; here the default is --limit-batch.
    p._option_string_actions["--memory-gb"].help = (
        "memory budget for weights + KV in GiB (emulate a Mac); default: sized by --limit-batch")
    g = p.add_argument_group("sweep")
    g.add_argument("--prompt-len", type=positive_int,
                   help="the built-in workload's prompt tokens (every request; with "
                        "--shared-prefix-tokens N, N of them shared) "
                        f"[default: {sweep_workload.PROMPT_LEN}]")
    g.add_argument("--limit-batch", type=_batch, default=12,
                   help="without --memory-gb: a budget of weights + this many sequences' KV at "
                   f"full length (padded to {KV_STEP} tokens) + half a sequence, so the analytic "
                   "limit is exactly this batch and the default sweep finishes in minutes (with "
                   "--draft-model: the speculative points' limit, the draft's weights and rows "
                   "counted; plain batching's limit is higher)")
    g.add_argument("--device-budget", action="store_true",
                   help="use the device's own budget (MLX working set, or 75%% of RAM on the CPU "
                   "backend) instead of --limit-batch")
    g.add_argument("--batches", type=ints_up_to(MAX_BATCH),
                   help="batch sizes to run; default: 1, 2, 4, ... to the first power of two past "
                   "the analytic limit + 2, plus limit-1 .. limit+2 of plain batching's limit "
                   "and, with --draft-model, of the speculative points' (--limit-batch's), "
                   "capped by --max-batch")
    g.add_argument("--max-batch", type=_batch, default=64, help="largest default batch")
    g.add_argument("--min-gain", type=positive_float, default=0.05,
                   help="throughput stops scaling at the first point gaining less decode tok/s "
                   "than this fraction per doubling of the decoded batch")
    add_field_argument(g, SchedulerSettings, "prefix_cache", "reuse the KV of cached prompt "
                       "blocks (full-attention and MLA models)", unset=False)
    g.add_argument("--out", type=Path, default=Path("results"),
                   help="directory for sweep.jsonl and the PNG")
    g.add_argument("--runs-dir", type=Path, default=Path("runs"),
                   help="directory for the run directories (one per batch)")
    g.add_argument("--no-progress", action="store_true", help="no live progress line")
    g.add_argument("--no-timeline", action="store_true", help="no timeline.png in run dirs")
    sweep_spec.add_spec_args(p)
    sweep_workload.add_args(p)


def run(args: argparse.Namespace) -> dict:
    cfg = sweep_workload.sweep_config(args)
    if min(args.prompt_len, args.limit_batch, args.max_batch) < 1 or args.output_len < 2:
        # One output token is sampled by the prefill: nothing would decode.
        raise ConfigError("--prompt-len, --limit-batch and --max-batch must be >= 1, "
                          "--output-len >= 2")
    spec_cfgs = sweep_spec.spec_configs(cfg, args)
    base, budget, source, draft = _base_session(args, cfg, spec_cfgs)
    kvt, weights = base.kv_bytes_per_token, base.weight_bytes
    if args.prompt_len + args.output_len > base.spec.max_context:
        longest = " (the workload's longest request)" if args.workload_spec else ""
        raise ConfigError(f"context {args.prompt_len + args.output_len}{longest} exceeds the "
                          f"model's {base.spec.max_context} tokens")
    limit = sweep_math.analytic_max_batch(budget, weights, args.prompt_len, args.output_len, kvt)
    drafted = any(c.spec_method == "draft" for c in spec_cfgs.values())
    spec_limit = [_draft_limit(base, budget, draft, args)] if drafted else []
    batches = sorted(set(args.batches)) if args.batches else sweep_math.default_batches(
        limit, args.max_batch, *spec_limit)
    meta = _meta(args, base, budget, source, drafted)
    sweep_view.announce(meta, batches)
    rows = [_run_point(base, budget, source, b, args) for b in batches]
    spec_verdict = {}
    if spec_cfgs:
        spec_verdict = sweep_spec.spec_points(
            rows, spec_cfgs, args.spec_policy,
            lambda batch, cfg, tag: _run_point(base, budget, source, batch, args, cfg, tag))
    if drafted:
        spec_verdict["spec_analytic_max_batch"] = spec_limit[0]
    profile = _profile_fields(base)
    for row in rows:
        row["kv_bytes_analytic"] = sweep_math.batch_kv_bytes(
            row["batch"], args.prompt_len, args.output_len, kvt)
        row["fits_analytic"] = row["batch"] <= limit
        row.update(profile)
    verdict = {**_verdict(batches, rows, limit, args.min_gain), **spec_verdict}
    sweep_view.print_sweep(rows, meta, verdict)
    stamp, env = timestamp(), base.environment()
    jsonl = append_jsonl(args.out / "sweep.jsonl", [
        {"kind": "sweep", "time": stamp, **meta, **verdict, **row, "env": env} for row in rows])
    q, kv = meta["quantize_bits"], meta["kv_bits"]  # named as size's PNG: a 4-bit run read float16
    weights = (f"q{q}" if q else meta["dtype"]) + (f"-kv{kv}" if kv else "")
    name = f"sweep-{meta['model'].replace('/', '_')}-{weights}-{stamp}.png"
    png = sweep_view.plot(rows, meta, verdict, args.out / name)
    out.print(f"rows appended to {jsonl}; plot {png}", markup=False)
    return {"rows": rows, **verdict, **meta, "jsonl": str(jsonl), "png": str(png), "env": env}


def _base_session(args: argparse.Namespace, cfg: RunConfig, spec_cfgs: dict[int, RunConfig]):
    """One session (the model loaded once), the budget every point runs under and the draft
    model's account (_draft_account). --limit-batch with a draft model: the budget holds its
    weights too, and the limit is the speculative points' (a row of the draft's cache beside
    each sequence); plain batching fits more."""
    from batchsim.server.engine.session import memory_budget, open_session

    warn_profile_mismatch(cfg)
    base = open_session(cfg)
    draft = draft_weights, draft_row = _draft_account(base, spec_cfgs)
    if args.memory_gb is not None or args.device_budget:
        return base, base.memory_budget_bytes, base.budget_source, draft
    budget_bytes = sweep_math.budget_for_limit(args.limit_batch, base.weight_bytes + draft_weights,
                                               args.prompt_len, args.output_len,
                                               base.kv_bytes_per_token, draft_row)
    # Through memory_gb so that simulated sessions opened per point get the same bytes.
    budget, _ = memory_budget(budget_bytes / GIB)
    with_draft = " (speculative points, with the draft model)" if draft_weights else ""
    return base, budget, f"--limit-batch {args.limit_batch}{with_draft}", draft


def _draft_account(base, cfgs: dict[int, RunConfig]):
    """The draft model's weights and its cache's row per sequence (spec_price.draft_account) of
    the speculative points; (0, None): no draft model."""
    from batchsim.server.perf.spec_price import draft_account

    drafted = [c for c in cfgs.values() if c.spec_method == "draft"]
    return draft_account(drafted[0], base.ref) if drafted else (0, None)


def _draft_limit(base, budget: int, draft: tuple, args: argparse.Namespace) -> int:
    """The analytic limit with the draft model's weights and its padded row beside each
    sequence (`draft`: _draft_account's), as the speculative points' sessions count them (the
    base session runs no draft model)."""
    draft_weights, draft_row = draft
    return sweep_math.analytic_max_batch(budget, base.weight_bytes + draft_weights,
                                         args.prompt_len, args.output_len,
                                         base.kv_bytes_per_token, draft_row)


def _run_point(base, budget: int, source: str, batch: int, args: argparse.Namespace,
               run_cfg: RunConfig | None = None, tag: str = "") -> dict:
    """B requests at once, max_num_seqs = B, same budget; the row of this batch size (with
    `run_cfg`: that config's run instead of the base's; its summary's spec keys kept)."""
    from batchsim.scripts.progress import RunProgress

    spec = args.workload_spec or sweep_workload.built_in(args, batch)
    run_cfg = run_cfg or base.config
    sched = dataclasses.replace(run_cfg.scheduler, max_num_seqs=batch)
    cfg = dataclasses.replace(run_cfg, workload=spec, memory_gb=budget / GIB, scheduler=sched)
    session = base.renewed(cfg, budget, source)  # a new executor per point
    active = _ActiveMemory(session.executor.caps.real_compute)
    label = f"{base.ref.name.replace('/', '_')}-sweep-b{batch}{tag}-{cfg.executor}"
    with RunProgress(batch, label, enabled=not args.no_progress) as bar:
        def on_step(engine, plan, result) -> None:
            bar.on_step(engine, plan, result)
            active.sample()

        outcome = run_stoppable(session, spec, out_dir=args.runs_dir, label=label,
                                on_step=on_step, timeline=not getattr(args, "no_timeline", False))
    next_chunk = min(args.prompt_len, sched.prefill_step_size)
    row = sweep_math.point_row(batch, stop_if_interrupted(outcome.summary), outcome.steps,
                               outcome.requests, sched.max_num_batched_tokens, next_chunk,
                               active.max_active_bytes)
    if args.workload_spec is not None:  # its own arrivals: B requests need not be there at once,
        # so never decoding B together is an overrun only where requests waited with a seat free
        row["queued"] = row["queued"] and row["memory_wait_steps"] > 0
        row["overrun"] = row["queued"] or row["preempted"] or row["rejected"]
    if tag:  # a verify step's rows emit acceptance_length tokens each on average
        row.update({key: outcome.summary[key] for key in sweep_spec.SPEC_KEYS})
        if row["decode_tok_s_source"] == "steady":
            row["decode_tok_s"] *= row["spec_decode_acceptance_length"]
    return row


class _ActiveMemory:
    """MLX's active bytes sampled after every step (the pool is freed by the end of a run)."""

    def __init__(self, enabled: bool):
        self.enabled = enabled
        self.max_active_bytes: int | None = None
        if enabled:
            import mlx.core as mx

            mx.reset_peak_memory()
            self._mx = mx

    def sample(self) -> None:
        if self.enabled:
            active = int(self._mx.get_active_memory())
            self.max_active_bytes = max(self.max_active_bytes or 0, active)


def _verdict(batches: list[int], rows: list[dict], limit: int, min_gain: float) -> dict:
    measured = next((r["batch"] for r in rows if r["overrun"]), None)
    return {
        "analytic_overrun_batch": limit,  # the largest batch whose weights + KV fit
        "analytic_first_overrun_batch": sweep_math.analytic_first_overrun(batches, limit),
        "measured_overrun_batch": measured,  # the first batch that queued, preempted or rejected
        "agree_within_one_step": sweep_math.agree_within_one_step(batches, limit, measured),
        "scaling_stopped_batch": sweep_math.scaling_stop(
            batches, [r["decoded_batch"] for r in rows], [r["decode_tok_s"] for r in rows],
            min_gain),
    }


def _meta(args: argparse.Namespace, base, budget: int, source: str, drafted: bool) -> dict:
    kvt = base.kv_bytes_per_token
    emulated = args.memory_gb is None and not args.device_budget
    return {
        "limit_batch": args.limit_batch if emulated else None,  # limit of limit_batch_points
        "limit_batch_points": ("speculative" if drafted else "plain") if emulated else None,
        "model": base.ref.name, "dtype": base.dtype, "quantize_bits": base.ref.quantize_bits,
        "kv_bits": base.config.kv_bits, "kv_layout": base.config.kv_layout,
        "executor": base.config.executor, "device_profile": base.config.device_profile,
        "env": base.environment(),  # where a real sweep ran, for its titles
        "engine": base.config.engine,
        "seq_kv_tokens": sweep_math.seq_kv_tokens(args.prompt_len, args.output_len),
        "memory_budget_bytes": budget, "budget_source": source, "weight_bytes": base.weight_bytes,
        "kv_budget_bytes": budget - base.weight_bytes, "kv_bytes_per_token": kvt,
        "kv_bytes_per_seq": sweep_math.batch_kv_bytes(1, args.prompt_len, args.output_len, kvt),
        "max_num_batched_tokens": base.config.scheduler.max_num_batched_tokens,
        "min_gain": args.min_gain,
        **sweep_workload.workload_meta(args),
        # the device's own budget (MLX's working set, 75% of RAM on the CPU, or --memory-gb) and
        # the batch it holds by the same arithmetic: what an emulated --limit-batch budget is not
        "device_budget_bytes": base.memory_budget_bytes,
        "device_analytic_max_batch": sweep_math.analytic_max_batch(
            base.memory_budget_bytes, base.weight_bytes, args.prompt_len, args.output_len, kvt),
    }


def _profile_fields(base) -> dict:
    """Which device profile and engine a simulated sweep priced its steps with, and what that
    profile was fitted on (profile None for a real run: the device is this machine)."""
    engine = {"engine": base.config.engine}
    if base.config.executor != "sim":
        return {"profile": None, "profile_fitted_on": None, **engine}
    from batchsim.server.perf.devices import resolve_profile

    p = resolve_profile(base.config.device_profile, base.ref.quantize_bits)
    return {"profile": p.name, "profile_fitted_on": p.fitted_on or p.source, **engine}
