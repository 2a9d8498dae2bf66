"""`batchsim compare`: the same workload (same requests, same seed) run end to end twice, side by
side: throughput, latency percentiles, batch and KV memory, and the ratios. By default once at
batch 1 (max_num_seqs = 1) and once batched; with `--prefix-cache` alone, batched with the prefix
cache off and then on."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from batchsim.scheduler.config import SchedulerSettings
from batchsim.scripts.common import (
    CommandFailed,
    add_field_argument,
    append_jsonl,
    err,
    executor_label,
    out,
    pyplot,
    save_figure,
    stop_if_interrupted,
    table,
    timestamp,
)
from batchsim.scripts.run_args import (
    add_engine_arg,
    add_model_args,
    add_scheduler_args,
    config_from_args,
)
from batchsim.scripts.run_view import warn_profile_mismatch
from batchsim.scripts.workload_args import add_workload_args
from batchsim.server.engine.run_config import RunConfig, with_run_overrides
from batchsim.server.results.timeline import run_title
from batchsim.workloads.lengths import LengthSpec
from batchsim.workloads.spec import WorkloadSpec, builtin_workload, with_overrides

# Without --workload: the 'burst' workload (everything at t = 0, so batching has work to share)
# cut to this size, so that the batch-1 run of SmolLM2-135M float32 on two CPU cores (~10 tok/s)
# takes about a minute.
DEFAULT_WORKLOAD = "burst"
DEFAULT_NUM_PROMPTS = 20
DEFAULT_OUTPUT_LEN = 32
# With --prefix-cache alone: a workload whose prompts share a system prompt, cut the same way.
DEFAULT_PREFIX_WORKLOAD = "shared-prompt"
BOTH = "both"  # --prefix-cache alone
# What each comparison runs: (JSON key, label) of the base run, then of the other.
VERSUS = {"batch": (("batch1", "batch 1"), ("batched", "batched")),
          "prefix-cache": (("cache_off", "cache off"), ("cache_on", "cache on"))}

LATENCIES = (("ttft", "TTFT"), ("tpot", "TPOT"), ("e2el", "E2EL"))
STATS = (("mean", "mean"), ("median", "median"), ("p99", "P99"))
# (label, summary key, scale): the side-by-side rows; the scale turns bytes into MiB.
ROWS: tuple[tuple[str, str, float], ...] = (
    ("Completed requests", "completed", 1), ("Output tokens", "total_output_tokens", 1),
    ("Duration (s)", "duration", 1), ("Output tok/s", "output_throughput", 1),
    ("Requests/s", "request_throughput", 1),
    *((f"{label} {name} (ms)", f"{stat}_{key}_ms", 1) for key, name in LATENCIES
      for stat, label in STATS),
    ("Mean decode batch", "mean_batch_size", 1), ("Max decode batch", "max_batch_size", 1),
    ("Peak KV (MiB)", "peak_kv_bytes", 1 / (1 << 20)), ("Preemptions", "num_preemptions", 1),
)
# Shown when a run reports them (the prefix cache's summary keys).
PREFIX_ROWS: tuple[tuple[str, str, float], ...] = (
    ("Prefix cache hit rate", "prefix_cache_hit_rate", 1),
    ("Cached prompt tokens", "cached_prompt_tokens", 1),
    ("Prefilled prompt tokens", "prefilled_prompt_tokens", 1),
    ("Peak prefix cache (MiB)", "peak_prefix_cache_bytes", 1 / (1 << 20)),
)
JSONL_KEYS = ("max_num_seqs", "completed", "failed", "total_input_tokens", "total_output_tokens",
              "duration", "output_throughput", "request_throughput", "mean_batch_size",
              "max_batch_size", "peak_kv_bytes", "peak_kv_bytes_measured", "num_preemptions",
              "peak_memory_bytes", "peak_memory", "peak_memory_source", "run_dir", "prefix_cache",
              *(key for _, key, _ in PREFIX_ROWS),
              *(f"{stat}_{key}_ms" for key, _ in LATENCIES for stat, _ in STATS))


def add_parser(p: argparse.ArgumentParser) -> None:
    add_engine_arg(add_model_args(p))
    g = add_scheduler_args(p, max_num_seqs=False)
    add_field_argument(g, SchedulerSettings, "max_num_seqs", "max_num_seqs of the batched run "
                       "(the other run uses 1)", flag="--batch", unset=False)
    _prefix_cache_alone(p)
    add_workload_args(p, default_workload())
    p.description = (f"{p.description}. Without --workload or --trace: '{DEFAULT_WORKLOAD}' "
                     f"(all requests at t = 0; with --prefix-cache alone, "
                     f"'{DEFAULT_PREFIX_WORKLOAD}') with {DEFAULT_NUM_PROMPTS} requests x "
                     f"{DEFAULT_OUTPUT_LEN} output tokens unless --num-prompts/--output-len say "
                     f"otherwise.")
    g = p.add_argument_group("report")
    g.add_argument("--out", type=Path, default=Path("results"),
                   help="directory for compare.jsonl and the PNG")
    g.add_argument("--runs-dir", type=Path, default=Path("runs"),
                   help="directory for the two run directories")
    g.add_argument("--no-timeline", action="store_true",
                   help="no timeline.png in the run directories")


def _prefix_cache_alone(p: argparse.ArgumentParser) -> None:
    """`--prefix-cache on|off` sets both runs' cache; alone it compares the cache off and on."""
    action = p._option_string_actions["--prefix-cache"]
    action.nargs, action.const, action.choices = "?", BOTH, [*action.choices, BOTH]
    what, default = action.help.rsplit(" [default: ", 1)  # the default stays last
    action.help = (f"{what}; alone (or '{BOTH}'): compare the workload batched (--batch) with "
                   f"the prefix cache off, then on [default: {default}")


