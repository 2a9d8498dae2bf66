"""N-gram speculative decoding against plain decoding on real weights: the chat prompts, greedy
or sampled (--temperature: the rejection rule), all requests queued at once, at each batch limit
and K, the runs of one batch limit interleaved (none, then each K, then again) so drift hits every
mode alike.

    .venv/bin/python benchmarks/spec_decode.py --batch 1,8,32 --spec-tokens 2,4,8 --reps 1
    .venv/bin/python benchmarks/spec_decode.py --batch 1,8 --spec-tokens 2,4 --temperature 0.8

Each run is `batchsim run` in-process (the same engine, records and summary); the table reports
acceptance (vLLM's keys), output tok/s and mean TPOT, each mode's median over --reps, and the
ratio to `none` at the same batch limit, with the 1-minute load average after each run. Not part
of the test suite; the last stdout line is one JSON document."""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import statistics
import sys
import tempfile
from pathlib import Path

KEYS = ("output_throughput", "mean_tpot_ms", "spec_decode_acceptance_rate",
        "spec_decode_acceptance_length", "num_steps", "output_tokens_sha256")


def workload_yaml(path: Path, num_prompts: int, max_tokens: int, temperature: float) -> Path:
    path.write_text(f"name: chat\nnum_prompts: {num_prompts}\narrival: poisson\n"
                    f"request_rate: inf\nchat:\n  prompts: chat.yaml\n"
                    f"  temperature: {temperature}\n"
                    f"  max_tokens: {max_tokens}\nseed: 0\n")
    return path


def run_once(workload: Path, out: Path, batch: int, k: int, policy: str, model: str) -> dict:
    from batchsim.scripts.cli import main

    argv = ["run", str(workload), "--model", model, "--max-num-seqs", str(batch),
            "--out", str(out), "--no-progress", "--no-timeline"]
    if k:
        argv += ["--spec-method", "ngram", "--spec-tokens", str(k), "--spec-policy", policy]
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        rc = main(argv)
    if rc != 0:
        raise SystemExit(f"batchsim {' '.join(argv)} exited {rc}")
    return json.loads(buf.getvalue().strip().splitlines()[-1])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--batch", default="1,8,32", help="batch limits (max_num_seqs)")
    p.add_argument("--spec-tokens", default="2,4,8", help="K values beside none")
    p.add_argument("--policy", default="fixed", choices=["fixed", "shrink"])
    p.add_argument("--reps", type=int, default=1, help="interleaved repetitions")
    p.add_argument("--prompts-per-row", type=int, default=1,
                   help="requests = max(4, this x batch limit)")
    p.add_argument("--max-tokens", type=int, default=96)
    p.add_argument("--model", default="smollm2-135m-instruct")
    p.add_argument("--temperature", type=float, default=0.0,
                   help="> 0: sampled rows (rejection sampling); tokens then differ from none")
    args = p.parse_args()
    ks = [0, *(int(x) for x in args.spec_tokens.split(","))]
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for b in (int(x) for x in args.batch.split(",")):
            wl = workload_yaml(Path(tmp) / f"chat-{b}.yaml", max(4, args.prompts_per_row * b),
                               args.max_tokens, args.temperature)
            runs: dict[int, list[dict]] = {k: [] for k in ks}
            for rep in range(args.reps):
                for k in ks:
                    s = run_once(wl, Path(tmp) / "runs", b, k, args.policy, args.model)
                    s["loadavg_1m"] = os.getloadavg()[0]
                    runs[k].append(s)
                    print(f"batch {b:3d} K {k} rep {rep + 1}: {s['output_throughput']:.1f} tok/s, "
                          f"TPOT {s['mean_tpot_ms']:.1f} ms, acceptance "
                          f"{s.get('spec_decode_acceptance_rate', 0):.1f}%, load "
                          f"{s['loadavg_1m']:.1f}", file=sys.stderr)
            rows += _rows(b, runs, args)
    env = s["env"]
    _print(rows, env, args.temperature)
    print(json.dumps({"rows": rows, "env": env}))


def _rows(b: int, runs: dict[int, list[dict]], args: argparse.Namespace) -> list[dict]:
    out = []
    for k, summaries in runs.items():
        row = {"batch_limit": b, "spec_tokens": k, "policy": args.policy if k else "none",
               "num_requests": summaries[0]["completed"], "reps": len(summaries)}
        for key in (*KEYS[:-1], "loadavg_1m"):
            vals = [s.get(key, 0.0) for s in summaries]
            row[key] = statistics.median(vals)
        row["same_tokens_as_none"] = all(s["output_tokens_sha256"] ==
                                         runs[0][0]["output_tokens_sha256"] for s in summaries)
        out.append(row)
    base = out[0]
    for row in out:
        row["tok_s_vs_none"] = row["output_throughput"] / base["output_throughput"]
    return out


def _print(rows: list[dict], env: dict, temperature: float) -> None:
    mode = f"temperature {temperature}" if temperature else "greedy"
    print(f"n-gram speculation, chat prompts, {mode} ({env.get('backend')}, "
          f"{env.get('cores')} cores, shared machine)")
    print("batch  K  reqs  accept%  accept_len  steps  tok/s   x none  TPOT ms  load  same tokens")
    for r in rows:
        print(f"{r['batch_limit']:5d} {r['spec_tokens']:2d} {r['num_requests']:5d} "
              f"{r['spec_decode_acceptance_rate']:7.1f} {r['spec_decode_acceptance_length']:10.2f} "
              f"{r['num_steps']:6.0f} {r['output_throughput']:6.1f} {r['tok_s_vs_none']:7.2f} "
              f"{r['mean_tpot_ms']:8.1f} {r['loadavg_1m']:5.1f}  {r['same_tokens_as_none']}")


if __name__ == "__main__":
    main()
