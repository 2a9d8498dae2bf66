"""`batchsim size`: per Mac and memory size, how much memory the GPU may use, how many sequences fit
before the KV cache overruns it (padded vs paged layout), and the decode tok/s the simulator's
performance model predicts. The arithmetic lives in server.perf.size_limits; here the flags, the
table and the plot. No model runs and no MLX."""

from __future__ import annotations

import argparse
import dataclasses
from pathlib import Path

import numpy as np
from batchsim.configs import ConfigError
from batchsim.scheduler.config import MAX_SPEC_TOKENS
from batchsim.scheduler.pool_geometry import KV_STEP, PAGE_TOKENS
from batchsim.scripts.common import (
    add_field_argument,
    append_jsonl,
    bounded,
    fmt,
    gib,
    non_negative_float,
    non_negative_int,
    out,
    positive_float,
    positive_int,
    pyplot,
    save_figure,
    seed_int,
    table,
    timestamp,
)
from batchsim.scripts.spec_args import acceptance_of, add_acceptance_args
from batchsim.server.models.loader import spec_for
from batchsim.server.models.spec import FLOAT_DTYPES, KV_BITS, QUANT_BITS, ModelSpec, zoo_names
from batchsim.server.perf import macs
from batchsim.server.perf.cluster import Cluster, resolve_link
from batchsim.server.perf.engines import DEFAULT_ENGINE, engine_help, load_engine
from batchsim.server.perf.gpu_fit import fit_format, load_fit
from batchsim.server.perf.profile import KV_DEQUANT_OPS_PER_ELEMENT
from batchsim.server.perf.size_limits import (
    FIT_TRIALS,
    MAX_BATCH_CAP,
    ContextFit,
    Settings,
    context_fit,
    mac_row,
)
from batchsim.server.perf.spec_price import check_speculation
from batchsim.server.perf.stepcost import StepTime


def add_parser(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default="llama-3.1-8b",
                   help=f"zoo model ({', '.join(zoo_names())}), a model directory, or a hub id")
    p.add_argument("--dtype", default="float16", choices=list(FLOAT_DTYPES), help="weights dtype")
    p.add_argument("--quantize", type=int, choices=list(QUANT_BITS), default=None,
                   help="mlx-lm affine quantization (group 64) to 4 or 8 bits")
    add_field_argument(p, Settings, "kv_bits", "K/V held as mlx-lm's QuantizedKVCache at 4 or 8 "
                       "bits (group 64; scales and biases in the compute dtype)",
                       choices=list(KV_BITS), unset=False)
    ctx = p.add_mutually_exclusive_group()
    ctx.add_argument("--context", type=positive_int, default=4096,
                     help="fixed tokens per sequence")
    ctx.add_argument("--context-dist", default=None,
                     help="tokens per sequence as a distribution, e.g. lognormal:2000:1500:8192 "
                          "(any form of workloads.lengths.parse_length)")
    p.add_argument("--fit-quantile", type=_fraction, default=0.95,
                   help=f"a distribution's max batch: the largest B whose KV bytes, at this "
                        f"quantile of {FIT_TRIALS} seeded batches of B draws, fit the budget "
                        f"(padded: B x longest rounded up to {KV_STEP}; paged: sum of lengths "
                        f"rounded up to {PAGE_TOKENS})")
    p.add_argument("--seed", type=seed_int, default=0, help="seed of the distribution's draws")
    p.add_argument("--shared-prefix", type=non_negative_int, default=0, metavar="TOKENS",
                   help=f"every sequence starts with the same TOKENS-token prompt (a system "
                        f"prompt; part of its context), stored once in whole {PAGE_TOKENS}-token "
                        f"blocks as a prefix cache keeps it: adds max_batch_shared, the paged "
                        f"max batch with the prefix shared (0: none) [default: 0]")
    p.add_argument("--mac", default=None,
                   help="only this chip (exact name, substring, or a label like 'M2 Ultra 76c'); "
                        "default: every Mac in the catalog (configs/macs.yaml)")
    p.add_argument("--memory-gb", type=positive_float, default=None,
                   help="this RAM size (GB as Apple sells it, i.e. GiB) instead of the catalog's")
    p.add_argument("--os-reserve-gb", type=non_negative_float, default=None,
                   help="GB left to macOS after raising iogpu.wired_limit_mb (default: the "
                        "catalog's 8, the low end of the 8-16 GB a public devnote advises)")
    p.add_argument("--bandwidth-efficiency", type=_fraction, default=None,
                   help="achievable fraction of peak bandwidth in decode (default: fitted on "
                        "published MLX measurements for this weight format, `batchsim fit-macs`)")
    p.add_argument("--compute-efficiency", type=_fraction, default=None,
                   help="achievable fraction of peak FLOP/s (default: fitted on published MLX "
                        "prompt rates)")
    p.add_argument("--explain", action="store_true",
                   help="also print the predicted decode step's parts in ms (weights, matmul, "
                        "attention, elementwise, fixed, overhead, per-row and host work) at "
                        "batch 1 and at the max batch; the JSON rows gain parts (the max-batch "
                        "step's seconds by name) and parts_b1 (batch 1's)")
    add_engine_argument(p)
    _add_spec_args(p)
    c = p.add_argument_group("cluster (tensor- or pipeline-parallel across Macs)")
    c.add_argument("--macs", type=positive_int, default=1,
                   help="N Macs of each row's kind and memory: weights split across them, KV "
                        "budget per Mac, the link's time in every step (server/perf/cluster.py)")
    c.add_argument("--link", default="tb5-rdma",
                   help="link between the Macs (configs/links.yaml: tb5-rdma, tb5, tb4, 10gbe, "
                        "loopback)")
    c.add_argument("--parallel", choices=["tensor", "pipeline"], default="tensor",
                   help="tensor: mlx-lm's shard(), every layer split, 2 all-reduces per layer; "
                        "pipeline: layers split, one batch passes the Macs in turn")
    p.add_argument("--out", type=Path, default=Path("results"),
                   help="directory for size.jsonl and the PNG")


