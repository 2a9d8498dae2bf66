"""What `batchsim size` shows of its rows: the per-Mac table with its notes, the predicted decode
step by part (--explain), and the plot. The flags and the arithmetic live elsewhere (size.py,
server.perf.size_limits)."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import numpy as np
from batchsim.scheduler.pool_geometry import KV_STEP, PAGE_TOKENS
from batchsim.scripts.common import fmt, gib, out, pyplot, save_figure, table
from batchsim.server.models.spec import ModelSpec
from batchsim.server.perf.engines import load_engine
from batchsim.server.perf.layer_cost import gather_rhs_batch
from batchsim.server.perf.profile import KV_DEQUANT_OPS_PER_ELEMENT
from batchsim.server.perf.size_limits import MAX_BATCH_CAP
from batchsim.server.perf.stepcost import StepTime
from rich.text import Text


def print_table(rows: list[dict], meta: dict, spec: ModelSpec) -> None:
    what = f"{spec.name} {_weights_tag(meta)}, engine {meta['engine']}, context {meta['context']}"
    cols, body = _columns(rows)
    asked = []  # columns a flag asked for: kept at any width, beside the limits
    if not spec.is_dense:  # where the per-sequence bytes come from
        cols.insert(6, "KV full/win/state MiB")
        for line, r in zip(body, rows):
            line.insert(6, "/".join(f"{v / (1 << 20):.4g}" for v in r["kv_per_seq"].values()))
    if meta["shared_prefix_tokens"]:  # beside the padded/paged limits
        at = cols.index("raised padded/paged") + 1
        cols.insert(at, "shared dflt/raised")
        asked.append("shared dflt/raised")
        for line, r in zip(body, rows):
            line.insert(at, f"{r['max_batch_shared']} / {r['max_batch_shared_raised']}")
    if meta["spec_tokens"]:  # speculation's speed-up at batch 1 and where it stops paying
        cols += [f"K={meta['spec_tokens']} x b1", "spec stops at"]
        asked += cols[-2:]
        for line, r in zip(body, rows):
            b1, plain = r.get("decode_tok_s_b1_spec"), r["decode_tok_s_b1"]
            line += [b1 / plain if b1 and plain else None, _stops(r) if b1 and plain else None]
    out.print(table(
        f"Batch limits per Mac: {what} (padded = rows padded to the longest in {KV_STEP}-token "
        f"steps; paged = {PAGE_TOKENS}-token blocks)", cols, body,
        keep=["chip", "mem GB", "max batch padded/paged", *asked, "tok/s b1", "tok/s @max",
              "fits"]))
    for line in _notes(rows, meta, what, spec):
        out.print(line)


def _stops(row: dict) -> int | str | None:
    """The 'spec stops at' cell: the batch, or "> N" where it pays up to the max batch N."""
    every = row.get("spec_break_even") == "pays_at_every_batch"
    return f"> {row['max_batch']}" if every else row.get("spec_break_even_batch")


def _columns(rows: list[dict]) -> tuple[list[str], list[list]]:
    return (
        ["chip", "GPU", "mem GB", "usable GiB dflt/raised", "weights GiB", "KV/seq MiB",
         "max batch padded/paged", "raised padded/paged", "tok/s b1", "tok/s @max", "best batch",
         "tok/s @best", "fits"],
        [[r["chip"], r["gpu_cores"], r["memory_gb"],
          f"{fmt(gib(r['usable_bytes']))} / {fmt(gib(r['usable_bytes_raised']))}",
          gib(r["weight_bytes"]), r["kv_bytes_per_seq"] / (1 << 20),
          f"{r['max_batch_padded']} / {r['max_batch_paged']}",
          f"{r['max_batch_padded_raised']} / {r['max_batch_paged_raised']}",
          _tok(r, "decode_tok_s_b1"), _tok(r, "decode_tok_s_max_batch"), fmt(r["best_batch"]),
          _tok(r, "decode_tok_s_best"),
          "yes" if r["fits"] else ("raised" if r["fits_raised"] else "no")] for r in rows],
    )


def _notes(rows: list[dict], meta: dict, what: str, spec: ModelSpec) -> list[str | Text]:
    notes = [
        (f"Usable: Metal's default working set ({meta['working_set_rule']}); raised: "
         f"iogpu.wired_limit_mb = RAM - {meta['os_reserve_gb']:g} GB. Budget = usable - weights."),
        "Fixed context: every batch is exact." if meta["context_fixed"] else
        f"Distribution: max batch = the largest B whose p{meta['fit_quantile'] * 100:g} KV bytes "
        f"over {meta['fit_trials']} seeded batches fit; mean context "
        f"{meta['context_mean_tokens']:.0f}.",
        f"Decode tok/s: the simulator's step cost at the mean context (`batchsim sweep "
        f"--executor sim` predicts the same); max batch = the padded one. GPU step: "
        f"{meta['profile_terms']}, fitted on {meta['bandwidth_efficiency_source']}"
        + _held_out(meta["profile_errors"]) + ".",
    ]
    notes += _best_note(rows)
    if meta["shared_prefix_tokens"]:
        notes.append(f"Shared: paged, every sequence's first {meta['shared_prefix_tokens']} tokens "
                     f"the same prompt, its whole {PAGE_TOKENS}-token blocks stored once (a prefix "
                     f"cache's reuse; sliding-window and linear-attention state never shared).")
    engine = load_engine(meta["engine"])
    notes.append(f"Engine {engine.name} (configs/engines/{engine.name}.yaml): host "
                 f"{engine.host_step_us:g} us per step + {engine.host_token_us:g} us per token"
                 + (f" + {engine.host_request_s:.3g} s per request (before its first token: in "
                    f"TTFT, on its prefill chunk; a one-token prompt, which has none, pays it in "
                    f"its first decode step)" if engine.host_request_us else "")
                 + engine.batching_note()
                 + (f" ({engine.host_basis})" if engine.host_basis else "") + ".")
    if not spec.is_dense:
        notes.append(f"{'+'.join(spec.families)}: KV/seq is mlx-lm's exact cache of one sequence "
                     f"at the mean context, by kind (full-attention/MLA KV grows with it, sliding "
                     f"layers' KV is capped at their window, linear-attention state is fixed); "
                     f"padded max batch = budget over B x that at the longest. MoE decode reads "
                     f"the expected distinct experts under uniform routing (an upper bound).")
    notes += _gate_note(rows, meta, spec)
    if meta["kv_bits"]:
        notes.append(f"KV {meta['kv_bits']}-bit: mlx-lm's QuantizedKVCache (packed K/V + a scale "
                     f"and a bias per 64 elements); decode attention reads those bytes plus an "
                     f"assumed dequantization of {KV_DEQUANT_OPS_PER_ELEMENT} ops per K/V element "
                     f"at the compute rate (not measured on Metal). Batched MLX serving of it: not "
                     f"yet (`run --executor sim` simulates it).")
    if meta["macs"] > 1:
        notes.append(f"Cluster: {meta['macs']} Macs of each row's kind, {meta['parallel']} "
                     f"parallel over {meta['link_name']} ({meta['link_bandwidth_gbs']:g} GB/s, "
                     f"{meta['link_latency_us']:g} us per message, {meta['link_topology']}). "
                     f"Memory, weights, KV/seq and max batch are per Mac; tok/s is the cluster's; "
                     f"--explain shows the link's share (comm)."
                     + (" RDMA over Thunderbolt needs Thunderbolt 5 and macOS 26.2 (M1/M2 Macs "
                        "have Thunderbolt 4: --link tb4)." if meta["link"] == "tb5-rdma" else ""))
    notes += sorted({r["refused"] for r in rows if r.get("refused")})
    if any(r["peaks_estimated"] for r in rows):
        notes.append("* peak FLOP/s estimated (configs/macs.yaml says from what: M3/M4 from "
                     "third-party clocks, M5 from a published time to first token).")
    if any(r["capped"] for r in rows):
        notes.append(f"Max batch is capped at {MAX_BATCH_CAP}.")
    if not any(r["fits"] for r in rows):
        raised = [f"{r['label']} {r['memory_gb']:g}GB" for r in rows if r["fits_raised"]]
        notes.append(Text(f"{what} fits no Mac here at the default Metal limit", "bold red")
                     + (f"; with iogpu.wired_limit_mb raised: {', '.join(raised)}." if raised
                        else ", nor with iogpu.wired_limit_mb raised."))
    return notes


def _gate_note(rows: list[dict], meta: dict, spec: ModelSpec) -> list[str]:
    """Where a row's max or best batch reaches MLX's grouped expert matmul (gather_qmm_rhs)."""
    gate = gather_rhs_batch(spec) if meta["quantize_bits"] else None
    if gate is None or not any(max(r["max_batch"], r["best_batch"] or 0) >= gate for r in rows):
        return []
    return [(f"MoE from batch {gate}: MLX runs each expert's pairs as one grouped matmul "
             f"(gather_qmm_rhs), not a mat-vec per (token, expert) pair, and the predicted step "
             f"drops there; no published decode row reaches it (unvalidated).")]


def _best_note(rows: list[dict]) -> list[str]:
    """Why the max batch can be slower than a smaller one, where a row shows it."""
    slower = [r for r in rows if r["best_batch"] and r["best_batch"] < r["max_batch"]]
    if not slower:
        return []
    r = max(slower, key=lambda r: r["decode_tok_s_best"] / r["decode_tok_s_max_batch"])
    return [f"Best batch: the batch up to the max with the most predicted tok/s; below the max "
            f"on {len(slower)} of {len(rows)} rows (e.g. {r['label']} {r['memory_gb']:g}GB: "
            f"{fmt(r['decode_tok_s_best'])} tok/s at {r['best_batch']}, "
            f"{fmt(r['decode_tok_s_max_batch'])} at {r['max_batch']}). " + _WHY_BEST]


_WHY_BEST = ("More memory seats more rows, but on a compute-bound step each row adds matmul work "
             "(MLX's quantized matmuls run in 32-row tiles) and its own K/V reads, so the step can "
             "grow faster than its tokens: cap the batch (--max-num-seqs) at the best for "
             "throughput.")


PARTS = tuple(f.name for f in dataclasses.fields(StepTime)) + ("total_s",)


def print_parts(rows: list[dict], meta: dict) -> None:
    """The predicted decode step, part by part, in ms: one line per Mac, memory size and batch
    (parts that are zero in every line left out)."""
    steps = [(r, batch, r[key]) for r in rows
             for batch, key in ((1, "parts_b1"), (r["max_batch"], "parts"),
                                (f"1, K={meta['spec_tokens']}", "parts_spec_b1")) if r.get(key)]
    shown = [p for p in PARTS if p == "total_s" or any(parts[p] for _, _, parts in steps)]
    body = [[f"{r['label']} {r['memory_gb']:g}GB", batch] + [1e3 * parts[p] for p in shown]
            + [r["decode_tok_s_b1_spec"] if isinstance(batch, str) else batch / parts["total_s"]]
            for r, batch, parts in steps]
    names = [p.removesuffix("_s").replace("_", " ") + " ms" for p in shown]
    cols = ["Mac", "batch", *names, "tok/s"]
    out.print(table(f"Predicted decode step by part, engine {meta['engine']}, context "
                    f"{meta['context']} (mean "
                    f"{meta['context_mean_tokens']:.0f} tokens read per row)", cols, body,
                    keep=["Mac", "batch", "total ms", "tok/s"]))  # the sum before its parts
    out.print("weights: linear layers streaming their weights; matmul: their arithmetic (a "
              "Mac's one-row step: the larger of the two; several rows: both); attention: K/V "
              "reads; draft: the drafter (a draft model's K forwards, else n-gram lookups; row "
              "'1, K=k': a verify step at batch 1, tok/s with its acceptance); "
              "elementwise: norms, activations, logits; fixed: per layer and forward pass (a Mac's "
              "fitted kernel dispatch and sync); step overhead: per engine step (zero on a catalog "
              "Mac); copy: KV pool copies (none in steady decode); experts: MoE routed experts "
              "(the distinct experts the batch routes to); gemv rows: quantized layers' rows past "
              "the first that MLX runs as qmv, and MoE (token, expert) pairs past their "
              "expert's first below the grouped-matmul gate; attention rows: attention's fixed "
              "cost per row; token ops: elementwise kernels' per token; sampling: per row; host "
              f"step / host token: the engine's ({meta['engine']}) host work"
              + ("; top p: its top-p sampler's passes over each sampled row's logits (MLX's "
                 "argsort, gathers, a scan and a scatter), their bytes at the fit's top-p rate"
                 if "top_p_s" in shown else "") + ". Zero parts are not shown.")


def _held_out(errors: dict) -> str:
    """The fit's held-out error, beside every per-Mac figure it predicts."""
    if not errors:
        return ""
    return (f"; held-out |error| of batch-1 tok/s: median "
            f"{100 * errors['leave_one_chip_out_median_abs']:.0f}% (worst "
            f"{100 * errors['leave_one_chip_out_worst_abs']:.0f}%) leaving one chip out, "
            f"{100 * errors['leave_one_source_out_median_abs']:.0f}% "
            f"({100 * errors['leave_one_source_out_worst_abs']:.0f}%) one source out")


