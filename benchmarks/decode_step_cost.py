"""What one decode step costs beyond the model, by measures a shared machine bends little:
1. MLX primitives in one decode step's graph (the forward, the sampling, the tokens fed back):
   the bare loop's and the executor's, counted from the graph before it runs;
2. CPU per step, interleaved windows: this thread's (host work: graph building, scheduling,
   bookkeeping) and the process's (MLX's and the BLAS threads' too; spinning BLAS waits count),
   for bare, executor and mlx_lm (bench-decode's runners), beside wall time and the load average.

    .venv/bin/python benchmarks/decode_step_cost.py --model smollm2-135m --batch 16,32

Not part of the test suite; the last stdout line is one JSON document."""

from __future__ import annotations

import argparse
import io
import json
import os
import re
import statistics
import time
from collections import Counter
from unittest import mock

from batchsim.server.platform import blas

blas.preload()  # before the first `import mlx`, as the CLI does

import mlx.core as mx
from batchsim.server.engine.run_config import RunConfig
from batchsim.server.engine.session import open_session
from batchsim.server.measure import decode_bench as db

MODES = ("bare", "executor", "mlx_lm")


def graph_ops(arrays: list[mx.array]) -> Counter:
    """Primitives (by name) in the graph that computes `arrays`, down to evaluated arrays."""
    dot = io.StringIO()
    mx.export_to_dot(dot, *arrays)
    return Counter(re.findall(r'label ="([^"]+)", shape=rectangle', dot.getvalue()))


def bare_step_ops(runner: db.Bare) -> Counter:
    """One step of the bare loop, as Bare.steps builds it."""
    y = mx.argmax(runner.model(runner.y[:, None], cache=runner.cache)[:, -1, :], axis=-1)
    return graph_ops([y])


def executor_step_ops(runner: db.Executor) -> Counter:
    """Everything one executor step hands MLX (its async_evals: the tokens it reads, the next
    step run ahead), counted before each is dispatched."""
    ops: Counter = Counter()
    dispatch = mx.async_eval

    def counting(*arrays):
        flat = [a for x in arrays for a in (x if isinstance(x, list) else [x])]
        ops.update(graph_ops(flat))
        return dispatch(*arrays)

    with mock.patch.object(mx, "async_eval", counting):
        runner.steps(1)
    return ops


def cpu_rows(session, batches: list[int], context: int, steps: int, windows: int,
             modes: list[str]) -> list[dict]:
    model, vocab = session.model, session.spec.vocab_size
    makers = {
        "bare": lambda b: db.Bare(model, b, context, vocab),
        "executor": lambda b: db.Executor(model, b, context, vocab, session.kv_bytes_per_token,
                                          session.cache_layout),
        "mlx_lm": lambda b: db.MlxLmBatchGenerator(model, b, context, vocab),
    }
    rows = []
    for b in batches:
        runners = {m: makers[m](b) for m in modes}
        ops = {"bare": bare_step_ops(runners["bare"]) if "bare" in runners else None,
               "executor": executor_step_ops(runners["executor"])
               if "executor" in runners else None}
        per: dict[str, list[tuple[float, float, float]]] = {m: [] for m in modes}
        for _ in range(windows):
            for m in modes:  # interleaved: drift hits every mode alike
                t, c, w = time.thread_time(), time.process_time(), time.perf_counter()
                runners[m].steps(steps)
                per[m].append(((time.perf_counter() - w) / steps, (time.thread_time() - t) / steps,
                               (time.process_time() - c) / steps))
        row = {"batch": b, "context": context, "steps": steps, "windows": windows,
               "loadavg_1m": os.getloadavg()[0]}
        for m in modes:
            wall, host, proc = (statistics.median(x) * 1e3 for x in zip(*per[m]))
            row[m] = {"wall_ms": wall, "host_cpu_ms": host, "process_cpu_ms": proc}
            if ops.get(m) is not None:
                row[m]["graph_ops"] = sum(ops[m].values())
        if ops["bare"] is not None and ops["executor"] is not None:
            row["executor_extra_ops"] = dict(ops["executor"] - ops["bare"])
        for r in runners.values():
            getattr(r, "close", lambda: None)()
        rows.append(row)
        print(f"batch {b:3d}: " + "; ".join(
            f"{m} wall {row[m]['wall_ms']:.1f} host {row[m]['host_cpu_ms']:.1f} process "
            f"{row[m]['process_cpu_ms']:.1f} ms/step" for m in modes)
            + f"; load {row['loadavg_1m']:.1f}", flush=True)
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--batch", default="16,32")
    p.add_argument("--context", type=int, default=128)
    p.add_argument("--steps", type=int, default=8, help="decode steps per window")
    p.add_argument("--windows", type=int, default=3, help="interleaved windows per mode")
    p.add_argument("--modes", default=",".join(MODES))
    a = p.parse_args()
    modes = a.modes.split(",")
    if bad := [m for m in modes if m not in MODES]:
        raise SystemExit(f"--modes: {bad[0]!r} is not one of {', '.join(MODES)}")
    session = open_session(RunConfig(model=a.model, dtype=a.dtype))
    rows = cpu_rows(session, [int(b) for b in a.batch.split(",")], a.context, a.steps,
                    a.windows, modes)
    print(json.dumps({"rows": rows, "env": session.environment()}))


if __name__ == "__main__":
    main()