def _add_spec_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("speculative decoding (server/perf/spec_price.py)")
    g.add_argument("--spec-tokens", type=bounded(int, 1, MAX_SPEC_TOKENS), default=None,
                   metavar="K", help="K drafted tokens a row verifies per step: rows gain "
                   "decode_tok_s_b1_spec and spec_break_even_batch (the batch from which plain "
                   "decoding is as fast); needs --acceptance or --acceptance-from")
    g.add_argument("--draft-model", default=None, metavar="M",
                   help="the drafter is model M (zoo name), priced as K decode forwards of M at "
                   "the step's rows on the same Mac and engine (default: the n-gram drafter, "
                   "priced as its host time per row)")
    add_acceptance_args(g)


def add_engine_argument(p: argparse.ArgumentParser | argparse._ArgumentGroup) -> None:
    """--engine NAME: the serving engine a prediction prices (configs/engines)."""
    p.add_argument("--engine", default=DEFAULT_ENGINE,
                   help=f"{engine_help()} [default: {DEFAULT_ENGINE}, this project's own]")


_fraction = bounded(float, 0, 1, lo_open=True)


def run(args: argparse.Namespace) -> dict:
    spec = spec_for(args.model)
    catalog = macs.load_catalog()
    ws = catalog.metal_working_set
    chosen = catalog.select(args.mac)
    ctx = context_fit(args.context_dist or str(args.context), spec.max_context,
                      args.fit_quantile, args.seed, shared_prefix_tokens=args.shared_prefix)
    meta = _meta(args, spec, catalog, ctx)
    acceptance = acceptance_of(args)
    if (args.spec_tokens is None) != (acceptance is None):
        raise ConfigError("--spec-tokens and --acceptance (or --acceptance-from) go together")
    s = Settings(args.dtype, args.quantize, args.bandwidth_efficiency, args.compute_efficiency,
                 meta["os_reserve_gb"], args.kv_bits, fit=load_fit(),
                 engine=load_engine(args.engine), spec_tokens=args.spec_tokens or 0,
                 acceptance=acceptance, draft=_draft_spec(args, spec))
    meta.update({"spec_tokens": args.spec_tokens,
                 "acceptance": list(acceptance.rates) if acceptance else None,
                 "acceptance_curve": acceptance.curve if acceptance else None,
                 "draft_share": acceptance.draft_share if acceptance else None,
                 "drafter": (args.draft_model or "ngram") if acceptance else None})
    cluster = _cluster(args)
    meta.update(_cluster_meta(cluster))
    rows = [mac_row(spec, m, gb, ctx, s, ws, explain=args.explain, cluster=cluster)
            for m in chosen for gb in ([args.memory_gb] if args.memory_gb else m.mem_gb)]
    _print(rows, meta, spec)
    if args.explain:
        _print_parts(rows, meta)
    tag = f"{spec.name}-{f'q{args.quantize}' if args.quantize else args.dtype}"
    tag += f"-kv{args.kv_bits}" if args.kv_bits else ""
    tag += f"-x{args.macs}-{args.link}-{args.parallel}" if cluster else ""
    stamp = timestamp()
    jsonl = append_jsonl(args.out / "size.jsonl",
                         [{"kind": "size", "time": stamp, **meta, **r} for r in rows])
    png = _plot(rows, meta, args.out / f"size-{tag}-{stamp}.png")
    out.print(f"rows appended to {jsonl}; plot {png}")
    return {"rows": rows, **meta, "fits_any": any(r["fits"] for r in rows),
            "fits_any_raised": any(r["fits_raised"] for r in rows),
            "jsonl": str(jsonl), "png": str(png)}


