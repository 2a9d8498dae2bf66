"""`batchsim roofline`: the same N x N multiply as a GEMV (one decode step) and as a GEMM (a batch
of N tokens) per dtype (float, or mlx-lm's 4/8-bit affine quantization as q4/q8), a batch sweep
between the two, and the device's measured memory and matmul ceilings, drawn as a roofline PNG."""

from __future__ import annotations

import argparse
from pathlib import Path

from batchsim.scripts.common import (
    append_jsonl,
    bounded,
    err,
    int_list,
    ints_up_to,
    non_negative_int,
    out,
    positive_float,
    positive_int,
    pyplot,
    save_figure,
    str_list,
    table,
    timestamp,
)
from batchsim.server.measure import microbench as mb

DEFAULT_NS = "1024,2048,4096,8192,12288"
DEFAULT_SWEEP_N = 4096
_COLORS = {"float32": "tab:blue", "float16": "tab:orange", "bfloat16": "tab:green",
           "q4": "tab:red", "q8": "tab:purple"}
_MARKERS = {"gemv": "o", "gemm": "s", "batch": "^"}
_SHAPE_LABELS = {"gemv": "GEMV (B=1)", "gemm": "GEMM (B=N)", "batch": "batch sweep"}


def add_parser(p: argparse.ArgumentParser) -> None:
    p.add_argument("--n", type=ints_up_to(32768), default=int_list(DEFAULT_NS),
                   help="matrix sizes N (comma-separated)")
    p.add_argument("--dtypes", type=str_list,
                   default=["float16", "bfloat16", "float32", "q4", "q8"],
                   help="dtypes (comma-separated): float16, bfloat16, float32, and q4, q8 "
                        "(mlx-lm's affine quantization, group 64, its activations in the backend's "
                        "default dtype: float32 on the CPU, float16 on a GPU)")
    p.add_argument("--reps", type=positive_int, default=9,
                   help="timed reps per point (median reported)")
    p.add_argument("--sweep-n", type=non_negative_int, default=None,
                   help=f"N of the batch sweep B = 1, 2, 4 ... N (default: {DEFAULT_SWEEP_N}, or "
                        "the largest --n below it); 0 skips the sweep")
    p.add_argument("--max-seconds-per-point", type=positive_float, default=10.0,
                   help="seconds: skip a point whose warm-up and reps are estimated to take longer")
    p.add_argument("--bandwidth-mb", type=bounded(int, 1, 8192), default=256,
                   help="MiB per array of the streaming bandwidth kernels")
    p.add_argument("--cache-limit-gb", type=positive_float, default=4.0,
                   help="MLX buffer cache while measuring (reuses buffers instead of re-faulting)")
    p.add_argument("--out", type=Path, default=Path("results"), help="directory for JSONL and PNG")


def run(args: argparse.Namespace) -> dict:
    from batchsim.server.platform import env

    cfg, sweep_n = _config(args)
    with mb.cache_limit(int(args.cache_limit_gb * (1 << 30))) as cache_bytes:
        err.print(f"roofline: streaming bandwidth ({args.bandwidth_mb} MiB arrays) ...")
        kernels_gbs = mb.measure_bandwidth(args.bandwidth_mb << 20, args.reps)
        book = mb.RateBook(max(kernels_gbs.values()))
        mb.probe_rates(args.dtypes, book, quant_act=cfg.quant_act)
        bench = mb.Bench(cfg, book, _progress)
        table_results = mb.gemv_gemm_rows(bench, args.n, args.dtypes)
        sweep_results = mb.batch_sweep_rows(bench, sweep_n, args.dtypes) if sweep_n > 0 else []
        peak_results = mb.peak_rows(bench, args.dtypes)
    settings = {"reps": cfg.reps, "warmup": cfg.warmup, "mlx_cache_limit_bytes": cache_bytes,
                "working_set_bytes": cfg.working_set_bytes, "memory_budget_bytes": cfg.memory_bytes,
                "max_s_per_point": cfg.max_s_per_point, "quant_act_dtype": cfg.quant_act}
    summary = _summary(kernels_gbs, table_results, sweep_results, peak_results, sweep_n,
                       env.backend())
    summary["env"] = env.environment(**settings)
    _print_report(summary, args.n, args.dtypes, cfg)
    stamp = timestamp()
    summary["jsonl"] = append_jsonl(args.out / "roofline.jsonl", _records(stamp, summary, settings))
    summary["png"] = _plot(args.out / f"roofline-{stamp}.png", summary)
    out.print(f"wrote {summary['png']} and appended to {summary['jsonl']}", markup=False)
    return summary


