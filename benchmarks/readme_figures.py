"""Reruns the figures of README.md and docs/*.md that move with the shipped Mac fit
(configs/reference/mlx-fit.yaml) and prints them as those pages quote them, each with its command
and the page that quotes it, so a refit is followed by one command instead of a hunt through the
pages:

    .venv/bin/python benchmarks/readme_figures.py [--only NAME,...]  (--help lists the names)

Every figure is a prediction (`size`, `compare`/`run --executor sim`, `fit-macs`), not a
measurement, so the load of the machine changes none of them; the header gives the date, the
commit (with `+dirty` if the tree differs from it), the machine and the fit they were taken at.
Runs go to a temporary directory (nothing is appended to results/). About 3 minutes on 2 cores at
load 2, two thirds of it one `fit-macs` run (shared by the trust table and the MoE rows).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]
BATCHSIM = Path(sys.executable).parent / "batchsim"
FIT = ROOT / "configs" / "reference" / "mlx-fit.yaml"
Q4_8B = ["--model", "llama-3.1-8b", "--quantize", "4"]


def batchsim(args: list[str], cwd: Path) -> dict:
    """One command's JSON document (its last stdout line); stderr shown only if it fails."""
    done = subprocess.run([str(BATCHSIM), *args, "--json"], cwd=cwd, capture_output=True,
                          text=True, check=False, env={**os.environ, "COLUMNS": "200"})
    if done.returncode:
        raise SystemExit(f"batchsim {' '.join(args)}: exit {done.returncode}: "
                         f"{done.stderr.strip().splitlines()[-1:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def shown(args: list[str]) -> str:
    """The command as typed; the temporary --out directory shown as DIR."""
    words = ["DIR" if i and args[i - 1] == "--out" else a for i, a in enumerate(args)]
    return "batchsim " + " ".join(f'"{a}"' if " " in a else a for a in words)


def header() -> str:
    def git(*a: str) -> str:
        return subprocess.run(["git", *a], cwd=ROOT, capture_output=True, text=True,
                              check=False).stdout
    commit = git("rev-parse", "--short", "HEAD").strip() + ("+dirty" if git("status",
                                                                          "--porcelain") else "")
    cpu = next((line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text()
                .splitlines() if line.startswith("model name")), platform.processor()) \
        if Path("/proc/cpuinfo").exists() else platform.processor()
    fit = yaml.safe_load(FIT.read_text())
    return (f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}, commit {commit}, "
            f"{platform.system()} {platform.machine()} ({cpu}, {os.cpu_count()} cores), "
            f"load average {os.getloadavg()[0]:.1f}; fit: {' '.join(fit['fitted_on'].split())}")


_FIT_MACS: dict[str, dict] = {}


def fit_macs(tmp: Path) -> dict:
    """`batchsim fit-macs --json`, run once for the figures that read it (moe, trust)."""
    if "doc" not in _FIT_MACS:
        _FIT_MACS["doc"] = batchsim(["fit-macs"], tmp)
    return _FIT_MACS["doc"]


def fit_terms(_: Path) -> list[str]:
    """The terms the 'Per-Mac GPU step' paragraph quotes (docs/simulator.md)."""
    f = yaml.safe_load(FIT.read_text())
    bw, err = f["bandwidth_efficiency"], {k: 100 * v for k, v in f["errors"].items()}
    return [
        (f"weights stream at float {bw['float']:.2f}, 8-bit {bw['q8']:.2f}, 4-bit "
         f"{bw['q4']:.2f} of peak; routed experts {f['expert_bandwidth_efficiency']:.2f} of that; "
         f"K/V reads {f['kv_bandwidth_efficiency']:.2f}"),
        (f"fixed {f['layer_overhead_us']:.0f} us per layer + {f['forward_overhead_us']:.0f} us "
         f"per forward; two-die Ultra +{f['ultra_layer_us']:.1f} us per layer, "
         f"+{f['ultra_moe_layer_us']:.0f} us per MoE layer, bandwidth slowdown "
         f"{f.get('ultra_bandwidth_slowdown', 0):.2f}"),
        (f"sampling {f['sampling_row_us']:.0f} us per sampled row (per_row engines); top-p "
         f"sampler bytes {f.get('top_p_slowdown', 0):.2f}x their peak-bandwidth time; "
         f"attention_row_us {f['attention_row_us']:.0f}; 4-bit GEMM "
         f"{f['quantized_gemm_efficiency'][4]:.2f} of FP16 peak; compute "
         f"{f['compute_efficiency']:.2f}"),
        (f"qmv rows {f['quantized_gemv_row_efficiency']:.2f} of FP16 peak; M1/M2 Ultra qmv "
         f"slowdown {f['ultra_gemv_row_slowdown']:.2f}; host costs x (1 / CPU speed)^"
         f"{f['cpu_exponent']:g}"),
        (f"held-out batch-1 |error|: source out {err['leave_one_source_out_median_abs']:.0f}% "
         f"median ({err['leave_one_source_out_worst_abs']:.0f}% worst), chip out "
         f"{err['leave_one_chip_out_median_abs']:.0f}% "
         f"({err['leave_one_chip_out_worst_abs']:.0f}%)"),
    ]