def _draft_spec(args: argparse.Namespace, spec: ModelSpec) -> ModelSpec | None:
    """--draft-model's shapes, checked as a run checks them (None: n-gram)."""
    if args.draft_model is not None and args.spec_tokens is None:
        raise ConfigError("--draft-model needs --spec-tokens K")
    draft = spec_for(args.draft_model) if args.draft_model else None
    return check_speculation(spec, draft) if args.spec_tokens is not None else draft


def _cluster(args: argparse.Namespace) -> Cluster | None:
    return Cluster(args.macs, resolve_link(args.link), args.parallel) if args.macs > 1 else None


def _cluster_meta(cluster: Cluster | None) -> dict:
    if cluster is None:
        return {"macs": 1}
    link = cluster.link
    return {"macs": cluster.ranks, "parallel": cluster.parallel, "link": link.key,
            "link_name": link.name, "link_bandwidth_gbs": link.bandwidth_gbs,
            "link_latency_us": link.latency_us, "link_topology": link.topology,
            "link_source": link.source}


def _meta(args: argparse.Namespace, spec: ModelSpec, catalog: macs.Catalog,
          ctx: ContextFit) -> dict:
    """Run-level settings, each with where it comes from (flags override the catalog)."""
    ws, fit, engine = catalog.metal_working_set, load_fit(), load_engine(args.engine)
    bw_eff, bw_src = fit.bandwidth_efficiency[fit_format(args.quantize)], fit.fitted_on
    cmp_eff, cmp_src = fit.compute_efficiency, fit.compute_fitted_on
    if args.bandwidth_efficiency is not None:
        bw_eff, bw_src = args.bandwidth_efficiency, "--bandwidth-efficiency"
    if args.compute_efficiency is not None:
        cmp_eff, cmp_src = args.compute_efficiency, "--compute-efficiency"
    return {
        "model": spec.name, "dtype": args.dtype, "quantize_bits": args.quantize,
        "kv_bits": args.kv_bits, "engine": engine.name, "engine_source": engine.source,
        "context": ctx.label, "context_fixed": ctx.fixed, "context_mean_tokens": ctx.mean_tokens,
        "fit_quantile": ctx.quantile, "fit_trials": ctx.trials, "seed": args.seed,
        "shared_prefix_tokens": ctx.shared_prefix_tokens,
        "max_batch_cap": MAX_BATCH_CAP, "kv_step_tokens": KV_STEP, "page_tokens": PAGE_TOKENS,
        "os_reserve_gb": ws.os_reserve_gb if args.os_reserve_gb is None else args.os_reserve_gb,
        "working_set_rule": ws.default_rule_of_thumb,
        "bandwidth_efficiency": bw_eff, "bandwidth_efficiency_source": bw_src,
        "compute_efficiency": cmp_eff, "compute_efficiency_source": cmp_src,
        "profile_terms": fit.summary(), "profile_errors": fit.errors,
        "max_batch_is": "padded layout (mlx-lm BatchKVCache, batchsim's executor), default limit",
        "decode_tok_s_context": "the simulator's pure-decode step, each row reading the mean "
                                "context; batch = max_batch",
    }