def _config(args: argparse.Namespace) -> tuple[mb.BenchConfig, int]:
    from batchsim.configs import ConfigError
    from batchsim.server.platform import env

    bad = [d for d in args.dtypes if d not in mb.FORMATS]
    if bad or args.reps < 1 or args.bandwidth_mb < 1:
        raise ConfigError(f"roofline: dtypes must be among {', '.join(mb.FORMATS)} "
                          f"(got {', '.join(bad) or '-'}); --reps and --bandwidth-mb must be >= 1")
    sweep_n = args.sweep_n if args.sweep_n is not None else min(DEFAULT_SWEEP_N, max(args.n))
    cfg = mb.BenchConfig(reps=args.reps, max_s_per_point=args.max_seconds_per_point,
                         memory_bytes=mb.memory_budget_bytes(),
                         working_set_bytes=mb.working_set_bytes(),
                         quant_act=env.default_dtype())
    return cfg, sweep_n


def _summary(kernels_gbs: dict[str, float], table_results: list[mb.Result],
             sweep_results: list[mb.Result], peak_results: list[mb.MatmulPoint], sweep_n: int,
             backend: str) -> dict:
    """The JSON document: measured rows with their roof fraction, ceilings, the sweep, skips."""
    bandwidth_gbs = max(kernels_gbs.values())
    points = [r for r in table_results + sweep_results + peak_results
              if isinstance(r, mb.MatmulPoint)]
    best: dict[str, mb.MatmulPoint] = {}
    for p in points:  # the compute roof: the best rate measured for the dtype
        if p.dtype not in best or p.gflops > best[p.dtype].gflops:
            best[p.dtype] = p
    peaks = {d: p.gflops for d, p in best.items()}
    ridges = {d: mb.ridge_intensity(g, bandwidth_gbs) for d, g in peaks.items()}
    skips = {(r.dtype, r.batch, r.n): r.row() for r in table_results + sweep_results
             if isinstance(r, mb.Skip)}  # the sweep reuses the table's skips
    rows = [_row(r, bandwidth_gbs, peaks) for r in table_results if isinstance(r, mb.MatmulPoint)]
    sweep = [_row(r, bandwidth_gbs, peaks) for r in sweep_results]
    bound_from = {d: mb.first_compute_bound(mb.sweep_batches(sweep_n), sweep_n, d, ridge)
                  for d, ridge in ridges.items()} if sweep_n > 0 else {}
    return {"rows": rows, "bandwidth_gbs": bandwidth_gbs, "peak_gflops": peaks,
            "bandwidth_kernels_gbs": kernels_gbs, "ridge_flop_per_byte": ridges,
            "peak_from": {d: {"n": p.n, "batch": p.batch} for d, p in best.items()},
            "peak_rows": [_row(p, bandwidth_gbs, peaks) for p in peak_results],
            "sweep": {"n": sweep_n, "rows": sweep, "compute_bound_from_batch": bound_from},
            "skipped": list(skips.values()),
            "notes": _notes(backend, rows, list(skips.values()), sweep)}


def _progress(result: mb.Result) -> None:
    what = f"{result.shape} n={result.n} b={result.batch} {result.dtype}"
    if isinstance(result, mb.Skip):
        err.print(f"  {what}: skipped ({result.reason})")
    else:
        err.print(f"  {what}: {result.gflops:.2f} GFLOP/s, {result.gbytes_s:.2f} GB/s")


def _row(result: mb.Result, bandwidth_gbs: float, peaks: dict[str, float]) -> dict:
    """A point's row; measured ones add the fraction of their roof reached (1.0: on a ceiling)."""
    row = result.row()
    if isinstance(result, mb.MatmulPoint):
        peak = peaks[result.dtype]
        row["roof_fraction"] = result.gflops / mb.roof_gflops(result.intensity, peak, bandwidth_gbs)
        ridge = mb.ridge_intensity(peak, bandwidth_gbs)
        row["bound"] = "compute" if result.intensity > ridge else "memory"
    return row