def per_mac(tmp: Path) -> list[str]:
    """'Per Mac' (README.md): the smallest and largest max batch, a best batch below the max."""
    args = ["size", *Q4_8B, "--context", "4096"]
    rows = batchsim(args, tmp)["rows"]
    fits = [r for r in rows if r["max_batch_padded"]]
    small, big = min(fits, key=lambda r: r["max_batch_padded"]), max(
        fits, key=lambda r: r["max_batch_padded"])
    lines = [(f"`{shown(args)}`: from {small['max_batch_padded']} sequences on a "
              f"{small['memory_gb']:g} GB {small['label']} to {big['max_batch_padded']} "
              f"({big['max_batch_padded_raised']} raised) on a {big['memory_gb']:g} GB "
              f"{big['label']}")]
    below = [r for r in rows if r["best_batch"] and r["best_batch"] < r["max_batch_padded"]]
    quoted = [r for r in rows if r["label"] == "M4 10c" and r["memory_gb"] == 32]  # README.md's
    for r in quoted + sorted(below, key=lambda r: r["decode_tok_s_max_batch"]
                             / r["decode_tok_s_best"])[:2]:
        lines.append(f"{r['label']} {r['memory_gb']:g} GB: {r['decode_tok_s_max_batch']:.1f} "
                     f"tok/s at its max batch {r['max_batch_padded']}, "
                     f"{r['decode_tok_s_best']:.1f} at {r['best_batch']}")
    return lines


def engines(tmp: Path) -> list[str]:
    """compare's batching gain by engine (docs/simulator.md: 'Serving engines')."""
    lines = []
    for engine in ("batchsim", "mlx-lm-generate"):
        args = ["compare", "--executor", "sim", "--device-profile", "M4 Max", "--model",
                "llama-3.2-1b", "--quantize", "4", "--dtype", "float16", "--batch", "8",
                "--num-prompts", "16", "--engine", engine]
        lines.append(f"`{shown(args)}`: {batchsim(args, tmp)['speedup']:.2f}x")
    return lines


def m5(tmp: Path) -> list[str]:
    """M5 Max vs M4 Max at the max batch (context 128), the M5 prefill the peak came from
    (docs/simulator.md: 'M5')."""
    lines = []
    for mac in ("M5 Max", "M4 Max"):
        args = ["size", *Q4_8B, "--mac", mac, "--context", "128"]
        row = max(batchsim(args, tmp)["rows"], key=lambda r: r["memory_gb"])
        lines.append(f"`{shown(args)}`: {row['decode_tok_s_max_batch']:,.0f} tok/s at the max "
                     f"batch ({row['max_batch_padded']}) of a {row['memory_gb']:g} GB "
                     f"{row['label']}")
    args = ["run", "--executor", "sim", "--device-profile", "M5 Max 40c", *Q4_8B,
            "--input-len", "512", "--output-len", "2", "--num-prompts", "1", "--no-timeline",
            "--out", str(tmp / "runs")]
    lines.append(f"`{shown(args)}`: mean TTFT {batchsim(args, tmp)['mean_ttft_ms']:.0f} ms "
                 "(published: 173 ms)")
    return lines