def default_workload(name: str = DEFAULT_WORKLOAD) -> WorkloadSpec:
    """Without --workload or --trace: `name` cut to its requests and output length."""
    return with_overrides(builtin_workload(name), num_prompts=DEFAULT_NUM_PROMPTS,
                          output_len=LengthSpec("fixed", value=DEFAULT_OUTPUT_LEN))


def versus(args: argparse.Namespace) -> str:
    """What the two runs differ in: 'batch' or 'prefix-cache'."""
    return "prefix-cache" if getattr(args, "prefix_cache", None) == BOTH else "batch"


def configs_from_args(args: argparse.Namespace) -> tuple[RunConfig, RunConfig]:
    """(base config, other config), identical but for max_num_seqs (1, then --batch) or, with
    --prefix-cache alone, the prefix cache (off, then on; both at --batch)."""
    from batchsim.configs import ConfigError

    ns = argparse.Namespace(**vars(args))
    # Flags of `batchsim run` that compare does not take.
    for key in ("config", "goodput", "target", "max_num_seqs", "percentiles"):
        setattr(ns, key, None)
    if versus(args) == "prefix-cache":
        ns.prefix_cache = None
    if args.batch < 1:
        raise ConfigError(f"--batch must be >= 1, got {args.batch}")
    name = DEFAULT_PREFIX_WORKLOAD if versus(args) == "prefix-cache" else DEFAULT_WORKLOAD
    base = (RunConfig(workload=default_workload(name))
            if ns.workload is None and ns.trace is None else None)
    try:
        cfg = config_from_args(ns, base)
    except (ValueError, TypeError) as exc:
        if isinstance(exc, ConfigError):
            raise
        raise ConfigError(str(exc)) from None
    if versus(args) == "prefix-cache":
        batched = {"scheduler.max_num_seqs": args.batch}
        return (with_run_overrides(cfg, {}, **batched, **{"scheduler.prefix_cache": "off"}),
                with_run_overrides(cfg, {}, **batched, **{"scheduler.prefix_cache": "on"}))
    return (with_run_overrides(cfg, {}, **{"scheduler.max_num_seqs": 1}),
            with_run_overrides(cfg, {}, **{"scheduler.max_num_seqs": args.batch}))


def ratio(num: float | None, den: float | None) -> float | None:
    return None if num is None or den is None or den == 0 else num / den


def ratios(base: dict[str, Any], other: dict[str, Any]) -> dict[str, float | None]:
    """other / base for throughput and latency (latency < 1: the other run is faster)."""
    keys = ["output_throughput", "request_throughput",
            *(f"{stat}_{key}_ms" for key, _ in LATENCIES for stat, _ in STATS)]
    return {k: ratio(other.get(k), base.get(k)) for k in keys}


def _run_quietly(cfg: RunConfig, runs_dir: Path, label: str, timeline: bool) -> dict:
    from batchsim.server.engine.run_path import RecordsLost, run_config

    try:  # SIGTERM, SIGHUP as Ctrl-C (as `run`): the run's records and summary kept
        return stop_if_interrupted(run_config(cfg, runs_dir, label=label, timeline=timeline))
    except RecordsLost as exc:
        raise CommandFailed(str(exc), exc.summary) from None