def _notes(backend: str, rows: list[dict], skipped: list[dict], sweep: list[dict]) -> list[str]:
    notes = []
    for r in rows:
        if backend == "cpu" and r["dtype"] != "float32" and r["shape"] == "gemv" and (
                r["bound"] == "compute") and not any(r["dtype"] in n for n in notes):
            how = "quantized_matmul" if r["dtype"] in mb.QUANT_BITS else "it"
            notes.append(f"{r['dtype']}: MLX's CPU backend multiplies {how} without BLAS, so even "
                         "its GEMV is compute-bound here and its large GEMMs are skipped (raise "
                         "--max-seconds-per-point to run them).")
    if skipped:
        notes.append(f"{len(skipped)} point{'s' * (len(skipped) != 1)} skipped; each has its "
                     "reason under `skipped`.")
    over = [r for r in rows + sweep if r.get("roof_fraction", 0) > 1.05]
    if over:
        notes.append(f"{len(over)} points above the measured roof: a working set the caches held, "
                     "or a noisy bandwidth measurement.")
    return notes


def _print_report(summary: dict, ns: list[int], dtypes: list[str], cfg: mb.BenchConfig) -> None:
    bw, peaks = summary["bandwidth_gbs"], summary["peak_gflops"]
    found = {(r["n"], r["dtype"], r["shape"]): r for r in summary["rows"] + summary["skipped"]}
    body = []
    for dtype in dtypes:
        for n in sorted(ns):
            v, m = found.get((n, dtype, "gemv"), {}), found.get((n, dtype, "gemm"), {})
            act = cfg.act(dtype)
            body.append([n, dtype, *_cells(v, 1, n, dtype, act), *_cells(m, n, n, dtype, act),
                         _ratio(m.get("gflops"), v.get("gflops")), _ratio(v.get("gbytes_s"), bw),
                         _ratio(m.get("gflops"), peaks.get(dtype))])
    out.print(table(
        "GEMV (1 x N @ W.T) vs GEMM (N x N @ W.T), median seconds per multiply",
        ["n", "dtype", "GEMV GFLOP/s", "GEMV GB/s", "GEMV FLOP/B", "GEMM GFLOP/s", "GEMM GB/s",
         "GEMM FLOP/B", "GEMM/GEMV", "GEMV/bandwidth", "GEMM/peak"], body))
    out.print(table("Measured ceilings", ["metric", "value", "ridge FLOP/B"],
                    [[f"bandwidth GB/s ({k})", v, None]
                     for k, v in summary["bandwidth_kernels_gbs"].items()]
                    + [[(f"peak {d} GFLOP/s (N={summary['peak_from'][d]['n']}, "
                        f"B={summary['peak_from'][d]['batch']})"), g,
                        summary["ridge_flop_per_byte"][d]] for d, g in peaks.items()]))
    sweep = summary["sweep"]
    if sweep["rows"]:
        first = sweep["compute_bound_from_batch"]
        out.print(table(
            f"Batch sweep at N={sweep['n']}: X (B x N) @ W.T",
            ["dtype", "B", "GFLOP/s", "GB/s", "FLOP/B", "roof %", "bound"],
            [[r["dtype"], r["batch"], r.get("gflops", "skipped"), r.get("gbytes_s"),
              mb.intensity(r["batch"], r["n"], r["dtype"], cfg.act(r["dtype"])),
              100 * r.get("roof_fraction", 0) or None,
              r.get("bound", "-") + (" <- ridge" if first.get(r["dtype"]) == r["batch"] else "")]
             for r in sweep["rows"]]))
        for d, b in first.items():
            out.print(f"{d}: compute-bound from B={b} (intensity past the ridge point)" if b else
                      f"{d}: memory-bound at every B up to {sweep['n']}")
    for r in summary["skipped"]:
        out.print(f"skipped {r['shape']} n={r['n']} B={r['batch']} {r['dtype']}: "
                  f"{r['skipped']}", style="dim")
    for note in summary["notes"]:
        out.print(note, style="yellow")


def _cells(row: dict, batch: int, n: int, dtype: str, act: str) -> list:
    if "gflops" not in row:
        return ["skipped" if row else "-", None, mb.intensity(batch, n, dtype, act)]
    return [row["gflops"], row["gbytes_s"], row["intensity"]]


def _ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a and b else None


def _records(stamp: str, summary: dict, settings: dict):
    """JSONL: the ceilings, every measured point and every skip, each with its environment."""
    from batchsim.server.platform import env

    run = {"command": "roofline", "run": stamp}
    yield {**run, "record": "bandwidth", "gbytes_s": summary["bandwidth_gbs"],
           "kernels_gbs": summary["bandwidth_kernels_gbs"],
           "env": env.environment(dtype="float32", **settings)}
    for d, g in summary["peak_gflops"].items():
        yield {**run, "record": "peak", "dtype": d, "gflops": g, **summary["peak_from"][d],
               "env": env.environment(dtype=d, **settings)}
    for section, rows in (("gemv_gemm", summary["rows"]), ("sweep", summary["sweep"]["rows"]),
                          ("peak", summary["peak_rows"])):
        for r in rows:
            if "gflops" in r:
                yield {**run, "record": "point", "section": section, **r,
                       "env": env.environment(dtype=r["dtype"], **settings)}
    for r in summary["skipped"]:
        yield {**run, "record": "skipped", **r,
               "env": env.environment(dtype=r["dtype"], **settings)}