def spec(tmp: Path) -> list[str]:
    """The per-Mac K=4 n-gram table (docs/measured.md: 'Per Mac, K = 4, ...')."""
    by_model = {}
    for model in ("llama-3.1-8b", "qwen3-30b-a3b"):
        args = ["size", "--model", model, "--quantize", "4", "--spec-tokens", "4",
                "--acceptance", "0.55,0.37,0.28,0.23", "--draft-share", "0.085"]
        rows = batchsim(args, tmp)["rows"]
        largest = {}
        for r in rows:
            if r["memory_gb"] >= largest.get(r["label"], r)["memory_gb"]:
                largest[r["label"]] = r
        by_model[model] = largest
    lines = []
    for label, r8 in by_model["llama-3.1-8b"].items():
        cells = [f"{label} {r8['memory_gb']:g} GB"]
        for r in (r8, by_model["qwen3-30b-a3b"].get(label)):
            if not r or not r["max_batch_padded"]:
                cells += ["no fit", "", ""]
                continue
            even = r.get("spec_break_even_batch")
            cells += [f"{r['decode_tok_s_b1']:.1f}",
                      f"{r['decode_tok_s_b1_spec'] / r['decode_tok_s_b1']:.2f}",
                      f"> {r['max_batch_padded']}" if even is None else str(even)]
        lines.append("| " + " | ".join(cells) + " |")
    for model in ("llama-3.1-8b", "qwen3-30b-a3b"):  # the same rates, a draft every step
        args = ["size", "--model", model, "--quantize", "4", "--spec-tokens", "4",
                "--acceptance", "0.55,0.37,0.28,0.23", "--draft-share", "1"]
        gains = sorted((r["decode_tok_s_b1_spec"] / r["decode_tok_s_b1"], r["label"])
                       for r in batchsim(args, tmp)["rows"] if r["max_batch_padded"])
        lines.append(f"`{shown(args)}`: K=4 x b1 {gains[0][0]:.2f}x ({gains[0][1]}) to "
                     f"{gains[-1][0]:.2f}x ({gains[-1][1]})")
    return lines


def draft(tmp: Path) -> list[str]:
    """A 1B draft model vs n-gram lookup at acceptance 0.8 (docs/measured.md)."""
    lines = []
    for mac in ("M2 Ultra 76c", "M4 Max 40c", "M5 Max 40c"):
        for drafter in ([], ["--draft-model", "llama-3.2-1b"]):
            args = ["size", *Q4_8B, "--spec-tokens", "4", "--acceptance", "0.8", "--mac", mac,
                    *drafter]
            r = max(batchsim(args, tmp)["rows"], key=lambda r: r["memory_gb"])
            lines.append(f"`{shown(args)}`: {r['decode_tok_s_b1_spec'] / r['decode_tok_s_b1']:.2f}x"
                         f" at batch 1, {r['spec_break_even']} at batch "
                         f"{r['spec_break_even_batch']}, max batch {r['max_batch_padded']}")
    return lines


def spec_run(tmp: Path) -> list[str]:
    """The simulated n-gram run at 0.1 and 20 req/s (docs/how-it-works.md: 'Example')."""
    ngram = ["--spec-method", "ngram", "--spec-tokens", "4", "--acceptance",
             "0.55,0.37,0.28,0.23"]
    cases = [("0.1", "100", []), ("0.1", "100", [*ngram, "--draft-share", "0.085"]),
             ("0.1", "100", [*ngram, "--draft-share", "1"]), ("20", "500", []),
             *[("20", "500", [*ngram, "--draft-share", "0.085", "--spec-policy", policy])
               for policy in ("fixed", "shrink")]]
    lines = []
    for rate, prompts, extra in cases:
        args = ["run", "--executor", "sim", *Q4_8B, "--device-profile", "M2 Ultra", "--seed",
                "3", "--num-prompts", prompts, "--request-rate", rate, *extra, "--no-timeline",
                "--no-progress", "--out", str(tmp / "runs")]
        s = batchsim(args, tmp)
        lines.append(f"`{shown(args)}`: mean batch {s['mean_batch_size']:.2f}, median TPOT "
                     f"{s['median_tpot_ms']:.2f} ms, output {s['output_throughput']:.0f} tok/s")
    return lines


