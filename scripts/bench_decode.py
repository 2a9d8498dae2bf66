"""`batchsim bench-decode`: decode tokens/s per batch size for a bare model loop, batchsim's
executor and mlx-lm's BatchGenerator, interleaved in one run (this machine is noisy), medians of
several repetitions, with the batched/batch-1 and executor/bare ratios."""

from __future__ import annotations

import argparse
from pathlib import Path

from scripts.common import append_jsonl, err, int_list, median, out, str_list, table

MODES = ("bare", "executor", "mlx_lm")


def add_parser(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default="smollm2-135m", help="zoo name, model directory or hub id")
    p.add_argument("--dtype", default="auto", choices=["auto", "float32", "float16", "bfloat16"])
    p.add_argument("--quantize", type=int, choices=[4, 8])
    p.add_argument("--batch", type=int_list, default=[1, 2, 4, 8, 16, 32, 64], help="batch sizes")
    p.add_argument("--context", type=int, default=128, help="prompt tokens per sequence")
    p.add_argument("--steps", type=int, default=16, help="timed decode steps per repetition")
    p.add_argument("--reps", type=int, default=3, help="repetitions (median reported)")
    p.add_argument("--modes", type=str_list, default=list(MODES), help="subset of bare,executor,mlx_lm")
    p.add_argument("--out", default="results", help="directory for bench-decode.jsonl")


def run(args: argparse.Namespace) -> dict:
    from configs import ConfigError
    from server import decode_bench as db
    from server.run_config import RunConfig
    from server.session import open_session

    bad = [m for m in args.modes if m not in MODES]
    if bad:
        raise ConfigError(f"--modes: {bad[0]!r} is not allowed; allowed: {', '.join(MODES)}")
    session = open_session(RunConfig(model=args.model, dtype=args.dtype, quantize=args.quantize))
    model, vocab, kvt = session.model, session.spec.vocab_size, session.kv_bytes_per_token
    runners = {
        "bare": lambda b: db.bare(model, b, args.context, args.steps, vocab),
        "executor": lambda b: db.executor(model, b, args.context, args.steps, vocab, kvt),
        "mlx_lm": lambda b: db.mlx_lm_batch_generator(model, b, args.context, args.steps, vocab),
    }
    samples: dict[tuple[int, str], list[float]] = {}
    for b in args.batch:
        for rep in range(args.reps):
            for mode in args.modes:  # interleaved: drift hits every mode alike
                tok_s = runners[mode](b)
                samples.setdefault((b, mode), []).append(tok_s)
                err.print(f"batch {b:3d} rep {rep + 1}/{args.reps} {mode:8s} {tok_s:8.1f} tok/s")
    env = session.environment()
    rows = []
    for (b, mode), vals in samples.items():
        rows.append({"batch": b, "mode": mode, "decode_tok_s": median(vals), "samples_tok_s": vals,
                     "context": args.context, "steps": args.steps, "reps": args.reps})
    _add_ratios(rows)
    _print(rows, args.modes, session)
    path = append_jsonl(Path(args.out) / "bench-decode.jsonl", ({**r, "env": env} for r in rows))
    out.print(f"appended {len(rows)} rows to {path}")
    return {"rows": rows, "env": env}


def _add_ratios(rows: list[dict]) -> None:
    by = {(r["batch"], r["mode"]): r["decode_tok_s"] for r in rows}
    batches = sorted({r["batch"] for r in rows})
    for r in rows:
        base = by.get((batches[0], r["mode"]))
        r["speedup_vs_batch_%d" % batches[0]] = r["decode_tok_s"] / base if base else None
        bare = by.get((r["batch"], "bare"))
        r["vs_bare"] = r["decode_tok_s"] / bare if bare else None
        mlx = by.get((r["batch"], "mlx_lm"))
        r["vs_mlx_lm"] = r["decode_tok_s"] / mlx if mlx else None


def _print(rows: list[dict], modes: list[str], session) -> None:
    by = {(r["batch"], r["mode"]): r for r in rows}
    b0 = min(r["batch"] for r in rows)
    cols = ["batch"] + [f"{m} tok/s" for m in modes] + [f"{m} x b{b0}" for m in modes]
    if "executor" in modes and "bare" in modes:
        cols.append("executor/bare")
    if "executor" in modes and "mlx_lm" in modes:
        cols.append("executor/mlx_lm")
    body = []
    for b in sorted({r["batch"] for r in rows}):
        line = [b] + [by[(b, m)]["decode_tok_s"] for m in modes]
        line += [by[(b, m)][f"speedup_vs_batch_{b0}"] for m in modes]
        if "executor/bare" in cols:
            line.append(by[(b, "executor")]["vs_bare"])
        if "executor/mlx_lm" in cols:
            line.append(by[(b, "executor")]["vs_mlx_lm"])
        body.append(line)
    env = session.environment()
    out.print(table(
        f"Decode tok/s, {session.ref.name} {session.dtype} ({env['backend']}, BLAS {env['blas']}, "
        f"{env['cores']} cores)", cols, body))