def run(args: argparse.Namespace) -> dict:
    cfg_a, cfg_b = configs_from_args(args)
    spec, kind = cfg_a.workload, versus(args)
    (key_a, name_a), (key_b, name_b) = VERSUS[kind]
    if kind == "batch":
        name_b = f"batch {args.batch}"
    where = executor_label(cfg_a.executor, cfg_b.engine, cfg_a.device_profile)
    err.print(f"batchsim compare: {cfg_a.model} on {where}, "
              f"workload {spec.name}: "
              f"{spec.num_prompts} requests, {name_a} then {name_b}", markup=False)
    warn_profile_mismatch(cfg_a)
    summaries = []
    for cfg, tag in ((cfg_a, key_a), (cfg_b, key_b)):
        err.print(f"running {tag} ...")
        tag = f"b{cfg.scheduler.max_num_seqs}" if kind == "batch" else tag.replace("_", "-")
        label = f"{cfg.model.replace('/', '_')}-{spec.name}-{cfg.executor}-compare-{tag}"
        summaries.append(_run_quietly(cfg, args.runs_dir, label, not args.no_timeline))
    base, other = summaries
    rat = ratios(base, other)
    speedup = rat["output_throughput"]
    names = (name_a, name_b)
    what = run_title(other["model"], other["dtype"], other.get("quantize_bits"), other["executor"],
                     cfg_b.device_profile, cfg_b.engine, other.get("env"))
    _print(base, other, names, rat, what)
    stamp = timestamp()
    row = {"kind": "compare", "time": stamp, "versus": kind, "model": other["model"],
           "dtype": other["dtype"], "executor": other["executor"], "engine": cfg_b.engine,
           "workload": spec.name, "num_prompts": spec.num_prompts,
           "seed": spec.seed, "batch": args.batch, "speedup": speedup, "ratios": rat,
           key_a: {k: base.get(k) for k in JSONL_KEYS},
           key_b: {k: other.get(k) for k in JSONL_KEYS}, "env": other["env"]}
    jsonl = append_jsonl(args.out / "compare.jsonl", [row])
    name = (f"compare-{other['model'].replace('/', '_')}-{spec.name}-"
            f"{'b' + str(args.batch) if kind == 'batch' else 'prefix-cache'}-{stamp}.png")
    png = _plot(base, other, names, speedup, args.out / name, what)
    out.print(f"run directories: {base['run_dir']} and {other['run_dir']}", markup=False)
    out.print(f"row appended to {jsonl}; plot {png}", markup=False)
    return {"versus": kind, key_a: base, key_b: other, "speedup": speedup, "ratios": rat,
            "batch": args.batch, "jsonl": str(jsonl), "png": str(png)}


def _print(base: dict, other: dict, names: tuple[str, str], rat: dict, what: str) -> None:
    shown = ROWS + tuple(r for r in PREFIX_ROWS
                         if base.get(r[1]) is not None or other.get(r[1]) is not None)
    rows = []
    for label, key, scale in shown:
        a, b = base.get(key), other.get(key)
        a = a * scale if isinstance(a, (int, float)) and scale != 1 else a
        b = b * scale if isinstance(b, (int, float)) and scale != 1 else b
        rows.append([label, a, b, rat.get(key, ratio(b, a))])
    out.print(f"{what}, workload {other['workload']}; ratio = {names[1]} / {names[0]}")
    out.print(table(f"{names[0]} vs {names[1]}", ["metric", *names, "ratio"], rows))
    speedup = rat["output_throughput"]
    if speedup is not None:
        out.print(f"Speedup (output tok/s, {names[1]} / {names[0]}): {speedup:.2f}x. Latency "
                  f"ratios < 1: {names[1]} is faster.")


def _plot(base: dict, other: dict, names: tuple[str, str], speedup: float | None,
          path: Path, what: str) -> Path:
    """Output tok/s per run; mean/median/P99 TTFT, TPOT and E2EL per run (log scale)."""
    plt = pyplot()
    import numpy as np

    fig, (ax_t, ax_l) = plt.subplots(1, 2, figsize=(12, 4.5), gridspec_kw={"width_ratios": [1, 3]})
    ax_t.bar(names, [base["output_throughput"], other["output_throughput"]],
             color=["tab:gray", "tab:blue"])
    ax_t.set_ylabel("output tok/s")
    if speedup is not None:
        ax_t.set_title(f"output tok/s: {names[1]} / {names[0]} = {speedup:.2f}x")
    keys = [(f"{name} {label}", f"{stat}_{key}_ms") for key, name in LATENCIES
            for stat, label in STATS]
    x = np.arange(len(keys))
    for i, (summary, color) in enumerate(((base, "tab:gray"), (other, "tab:blue"))):
        ax_l.bar(x + (i - 0.5) * 0.4, [max(summary[k], 1e-3) for _, k in keys], 0.4,
                 label=names[i], color=color)
    ax_l.set_xticks(x, [label for label, _ in keys], fontsize=8, rotation=30)
    ax_l.set_yscale("log")
    ax_l.set_ylabel("ms per request (log scale; lower is better)")
    ax_l.legend()
    fig.suptitle(f"{what}, workload {other['workload']}: {names[0]} vs {names[1]}")
    return save_figure(fig, path)
