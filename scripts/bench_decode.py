"""`batchsim bench-decode`: decode tokens/s per batch size for a bare model loop, batchsim's
executor and mlx-lm's BatchGenerator, interleaved in one run (this machine is noisy), medians of
several repetitions, with the batched/batch-1 and executor/bare ratios."""

from __future__ import annotations

import argparse
from pathlib import Path

from batchsim.scheduler.config import SchedulerSettings
from batchsim.scripts.common import (
    DTYPE_HELP,
    MAX_BATCH,
    QUANTIZE_HELP,
    add_field_argument,
    append_jsonl,
    err,
    ints_up_to,
    median,
    out,
    positive_int,
    str_list,
    table,
)
from batchsim.scripts.spec_args import add_spec_args, spec_overrides
from batchsim.server.engine.run_config import DTYPES, RunConfig
from batchsim.server.models.spec import QUANT_BITS

MODES = ("bare", "executor", "executor_paged", "mlx_lm")
DEFAULT_MODES = ("bare", "executor", "mlx_lm")


def add_parser(p: argparse.ArgumentParser) -> None:
    add_field_argument(p, RunConfig, "model", "zoo name, model directory or hub id", unset=False)
    add_field_argument(p, RunConfig, "dtype", DTYPE_HELP, choices=list(DTYPES), unset=False)
    add_field_argument(p, RunConfig, "quantize", QUANTIZE_HELP, choices=list(QUANT_BITS),
                       unset=False)
    p.add_argument("--batch", type=ints_up_to(MAX_BATCH),
                   default=[1, 2, 4, 8, 16, 32, 64], help="batch sizes")
    p.add_argument("--context", type=positive_int, default=128, help="prompt tokens per sequence")
    p.add_argument("--steps", type=positive_int, default=8, help="decode steps per timed window")
    p.add_argument("--reps", type=positive_int, default=5,
                   help="timed windows per mode, interleaved "
                   "across modes (median reported); the context grows by steps x reps")
    p.add_argument("--modes", type=str_list, default=list(DEFAULT_MODES),
                   help="subset of bare,executor,executor_paged,mlx_lm (executor_paged: "
                   "--kv-layout paged)")
    p.add_argument("--continuous", type=ints_up_to(MAX_BATCH), default=[], metavar="B,B",
                   help="also compare continuous batching at these batch limits: 4 x B requests "
                   "with 16-64 output tokens, all queued at once, executor vs mlx-lm (joins and "
                   "leaves are where mlx-lm's BatchGenerator copies its whole cache; default: "
                   "none)")
    p.add_argument("--out", default="results", help="directory for bench-decode.jsonl")
    add_spec_args(p, simulated=False).description = (
        "the executor's --continuous runs only (greedy; these prompts are random tokens, where "
        "n-gram drafts rarely match: `run` with the chat workload measures acceptance)")


def run(args: argparse.Namespace) -> dict:
    from batchsim.configs import ConfigError
    from batchsim.server.engine.session import open_session
    from batchsim.server.measure import decode_bench as db

    bad = [m for m in args.modes if m not in MODES]
    if bad:
        raise ConfigError(f"--modes: {bad[0]!r} is not allowed; allowed: {', '.join(MODES)}")
    session = open_session(_config(args))
    longest = args.context + args.steps * (args.reps + 1)
    if longest > session.spec.max_context:
        raise ConfigError(f"--context {args.context} + --steps x --reps grows to {longest} tokens, "
                          f"beyond the model's context of {session.spec.max_context}")
    model, vocab, kvt = session.model, session.spec.vocab_size, session.kv_bytes_per_token
    layout = session.cache_layout  # None: dense; else what the family pool holds, by layer kind
    makers = {
        "bare": lambda b: db.Bare(model, b, args.context, vocab),
        "executor": lambda b: db.Executor(model, b, args.context, vocab, kvt, layout),
        "executor_paged": lambda b: db.Executor(model, b, args.context, vocab, kvt, layout,
                                                kv_layout="paged"),
        "mlx_lm": lambda b: db.MlxLmBatchGenerator(model, b, args.context, vocab),
    }
    samples: dict[tuple[int, str], list[float]] = {}
    for b in args.batch:
        runners = {}
        for mode in args.modes:  # each prefills its batch once
            err.print(f"batch {b:3d}: preparing {mode}")
            runners[mode] = makers[mode](b)
        for rep in range(args.reps):
            for mode in args.modes:  # interleaved windows: drift hits every mode alike
                tok_s = b * args.steps / runners[mode].steps(args.steps)
                samples.setdefault((b, mode), []).append(tok_s)
                err.print(f"batch {b:3d} rep {rep + 1}/{args.reps} {mode:8s} {tok_s:8.1f} tok/s")
        for r in runners.values():
            getattr(r, "close", lambda: None)()
        del runners
    drafter = getattr(session.executor, "drafter", None)
    continuous = _continuous(args, model, vocab, kvt, layout, drafter) if args.continuous else []
    env = session.environment()
    rows = []
    for (b, mode), vals in samples.items():
        rows.append({"batch": b, "mode": mode, "decode_tok_s": median(vals), "samples_tok_s": vals,
                     "context": args.context, "steps": args.steps, "reps": args.reps,
                     "dtype": session.dtype, "model": session.ref.name})
    _add_ratios(rows)
    _print(rows, args.modes, session)
    path = append_jsonl(Path(args.out) / "bench-decode.jsonl", ({**r, "env": env} for r in rows))
    if continuous:
        append_jsonl(path, ({**r, "kind": "continuous", "env": env} for r in continuous))
        out.print(table("Continuous batching: generated tok/s (prefill included), same requests",
                        ["batch", "requests", "executor tok/s", "mlx_lm tok/s", "executor/mlx_lm"],
                        [[r["batch"], r["requests"], r["executor_tok_s"], r["mlx_lm_tok_s"],
                          r["executor_tok_s"] / r["mlx_lm_tok_s"]] for r in continuous]))
    out.print(f"appended {len(rows) + len(continuous)} rows to {path}", markup=False)
    return {"rows": rows, "continuous": continuous, "env": env}


