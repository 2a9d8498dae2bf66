"""`batchsim compare`: the same workload (same requests, same seed) run end to end once at batch 1
(max_num_seqs = 1) and once batched, side by side: throughput, latency percentiles, batch and KV
memory, and the ratios."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from batchsim.scheduler.config import SchedulerSettings
from batchsim.scripts.common import (
    add_field_argument,
    append_jsonl,
    err,
    out,
    pyplot,
    save_figure,
    table,
    timestamp,
)
from batchsim.scripts.run_cmd import (
    add_engine_arg,
    add_model_args,
    add_scheduler_args,
    add_workload_args,
    config_from_args,
    run_in_process,
    warn_profile_mismatch,
)
from batchsim.server.engine.run_config import RunConfig, with_run_overrides
from batchsim.workloads.lengths import LengthSpec
from batchsim.workloads.spec import WorkloadSpec, builtin_workload, with_overrides

# Without --workload: the 'burst' workload (everything at t = 0, so batching has work to share)
# cut to this size, so that the batch-1 run of SmolLM2-135M float32 on two CPU cores (~10 tok/s)
# takes about a minute.
DEFAULT_WORKLOAD = "burst"
DEFAULT_NUM_PROMPTS = 20
DEFAULT_OUTPUT_LEN = 32

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
JSONL_KEYS = ("max_num_seqs", "completed", "failed", "total_input_tokens", "total_output_tokens",
              "duration", "output_throughput", "request_throughput", "mean_batch_size",
              "max_batch_size", "peak_kv_bytes", "peak_kv_bytes_measured", "num_preemptions",
              "peak_memory", "peak_memory_source", "run_dir",
              *(f"{stat}_{key}_ms" for key, _ in LATENCIES for stat, _ in STATS))


def add_parser(p: argparse.ArgumentParser) -> None:
    add_engine_arg(add_model_args(p))
    g = add_scheduler_args(p, max_num_seqs=False)
    add_field_argument(g, SchedulerSettings, "max_num_seqs", "max_num_seqs of the batched run "
                       "(the other run uses 1)", flag="--batch", unset=False)
    add_workload_args(p, default_workload())
    p.description = (f"{p.description}. Without --workload or --trace: '{DEFAULT_WORKLOAD}' "
                     f"(all requests at t = 0) with {DEFAULT_NUM_PROMPTS} requests x "
                     f"{DEFAULT_OUTPUT_LEN} output tokens unless --num-prompts/--output-len say "
                     f"otherwise.")
    g = p.add_argument_group("report")
    g.add_argument("--out", type=Path, default=Path("results"),
                   help="directory for compare.jsonl and the PNG")
    g.add_argument("--runs-dir", type=Path, default=Path("runs"),
                   help="directory for the two run directories")


def default_workload() -> WorkloadSpec:
    """Without --workload or --trace: DEFAULT_WORKLOAD cut to its requests and output length."""
    return with_overrides(builtin_workload(DEFAULT_WORKLOAD), num_prompts=DEFAULT_NUM_PROMPTS,
                          output_len=LengthSpec("fixed", value=DEFAULT_OUTPUT_LEN))


def configs_from_args(args: argparse.Namespace) -> tuple[RunConfig, RunConfig]:
    """(batch-1 config, batched config): identical but for max_num_seqs."""
    from batchsim.configs import ConfigError

    ns = argparse.Namespace(**vars(args))
    # Flags of `batchsim run` that compare does not take.
    for key in ("config", "goodput", "target", "max_num_seqs", "percentiles"):
        setattr(ns, key, None)
    if args.batch < 1:
        raise ConfigError(f"--batch must be >= 1, got {args.batch}")
    no_workload = ns.workload is None and ns.trace is None
    base = RunConfig(workload=default_workload()) if no_workload else None
    try:
        cfg = config_from_args(ns, base)
    except (ValueError, TypeError) as exc:
        if isinstance(exc, ConfigError):
            raise
        raise ConfigError(str(exc)) from None
    return (with_run_overrides(cfg, {}, **{"scheduler.max_num_seqs": 1}),
            with_run_overrides(cfg, {}, **{"scheduler.max_num_seqs": args.batch}))


def ratio(num: float | None, den: float | None) -> float | None:
    return None if num is None or den is None or den == 0 else num / den


def ratios(batch1: dict[str, Any], batched: dict[str, Any]) -> dict[str, float | None]:
    """batched / batch 1 for throughput and latency (latency < 1: batched is faster)."""
    keys = ["output_throughput", "request_throughput",
            *(f"{stat}_{key}_ms" for key, _ in LATENCIES for stat, _ in STATS)]
    return {k: ratio(batched.get(k), batch1.get(k)) for k in keys}


def run(args: argparse.Namespace) -> dict:
    cfg1, cfg_b = configs_from_args(args)
    spec = cfg1.workload
    err.print(f"batchsim compare: {cfg1.model} on {cfg1.executor}, workload {spec.name}: "
              f"{spec.num_prompts} requests, batch 1 then batch {args.batch}")
    warn_profile_mismatch(cfg1)
    summaries = []
    for cfg, tag in ((cfg1, "b1"), (cfg_b, f"b{args.batch}")):
        err.print(f"running max_num_seqs {cfg.scheduler.max_num_seqs} ...")
        label = f"{cfg.model.replace('/', '_')}-{spec.name}-{cfg.executor}-compare-{tag}"
        summaries.append(run_in_process(cfg, args.runs_dir, progress=False, label=label,
                                        quiet=True))
    batch1, batched = summaries
    rat = ratios(batch1, batched)
    speedup = rat["output_throughput"]
    _print(batch1, batched, args.batch, rat)
    stamp = timestamp()
    row = {"kind": "compare", "time": stamp, "model": batched["model"], "dtype": batched["dtype"],
           "executor": batched["executor"], "engine": cfg_b.engine, "workload": spec.name,
           "num_prompts": spec.num_prompts,
           "seed": spec.seed, "batch": args.batch, "speedup": speedup, "ratios": rat,
           "batch1": {k: batch1.get(k) for k in JSONL_KEYS},
           "batched": {k: batched.get(k) for k in JSONL_KEYS}, "env": batched["env"]}
    jsonl = append_jsonl(args.out / "compare.jsonl", [row])
    name = f"compare-{batched['model'].replace('/', '_')}-{spec.name}-b{args.batch}-{stamp}.png"
    png = _plot(batch1, batched, args.batch, speedup, args.out / name)
    out.print(f"run directories: {batch1['run_dir']} and {batched['run_dir']}")
    out.print(f"row appended to {jsonl}; plot {png}")
    return {"batch1": batch1, "batched": batched, "speedup": speedup, "ratios": rat,
            "batch": args.batch, "jsonl": str(jsonl), "png": str(png)}


def _print(batch1: dict, batched: dict, batch: int, rat: dict) -> None:
    rows = []
    for label, key, scale in ROWS:
        a, b = batch1.get(key), batched.get(key)
        a = a * scale if isinstance(a, (int, float)) and scale != 1 else a
        b = b * scale if isinstance(b, (int, float)) and scale != 1 else b
        rows.append([label, a, b, rat.get(key, ratio(b, a))])
    out.print(f"{batched['model']} ({batched['dtype']}) on {batched['executor']}, workload "
              f"{batched['workload']}; ratio = batch {batch} / batch 1")
    out.print(table(f"Batch 1 vs batch {batch}", ["metric", "batch 1", f"batch {batch}", "ratio"],
                    rows))
    speedup = rat["output_throughput"]
    if speedup is not None:
        out.print(f"Speedup (output tok/s, batched / batch 1): {speedup:.2f}x. Latency ratios < 1: "
                  f"the batched run is faster.")


def _plot(batch1: dict, batched: dict, batch: int, speedup: float | None, path: Path) -> Path:
    """Output tok/s per run; mean/median/P99 TTFT, TPOT and E2EL per run (log scale)."""
    plt = pyplot()
    import numpy as np

    names = ["batch 1", f"batch {batch}"]
    fig, (ax_t, ax_l) = plt.subplots(1, 2, figsize=(12, 4.5), gridspec_kw={"width_ratios": [1, 3]})
    ax_t.bar(names, [batch1["output_throughput"], batched["output_throughput"]],
             color=["tab:gray", "tab:blue"])
    ax_t.set_ylabel("output tok/s")
    if speedup is not None:
        ax_t.set_title(f"speedup {speedup:.2f}x")
    keys = [(f"{name} {label}", f"{stat}_{key}_ms") for key, name in LATENCIES
            for stat, label in STATS]
    x = np.arange(len(keys))
    for i, (summary, color) in enumerate(((batch1, "tab:gray"), (batched, "tab:blue"))):
        ax_l.bar(x + (i - 0.5) * 0.4, [max(summary[k], 1e-3) for _, k in keys], 0.4,
                 label=names[i], color=color)
    ax_l.set_xticks(x, [label for label, _ in keys], fontsize=8, rotation=30)
    ax_l.set_yscale("log")
    ax_l.set_ylabel("ms (log)")
    ax_l.legend()
    fig.suptitle(f"{batched['model']} {batched['dtype']} on {batched['executor']}, workload "
                 f"{batched['workload']}: batch 1 vs batch {batch}")
    return save_figure(fig, path)