def _print(rows: list[dict], meta: dict, spec: ModelSpec) -> None:
    what = f"{spec.name} {_weights_tag(meta)}, engine {meta['engine']}, context {meta['context']}"
    cols, body = _columns(rows)
    if not spec.is_dense:  # where the per-sequence bytes come from
        cols.insert(6, "KV full/win/state MiB")
        for line, r in zip(body, rows):
            line.insert(6, "/".join(f"{v / (1 << 20):.4g}" for v in r["kv_per_seq"].values()))
    if meta["shared_prefix_tokens"]:  # beside the padded/paged limits
        at = cols.index("raised padded/paged") + 1
        cols.insert(at, "shared dflt/raised")
        for line, r in zip(body, rows):
            line.insert(at, f"{r['max_batch_shared']} / {r['max_batch_shared_raised']}")
    if meta["spec_tokens"]:  # speculation's speed-up at batch 1 and where it stops paying
        cols += [f"K={meta['spec_tokens']} x b1", "spec stops at"]
        for line, r in zip(body, rows):
            b1, plain = r.get("decode_tok_s_b1_spec"), r["decode_tok_s_b1"]
            line += [b1 / plain if b1 and plain else None, _stops(r) if b1 and plain else None]
    out.print(table(
        f"Batch limits per Mac: {what} (padded = rows padded to the longest in {KV_STEP}-token "
        f"steps; paged = {PAGE_TOKENS}-token blocks)", cols, body,
        keep=["chip", "mem GB", "max batch padded/paged", "tok/s b1", "tok/s @max", "fits"]))
    for line in _notes(rows, meta, what, spec):
        out.print(line)


def _stops(row: dict) -> int | str | None:
    """The 'spec stops at' cell: the batch, or "> N" where it pays up to the max batch N."""
    every = row.get("spec_break_even") == "pays_at_every_batch"
    return f"> {row['max_batch']}" if every else row.get("spec_break_even_batch")


def _columns(rows: list[dict]) -> tuple[list[str], list[list]]:
    return (
        ["chip", "GPU", "mem GB", "usable GiB dflt/raised", "weights GiB", "KV/seq MiB",
         "max batch padded/paged", "raised padded/paged", "tok/s b1", "tok/s @max", "fits"],
        [[r["chip"], r["gpu_cores"], r["memory_gb"],
          f"{fmt(gib(r['usable_bytes']))} / {fmt(gib(r['usable_bytes_raised']))}",
          gib(r["weight_bytes"]), r["kv_bytes_per_seq"] / (1 << 20),
          f"{r['max_batch_padded']} / {r['max_batch_paged']}",
          f"{r['max_batch_padded_raised']} / {r['max_batch_paged_raised']}",
          _tok(r, "decode_tok_s_b1"), _tok(r, "decode_tok_s_max_batch"),
          "yes" if r["fits"] else ("raised" if r["fits_raised"] else "no")] for r in rows],
    )