def _plot(path: Path, summary: dict) -> Path:
    plt = pyplot()
    import numpy as np

    bw, peaks = summary["bandwidth_gbs"], summary["peak_gflops"]
    points = {(r["dtype"], r["batch"], r["n"]): r
              for r in summary["rows"] + summary["sweep"]["rows"] + summary["peak_rows"]
              if "gflops" in r}.values()
    xs = [r["intensity"] for r in points] + list(summary["ridge_flop_per_byte"].values())
    grid = np.geomspace(min(xs, default=0.5) / 3, max(xs, default=100.0) * 3, 400)
    fig, ax = plt.subplots(figsize=(11, 7.5), dpi=110)
    ax.plot(grid, grid * bw, ":", color="gray", lw=1, label=f"memory roof {bw:.1f} GB/s")
    for d, peak in peaks.items():
        color, ridge = _COLORS.get(d, "black"), summary["ridge_flop_per_byte"][d]
        # the ridge (the diamond) in the legend: beside it, close ridges' labels overprinted
        ax.plot(grid, np.minimum(peak, grid * bw), color=color, lw=2, alpha=0.7,
                label=f"{d} roof: {peak:.1f} GFLOP/s peak, ridge \u25c6 {ridge:.2g} FLOP/B")
        ax.plot([ridge], [peak], "D", color=color, ms=9, mec="black")
    for r in points:
        ax.scatter(r["intensity"], r["gflops"], marker=_MARKERS[r["shape"]], s=45, zorder=3,
                   color=_COLORS.get(r["dtype"], "black"), edgecolors="black", linewidths=0.5)
    for shape, marker in _MARKERS.items():  # legend entries for the marker shapes
        sweep = f", N={summary['sweep']['n']}" if shape == "batch" else ""
        ax.scatter([], [], marker=marker, color="white", edgecolors="black",
                   label=_SHAPE_LABELS[shape] + sweep)
    e = summary["env"]
    ax.set(xscale="log", yscale="log", xlabel="arithmetic intensity (FLOP / byte)",
           ylabel="GFLOP/s", title=f"Roofline: {e['device_name'] or e['cpu']} ({e['backend']}, "
                                   f"BLAS {e['blas']}, MLX {e['mlx']})")
    top = max([*peaks.values(), *(r["gflops"] for r in points)], default=bw * 10)
    ax.set_ylim(top=top * 4)  # the memory roof runs on far above the compute roofs
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(loc="upper left", fontsize=8)
    _label_points(ax, points)
    return save_figure(fig, path, dpi=100)


def _label_points(ax, points) -> None:
    """B=N above a sweep point, GEMV/GEMM N below the others, each moved on (further from its
    point) until it overlaps no label placed before: on a loaded machine a dtype's GEMVs land
    close together and their labels overprinted (offsets in points, 7-pt text)."""
    ax.get_xlim(), ax.get_ylim()  # the limits final before mapping points to the page
    to_pt = 72 / ax.figure.dpi
    placed: list[tuple[float, float, float, float]] = []
    for r in sorted(points, key=lambda r: -r["gflops"]):
        sweep = r["shape"] == "batch"  # sweep labels above, GEMV/GEMM below: they share x values
        label = f"B={r['batch']}" if sweep else f"{r['shape'].upper()} {r['n']}"
        x, y = (v * to_pt for v in ax.transData.transform((r["intensity"], r["gflops"])))
        width = 4.2 * len(label)
        for k in range(8):
            dy = (4 + 8 * k) if sweep else (-10 - 8 * k)
            box = (x + 5, y + dy, x + 5 + width, y + dy + 7)
            if not any(box[0] < b[2] and b[0] < box[2] and box[1] < b[3] and b[1] < box[3]
                       for b in placed):
                break
        placed.append(box)
        moved = {"arrowprops": {"arrowstyle": "-", "lw": 0.4, "color": "gray"}} if k else {}
        ax.annotate(label, (r["intensity"], r["gflops"]), textcoords="offset points",
                    xytext=(5, dy), fontsize=7, **moved)  # a label moved on: a line to its point