def _weights_tag(meta: dict) -> str:
    q, kv = meta["quantize_bits"], meta["kv_bits"]
    return (f"{q}-bit" if q else meta["dtype"]) + (f", KV {kv}-bit" if kv else "")


def _tok(row: dict, key: str) -> str:
    value = row[key]
    return "-" if value is None else fmt(value) + ("*" if row["peaks_estimated"] else "")


def plot(rows: list[dict], meta: dict, path: Path) -> Path:
    """Max batch (padded vs paged) and predicted tok/s (batch 1, max batch, best batch) per Mac
    config."""
    plt, y = pyplot(), np.arange(len(rows))
    fig, (ax_b, ax_t) = plt.subplots(1, 2, figsize=(12, 1.5 + 0.24 * len(rows)), sharey=True)
    bars = [
        (ax_b, "max_batch_padded", f"padded ({KV_STEP}-token steps)", -0.2, 0.4),
        (ax_b, "max_batch_paged", f"paged ({PAGE_TOKENS}-token blocks)", 0.2, 0.4),
        (ax_t, "decode_tok_s_b1", "batch 1", -0.27, 0.27),
        (ax_t, "decode_tok_s_max_batch", "max batch (padded)", 0, 0.27),
        (ax_t, "decode_tok_s_best", "best batch (<= max)", 0.27, 0.27),
    ]
    # Max batch on a log axis (1 on an 8 GB M1 to 1,513), unless it fits nowhere (all zero).
    log = any(r["max_batch_padded"] or r["max_batch_paged"] for r in rows)
    for ax, key, label, dy, height in bars:
        ax.barh(y + dy, [r[key] or 0 for r in rows], height, label=label, log=log and ax is ax_b)
    # The x axes run past the bars: room for the legends.
    ax_b.set_xlim(0.8 if log else 0, (10 if log else 1.6) * ax_b.get_xlim()[1])
    ax_t.set_xlim(0, 1.6 * ax_t.get_xlim()[1])
    for ax in (ax_b, ax_t):
        ax.grid(axis="x", alpha=0.3)
        ax.legend(loc="lower right", fontsize=8)
    ax_b.set_xlabel("max concurrent sequences (default Metal limit; log scale)")
    ax_t.set_xlabel("predicted decode tok/s (the simulator's step cost; * peak FLOP/s estimated)")
    ax_b.set_yticks(y, [f"{r['label']} {r['memory_gb']:g}GB{'*' if r['peaks_estimated'] else ''}"
                        for r in rows], fontsize=7)
    ax_b.invert_yaxis()
    fig.suptitle(f"{meta['model']} {_weights_tag(meta)}, engine {meta['engine']}, context "
                 f"{meta['context']}: predicted per Mac (no model run)")
    # tight_layout leaves the suptitle a fixed fraction of the height: on the tall catalog
    # figure that was less than its line, and the title sat on the axes. Keep 0.5 in free.
    fig.tight_layout(rect=(0, 0, 1, 1 - 0.5 / fig.get_figheight()))
    return save_figure(fig, path, tight=False)