def _notes(rows: list[dict], meta: dict, what: str, spec: ModelSpec) -> list[str]:
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
    if meta["shared_prefix_tokens"]:
        notes.append(f"Shared: paged, every sequence's first {meta['shared_prefix_tokens']} tokens "
                     f"the same prompt, its whole {PAGE_TOKENS}-token blocks stored once (a prefix "
                     f"cache's reuse; sliding-window and linear-attention state never shared).")
    engine = load_engine(meta["engine"])
    notes.append(f"Engine {engine.name} (configs/engines/{engine.name}.yaml): host "
                 f"{engine.host_step_us:g} us per step + {engine.host_token_us:g} us per token"
                 + engine.batching_note()
                 + (f" ({engine.host_basis})" if engine.host_basis else "") + ".")
    if not spec.is_dense:
        notes.append(f"{'+'.join(spec.families)}: KV/seq is mlx-lm's exact cache of one sequence "
                     f"at the mean context, by kind (full-attention/MLA KV grows with it, sliding "
                     f"layers' KV is capped at their window, linear-attention state is fixed); "
                     f"padded max batch = budget over B x that at the longest. MoE decode reads "
                     f"the expected distinct experts under uniform routing (an upper bound).")
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
        notes.append(f"[bold red]{what} fits no Mac here at the default Metal limit[/bold red]"
                     + (f"; with iogpu.wired_limit_mb raised: {', '.join(raised)}." if raised
                        else ", nor with iogpu.wired_limit_mb raised."))
    return notes


PARTS = tuple(f.name for f in dataclasses.fields(StepTime)) + ("total_s",)


def _print_parts(rows: list[dict], meta: dict) -> None:
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
                    f"{meta['context_mean_tokens']:.0f} tokens read per row)", cols, body))
    out.print("weights: linear layers streaming their weights; matmul: their arithmetic (a "
              "Mac's one-row step: the larger of the two; several rows: both); attention: K/V "
              "reads; draft: the drafter (a draft model's K forwards, else n-gram lookups; row "
              "'1, K=k': a verify step at batch 1, tok/s with its acceptance); "
              "elementwise: norms, activations, logits; fixed: per layer and forward pass (a Mac's "
              "fitted kernel dispatch and sync); step overhead: per engine step (zero on a catalog "
              "Mac); copy: KV pool copies (none in steady decode); experts: MoE routed experts "
              "(the distinct experts the batch routes to); attention rows: attention's fixed cost "
              "per row; token ops: elementwise kernels' per token; sampling: per row; host step / "
              f"host token: the engine's ({meta['engine']}) host work. Zero parts are not shown.")


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


def _plot(rows: list[dict], meta: dict, path: Path) -> Path:
    """Max batch (padded vs paged) and predicted tok/s (batch 1 vs max batch) per Mac config."""
    plt, y = pyplot(), np.arange(len(rows))
    fig, (ax_b, ax_t) = plt.subplots(1, 2, figsize=(12, 1.5 + 0.18 * len(rows)), sharey=True)
    bars = [
        (ax_b, "max_batch_padded", f"padded ({KV_STEP}-token steps)", -0.2),
        (ax_b, "max_batch_paged", f"paged ({PAGE_TOKENS}-token blocks)", 0.2),
        (ax_t, "decode_tok_s_b1", "batch 1", -0.2),
        (ax_t, "decode_tok_s_max_batch", "max batch (padded)", 0.2),
    ]
    for ax, key, label, dy in bars:
        ax.barh(y + dy, [r[key] or 0 for r in rows], 0.4, label=label)
    for ax in (ax_b, ax_t):  # the x axes run 60% past the bars: room for the legends
        ax.set_xlim(0, 1.6 * ax.get_xlim()[1])
        ax.legend(loc="lower right", fontsize=8)
    ax_b.set_xlabel("max concurrent sequences (default Metal limit)")
    ax_t.set_xlabel("predicted decode tok/s (the simulator's step cost; * peak FLOP/s estimated)")
    ax_b.set_yticks(y, [f"{r['label']} {r['memory_gb']:g}GB{'*' if r['peaks_estimated'] else ''}"
                        for r in rows], fontsize=7)
    ax_b.invert_yaxis()
    fig.suptitle(f"{meta['model']} {_weights_tag(meta)}, engine {meta['engine']}, context "
                 f"{meta['context']}: predicted per Mac (no model run)")
    return save_figure(fig, path)
