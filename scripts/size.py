"""`batchsim size`: per Mac and memory size, how much memory the GPU may use, how many sequences fit
before the KV cache overruns it (padded vs paged layout), and the decode tok/s the simulator's
performance model predicts. The arithmetic lives in server.perf.size_limits, the table and the
plot in size_view; here the flags and the run. No model runs and no MLX."""

from __future__ import annotations

import argparse
from pathlib import Path

from batchsim.configs import ConfigError
from batchsim.scheduler.config import MAX_SPEC_TOKENS
from batchsim.scheduler.pool_geometry import KV_STEP, PAGE_TOKENS
from batchsim.scripts.common import (
    add_field_argument,
    append_jsonl,
    bounded,
    non_negative_float,
    non_negative_int,
    out,
    positive_float,
    positive_int,
    seed_int,
    timestamp,
)
from batchsim.scripts.size_view import plot, print_parts, print_table
from batchsim.scripts.spec_args import acceptance_of, add_acceptance_args
from batchsim.server.models.loader import ModelRef, spec_for
from batchsim.server.models.spec import FLOAT_DTYPES, KV_BITS, QUANT_BITS, ModelSpec, zoo_names
from batchsim.server.perf import macs
from batchsim.server.perf.cluster import Cluster, resolve_link
from batchsim.server.perf.engines import DEFAULT_ENGINE, engine_help, load_engine
from batchsim.server.perf.gpu_fit import fit_format, load_fit
from batchsim.server.perf.size_limits import (
    FIT_TRIALS,
    MAX_BATCH_CAP,
    ContextFit,
    Settings,
    context_fit,
    mac_row,
)
from batchsim.server.perf.spec_price import check_speculation, draft_spec
from batchsim.server.platform.signals import stop_if_swallowed


def add_parser(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default="llama-3.1-8b",
                   help=f"zoo model ({', '.join(zoo_names())}), a model directory, or a hub id")
    p.add_argument("--dtype", default="float16", choices=list(FLOAT_DTYPES), help="weights dtype")
    p.add_argument("--quantize", type=int, choices=list(QUANT_BITS), default=None,
                   help="mlx-lm affine quantization (group 64) to 4 or 8 bits (default: "
                        "unquantized, in --dtype)")
    add_field_argument(p, Settings, "kv_bits", "K/V held as mlx-lm's QuantizedKVCache at 4 or 8 "
                       "bits (group 64; scales and biases in the compute dtype; default: K/V in "
                       "--dtype)",
                       choices=list(KV_BITS), unset=False)
    ctx = p.add_mutually_exclusive_group()
    ctx.add_argument("--context", type=positive_int, default=4096,
                     help="fixed tokens per sequence")
    ctx.add_argument("--context-dist", default=None,
                     help="tokens per sequence as a distribution, e.g. lognormal:2000:1500:8192 "
                          "(any form --input-len takes; default: every sequence --context tokens)")
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
                   help="this RAM size (GB as Apple sells it, i.e. GiB) instead of the catalog's "
                        "(default: every size the catalog lists)")
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
    _add_cluster_args(p)
    p.add_argument("--out", type=Path, default=Path("results"),
                   help="directory for size.jsonl and the PNG")


def _add_cluster_args(p: argparse.ArgumentParser) -> None:
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


def _add_spec_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("speculative decoding (server/perf/spec_price.py)")
    g.add_argument("--spec-tokens", type=bounded(int, 1, MAX_SPEC_TOKENS), default=None,
                   metavar="K", help="K drafted tokens a row verifies per step: rows gain "
                   "decode_tok_s_b1_spec and spec_break_even_batch (the batch from which plain "
                   "decoding is as fast); needs --acceptance or --acceptance-from (default: off)")
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
    stop_if_swallowed()  # a Ctrl-C Python swallowed so far: nothing printed or written
    print_table(rows, meta, spec)
    if args.explain:
        print_parts(rows, meta)
    tag = f"{spec.name}-{f'q{args.quantize}' if args.quantize else args.dtype}"
    tag += f"-kv{args.kv_bits}" if args.kv_bits else ""
    tag += f"-x{args.macs}-{args.link}-{args.parallel}" if cluster else ""
    stamp = timestamp()
    jsonl = append_jsonl(args.out / "size.jsonl",
                         [{"kind": "size", "time": stamp, **meta, **r} for r in rows])
    png = plot(rows, meta, args.out / f"size-{tag}-{stamp}.png")
    out.print(f"rows appended to {jsonl}; plot {png}", markup=False)
    return {"rows": rows, **meta, "fits_any": any(r["fits"] for r in rows),
            "fits_any_raised": any(r["fits_raised"] for r in rows),
            "jsonl": str(jsonl), "png": str(png)}


def _draft_spec(args: argparse.Namespace, spec: ModelSpec) -> ModelSpec | None:
    """--draft-model's shapes, checked as a run checks them (spec_price.draft_spec: a stored
    draft's format too) against the target in the format this table prices (None: n-gram)."""
    if args.draft_model is not None and args.spec_tokens is None:
        raise ConfigError("--draft-model needs --spec-tokens K")
    if args.spec_tokens is None:
        return None
    cfg = argparse.Namespace(spec_method="draft" if args.draft_model else "none",
                             draft_model=args.draft_model, kv_bits=args.kv_bits)
    target = ModelRef(spec.name, Path(), spec, args.dtype, args.quantize)
    return check_speculation(spec, draft_spec(cfg, target))


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
                                "context; batch = max_batch (best_batch: the batch up to it with "
                                "the most tok/s)",
    }
