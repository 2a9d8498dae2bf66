"""What the n-gram drafter costs the host per row and step: `ngram_proposal` (vLLM's prompt
lookup, server/executors/speculative.py) timed by process CPU time on contexts of W tokens, when
it finds no match (it tries every n from 5 down to 2: the usual case, 91.5% of the default
model's chat decode steps) and when the last 5 tokens match early. Prints a line per width and,
last, one JSON document with the least-squares line us = a + b x W over the no-match case (what
server/perf/spec_price.py's NGRAM_ROW_US and NGRAM_TOKEN_NS hold).

    nice -n 10 .venv/bin/python benchmarks/ngram_host_cost.py --widths 128,512,2048,8192
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import time

from batchsim.server.platform import blas

blas.preload()  # before the first `import mlx` (speculative imports it), as the CLI does

import numpy as np
from batchsim.server.executors.speculative import ngram_proposal


def cpu_us_per_call(tokens: list[int], reps: int) -> float:
    """Median over 5 windows of process CPU time per call (less bent by other jobs than wall)."""
    windows = []
    for _ in range(5):
        t = time.process_time()
        for _ in range(reps):
            ngram_proposal(tokens, 4)
        windows.append((time.process_time() - t) / reps * 1e6)
    return float(np.median(windows))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--widths", default="128,512,2048,8192",
                   help="comma-separated context lengths (tokens), at least two distinct")
    p.add_argument("--reps", type=int, default=400, help="calls per timing window")
    args = p.parse_args()
    try:
        widths = [int(w) for w in args.widths.split(",")]
    except ValueError:
        p.error(f"--widths takes comma-separated integers, got {args.widths!r}")
    if len(set(widths)) < 2 or min(widths) < 8 or args.reps < 1:
        p.error("--widths needs two distinct lengths >= 8 (the fit is a line), --reps >= 1")
    rng = random.Random(0)
    rows = []
    for w in widths:
        miss = [rng.randrange(49152) for _ in range(w)]  # no 2-gram repeats: no match
        hit = miss[:-5] + miss[:5]  # the last 5 tokens occur at the start
        assert ngram_proposal(miss, 4) == [] and ngram_proposal(hit, 4)
        row = {"width": w, "miss_us": cpu_us_per_call(miss, args.reps),
               "hit_us": cpu_us_per_call(hit, args.reps)}
        rows.append(row)
        print(f"W={w:6d}  no match {row['miss_us']:8.1f} us   match {row['hit_us']:8.1f} us",
              flush=True)
    slope, intercept = np.polyfit(widths, [r["miss_us"] for r in rows], 1)
    print(json.dumps({"rows": rows, "row_us": intercept, "token_ns": slope * 1e3,
                      "cpu": platform.processor() or platform.machine(),
                      "numpy": np.__version__, "load_average": os.getloadavg()}))


if __name__ == "__main__":
    main()