def prefix(tmp: Path) -> list[str]:
    """compare --prefix-cache on the two sharing workloads (docs/how-it-works.md)."""
    lines = []
    for workload in ("shared-prompt", "chat-sessions"):
        args = ["compare", "--prefix-cache", "--workload", workload, "--executor", "sim",
                "--device-profile", "M2 Max", *Q4_8B]
        d = batchsim(args, tmp)
        off, on = d["cache_off"], d["cache_on"]
        lines.append(f"`{shown(args)}`: hit rate {on['prefix_cache_hit_rate']:.2f}, "
                     f"TTFT p50 {off['median_ttft_ms'] / 1e3:.2f} s -> "
                     f"{on['median_ttft_ms'] / 1e3:.2f} s, p99 {off['p99_ttft_ms'] / 1e3:.1f} -> "
                     f"{on['p99_ttft_ms'] / 1e3:.1f} s, output {off['output_throughput']:.1f} -> "
                     f"{on['output_throughput']:.1f} tok/s")
    return lines


def moe(tmp: Path) -> list[str]:
    """fit-macs' after_tok_s for the MoE rows docs/models.md quotes, and every batched MoE row."""
    rows = fit_macs(tmp)["cv"]["rows"]
    quoted = ("mlxlm-m4max-qwen3-30b-a3b-q4-b1-2k", "llmfit-m2pro-gpt-oss-20b-q4-b1")
    batched = [r for r in rows if r["batch"] > 1 and any(
        m in r["model"] for m in ("-a3b", "-a22b", "gpt-oss", "deepseek", "mixtral"))]
    lines = [(f"`batchsim fit-macs --json`: {len(batched)} batched MoE rows, "
             f"{sum(not r['explained'] for r in batched)} marked unexplained")]
    for r in [r for r in rows if r["id"] in quoted] + batched:
        lines.append(f"{r['id']} ({r['engine']}, B={r['batch']}"
                     f"{'' if r['explained'] else ', unexplained'}): predicted "
                     f"{r['after_tok_s']:.1f} vs {r['measured_tok_s']:.1f} measured "
                     f"({100 * (r['after_tok_s'] / r['measured_tok_s'] - 1):+.0f}%)")
    return lines


def trust(tmp: Path) -> list[str]:
    """The trust table's held-out errors (README.md: 'Mac predictions'); worst rows
    (docs/simulator.md: 'Where it stands')."""
    cv = fit_macs(tmp)["cv"]
    lines = []
    for label, folds in (("now", cv), ("before (batch-1-only fit)", cv["before"])):
        for fold in ("leave_one_source_out", "leave_one_chip_out"):
            for rows, part in (("all rows", folds[fold]), ("explained rows only",
                                                             folds[fold]["explained_only"])):
                cells = [f"{100 * part[k]['median_abs']:.1f}% / {100 * part[k]['worst_abs']:.0f}%"
                         f" (n {part[k]['n']})" for k in ("b1", "batched", "gain")]
                lines.append(f"| {fold.replace('_', ' ')}, {label}, {rows} | "
                             + " | ".join(cells) + " |")
    held = "leave_one_source_out_tok_s"  # the paragraph's worst rows: held out by source
    worst = sorted(cv["rows"], key=lambda r: -abs(r[held] / r["measured_tok_s"] - 1))[:12]
    lines += [f"worst held out (source): {r['id']} ({r['engine']}, B={r['batch']}"
              f"{'' if r['explained'] else ', unexplained'}) "
              f"{100 * (r[held] / r['measured_tok_s'] - 1):+.0f}%" for r in worst]
    return lines