def _continuous(args: argparse.Namespace, model, vocab: int, kvt: int, layout=None,
                drafter=None) -> list[dict]:
    from batchsim.server.measure import decode_bench as db

    spec = (drafter, args.spec_tokens, args.spec_policy or "shrink") if drafter else None

    results = []
    for b in args.continuous:
        lens = db.continuous_lengths(4 * b)
        samples = {"executor": [], "mlx_lm": []}
        for rep in range(max(1, args.reps // 2)):
            for mode, rates in samples.items():  # alternate, as above
                if mode == "executor":
                    n, secs = db.continuous_executor(model, b, args.context, vocab, kvt, lens,
                                                     layout, spec)
                else:
                    n, secs = db.continuous_mlx_lm(model, b, args.context, vocab, lens)
                rates.append(n / secs)
                err.print(f"continuous batch {b:3d} rep {rep + 1} {mode:8s} {n / secs:8.1f} tok/s")
        results.append({"batch": b, "requests": len(lens), "context": args.context,
                        "executor_tok_s": median(samples["executor"]),
                        "mlx_lm_tok_s": median(samples["mlx_lm"]), "samples_tok_s": samples,
                        "spec_method": args.spec_method or "none",
                        "spec_tokens": args.spec_tokens or 0})
    return results


def _config(args: argparse.Namespace) -> RunConfig:
    """The model and speculative decoding flags as a RunConfig (its rules on their combinations)."""
    from batchsim.configs import ConfigError

    if args.spec_method not in (None, "none") and not args.continuous:
        raise ConfigError("--spec-method applies to the executor's --continuous runs; add "
                          "--continuous B")
    spec = {k: v for k, v in spec_overrides(args).items() if v is not None}
    sched = {k.split(".", 1)[1]: spec.pop(k) for k in list(spec) if k.startswith("scheduler.")}
    try:
        return RunConfig(model=args.model, dtype=args.dtype, quantize=args.quantize,
                         scheduler=SchedulerSettings(**sched), **spec)
    except ValueError as exc:
        raise ConfigError(str(exc)) from None


def _add_ratios(rows: list[dict]) -> None:
    """Ratios of the medians, and `_paired`: the median of the window-by-window ratios (each
    window against the other mode's window of the same repetition, timed right beside it), which
    a machine drifting between repetitions bends less."""
    by = {(r["batch"], r["mode"]): r for r in rows}
    batches = sorted({r["batch"] for r in rows})
    for r in rows:
        base = by.get((batches[0], r["mode"]))
        speedup = r["decode_tok_s"] / base["decode_tok_s"] if base else None
        r[f"speedup_vs_batch_{batches[0]}"] = speedup
        for other in ("bare", "mlx_lm", "executor"):
            o = by.get((r["batch"], other))
            r[f"vs_{other}"] = r["decode_tok_s"] / o["decode_tok_s"] if o else None
            r[f"vs_{other}_paired"] = median([a / b for a, b in zip(
                r["samples_tok_s"], o["samples_tok_s"])]) if o else None


def _print(rows: list[dict], modes: list[str], session) -> None:
    by = {(r["batch"], r["mode"]): r for r in rows}
    b0 = min(r["batch"] for r in rows)
    cols = ["batch"] + [f"{m} tok/s" for m in modes] + [f"{m} x b{b0}" for m in modes]
    others = [m for m in ("bare", "mlx_lm") if "executor" in modes and m in modes]
    cols += [f"executor / {m}{kind}" for m in others for kind in ("", " paired")]
    paged = "executor_paged" in modes and "executor" in modes
    cols += ["paged / padded", "paged / padded paired"] if paged else []
    body = []
    for b in sorted({r["batch"] for r in rows}):
        line = [b] + [by[(b, m)]["decode_tok_s"] for m in modes]
        line += [by[(b, m)][f"speedup_vs_batch_{b0}"] for m in modes]
        line += [by[(b, "executor")][f"vs_{m}{kind}"] for m in others for kind in ("", "_paired")]
        if paged:
            line += [by[(b, "executor_paged")][f"vs_executor{k}"] for k in ("", "_paired")]
        body.append(line)
    env = session.environment()
    out.print(table(
        f"Decode tok/s, {session.ref.name} {session.dtype} ({env['backend']}, BLAS {env['blas']}, "
        f"{env['cores']} cores)", cols, body))
