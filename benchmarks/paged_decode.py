"""The paged KV layout against the padded one on a real model, interleaved in one process:
1. decode tok/s at fixed batch sizes (bench-decode's Executor, both layouts prefilled once, then
   timed windows alternating), by wall time and by this process's CPU time (MLX's CPU threads are
   this process's: on a machine shared with other jobs CPU time is bent less than wall time);
2. peak KV bytes of one mixed-length workload (all queued at once), each layout's own account,
   equal to its arrays at every step (asserted), and whether the tokens agree.

    .venv/bin/python benchmarks/paged_decode.py --model smollm2-135m-instruct --batch 1,8,32

Not part of the test suite; the last stdout line is one JSON document."""

from __future__ import annotations

import argparse
import json
import statistics
import time

from batchsim.server.platform import blas

blas.preload()  # before the first `import mlx`, as the CLI does

import numpy as np
from batchsim.scheduler.config import SchedulerConfig
from batchsim.scheduler.request import Request, SamplingParams
from batchsim.scheduler.scheduler import Scheduler
from batchsim.server.engine.run_config import RunConfig
from batchsim.server.engine.session import open_session
from batchsim.server.executors.mlx_executor import MLXExecutor
from batchsim.server.measure import decode_bench as db

LAYOUTS = ("padded", "paged")


def _window(runner, steps: int) -> tuple[float, float]:
    c0 = time.process_time()
    wall = runner.steps(steps)
    return wall, time.process_time() - c0


def decode_rows(session, batches: list[int], context: int, steps: int, windows: int) -> list:
    model, vocab = session.model, session.spec.vocab_size
    rows = []
    for b in batches:
        runners = {k: db.Executor(model, b, context, vocab, session.kv_bytes_per_token,
                                  session.cache_layout, kv_layout=k) for k in LAYOUTS}
        t: dict[str, list[tuple[float, float]]] = {k: [] for k in LAYOUTS}
        for _ in range(windows):
            for k in LAYOUTS:
                t[k].append(_window(runners[k], steps))
        row = {"batch": b, "context": context, "steps": steps, "windows": windows}
        for k in LAYOUTS:
            row[f"{k}_tok_s"] = b * steps / statistics.median(w for w, _ in t[k])
            row[f"{k}_tok_per_cpu_s"] = b * steps / statistics.median(c for _, c in t[k])
        for i, name in ((0, "wall"), (1, "cpu")):
            row[f"paged_over_padded_{name}_paired"] = statistics.median(
                a[i] and p[i] / a[i] for p, a in zip(t["padded"], t["paged"]))
        rows.append(row)
        print(f"batch {b:3d}: padded {row['padded_tok_s']:.1f} tok/s, paged "
              f"{row['paged_tok_s']:.1f} tok/s; paged/padded paired: wall "
              f"{row['paged_over_padded_wall_paired']:.3f}, cpu "
              f"{row['paged_over_padded_cpu_paired']:.3f}", flush=True)
        del runners
    return rows


def peak_kv(session, layout: str, batch: int, lengths: list[tuple[int, int]]) -> dict:
    """One workload of (prompt, output) lengths, all queued at once, at most `batch` running."""
    sched = Scheduler(SchedulerConfig(
        kv_budget_bytes=1 << 50, kv_bytes_per_token=session.kv_bytes_per_token,
        max_model_len=1 << 20, max_num_seqs=batch, cache_layout=session.cache_layout,
        kv_layout=layout))
    ex = MLXExecutor(session.model, kv_layout=layout)
    prompts = db.prompts(len(lengths), max(p for p, _ in lengths), session.spec.vocab_size, 2)
    for i, ((p, n), ids) in enumerate(zip(lengths, prompts)):
        sp = SamplingParams(max_tokens=n, ignore_eos=True)
        sched.add_request(Request(i, p, sp, 0.0, prompt_token_ids=ids[:p]))
    reqs = dict(sched.requests)
    peak = steps = 0
    while sched.has_work():
        plan = sched.schedule()
        result = ex.execute(plan)
        if result.kv_bytes != plan.kv_bytes:
            raise AssertionError(f"step {plan.step_index}: arrays {result.kv_bytes} != account")
        sched.update_from_output(plan, result)
        peak, steps = max(peak, result.kv_bytes), steps + 1
    return {"peak_kv_bytes": peak, "steps": steps,
            "tokens": {rid: r.output_token_ids for rid, r in reqs.items()}}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="smollm2-135m-instruct")
    p.add_argument("--batch", default="1,8,32")
    p.add_argument("--context", type=int, default=128)
    p.add_argument("--steps", type=int, default=4, help="decode steps per timed window")
    p.add_argument("--windows", type=int, default=9, help="windows per layout, interleaved")
    p.add_argument("--mixed", type=int, default=16, help="requests of the mixed-length run "
                   "(prompts 16-512 tokens, outputs 8-64; 0: skip it)")
    p.add_argument("--mixed-batch", type=int, default=8)
    args = p.parse_args()
    session = open_session(RunConfig(model=args.model, dtype="float32"))
    rows = decode_rows(session, [int(x) for x in args.batch.split(",")], args.context,
                       args.steps, args.windows)
    doc = {"model": session.ref.name, "decode": rows, "env": session.environment()}
    if args.mixed:
        rng = np.random.default_rng(0)
        lengths = list(zip(rng.integers(16, 513, args.mixed).tolist(),
                           rng.integers(8, 65, args.mixed).tolist()))
        runs = {k: peak_kv(session, k, args.mixed_batch, lengths) for k in LAYOUTS}
        doc["mixed"] = {"requests": args.mixed, "batch": args.mixed_batch,
                        "same_tokens": runs["padded"]["tokens"] == runs["paged"]["tokens"],
                        **{f"{k}_peak_kv_bytes": runs[k]["peak_kv_bytes"] for k in LAYOUTS}}
        print(f"mixed lengths, {args.mixed} requests at batch {args.mixed_batch}: peak KV "
              f"padded {runs['padded']['peak_kv_bytes']:,} B, paged "
              f"{runs['paged']['peak_kv_bytes']:,} B; same tokens: {doc['mixed']['same_tokens']}")
    print(json.dumps(doc))


if __name__ == "__main__":
    main()