def cluster(tmp: Path) -> list[str]:
    """size --macs N on a 512 GB M3 Ultra 80c (docs/distributed.md: 'Simulated and sized')."""
    lines = []
    for model in ("llama-3.1-70b", "deepseek-v3", "qwen3-235b-a22b"):
        tok_s = []
        for macs in (1, 2, 4):
            args = ["size", "--model", model, "--quantize", "4", "--mac", "M3 Ultra 80c",
                    "--macs", str(macs), "--link", "tb5-rdma"]
            row = next(r for r in batchsim(args, tmp)["rows"] if r["memory_gb"] == 512)
            tok_s.append(row["decode_tok_s_b1"])
        lines.append(f"| {model} | {tok_s[0]:.1f} | {tok_s[1]:.1f} ({tok_s[1] / tok_s[0]:.2f}x) "
                     f"| {tok_s[2]:.1f} ({tok_s[2] / tok_s[0]:.2f}x) |")
    for macs in (2, 4):  # over TCP instead of RDMA
        args = ["size", "--model", "deepseek-v3", "--quantize", "4", "--mac", "M3 Ultra 80c",
                "--macs", str(macs), "--link", "tb5"]
        row = next(r for r in batchsim(args, tmp)["rows"] if r["memory_gb"] == 512)
        lines.append(f"`{shown(args)}`: {row['decode_tok_s_b1']:.1f} tok/s at batch 1")
    return lines


def hour(tmp: Path) -> list[str]:
    """The simulated hour at 32, 64 and 128 seats (README.md: 'The simulated hour')."""
    lines = []
    for seats in (32, 64, 128):
        args = ["run", "--executor", "sim", "--device-profile", "M2 Ultra", *Q4_8B,
                "--request-rate", "5", "--num-prompts", "18000", "--seed", "3",
                "--max-num-seqs", str(seats), "--no-timeline", "--no-progress",
                "--out", str(tmp / "runs")]
        s = batchsim(args, tmp)
        lines.append(f"`{shown(args)}`: {s['request_throughput']:.2f} req/s, "
                     f"{s['output_throughput']:.0f} output tok/s, mean TTFT "
                     f"{s['mean_ttft_ms'] / 1e3:.0f} s (p99 {s['p99_ttft_ms'] / 1e3:,.0f} s), "
                     f"mean TPOT {s['mean_tpot_ms']:.0f} ms, max concurrent "
                     f"{s['max_concurrent_requests']:,}, peak KV {s['peak_kv_bytes'] / 2**30:.1f} "
                     f"of {s['kv_budget_bytes'] / 2**30:.0f} GiB, {s['num_plans']:,} plans over "
                     f"{s['duration']:,.0f} simulated s")
    return lines


def cliff(_: Path) -> list[str]:
    """The decode step each side of the qmv batch limit (docs/simulator.md: 'Known wrong shape')."""
    from batchsim.server.perf.batch_gain import catalog_cost  # pricing only: no matmul runs

    lines = []
    for chip, batches in (("M2 Max 30c", (4, 5, 6)), ("M3 Max 40c", (12, 13))):
        cost = catalog_cost("llama-3.1-8b", chip)
        steps = ", ".join(f"{1e3 * cost.decode_time(b, 512).total_s:.1f} ms at {b}"
                          for b in batches)
        lines.append(f"{chip}, llama-3.1-8b 4-bit, 512 tokens of context: decode step {steps}")
    return lines


FIGURES: dict[str, Callable[[Path], list[str]]] = {
    "fit_terms": fit_terms, "per_mac": per_mac, "engines": engines, "m5": m5, "spec": spec,
    "draft": draft, "spec_run": spec_run, "prefix": prefix, "moe": moe, "trust": trust,
    "cluster": cluster, "hour": hour, "cliff": cliff,
}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--only", default=",".join(FIGURES),
                   help=f"comma-separated figures [default: all: {','.join(FIGURES)}]")
    args = p.parse_args()
    names = [n.strip() for n in args.only.split(",") if n.strip()]
    unknown = sorted(set(names) - set(FIGURES))
    if unknown:
        p.error(f"unknown figure(s) {', '.join(unknown)}; choose from {', '.join(FIGURES)}")
    print(header())
    with tempfile.TemporaryDirectory() as tmp:
        for name in names:
            started = time.monotonic()
            lines = FIGURES[name](Path(tmp))
            print(f"\n## {name} ({time.monotonic() - started:.0f} s): {FIGURES[name].__doc__}")
            print("\n".join(lines), flush=True)


if __name__ == "__main__":
    main()
