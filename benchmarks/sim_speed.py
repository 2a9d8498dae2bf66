"""How fast the simulator replays traffic: simulated seconds per wall second at 10^3, 10^4 and
(with --large) 10^5 requests of the issue-37 workload (Llama-3.1-8B 4-bit on an M2 Ultra, Poisson
at 5 req/s, the default lengths, seed 3; 18,000 requests are the simulated hour).

    .venv/bin/python benchmarks/sim_speed.py [--large] [--repeat 3] [--counts 1000,18000]

Each run goes through `run_workload` with a run directory, as `batchsim run` does. wall_s is the
summary's (the engine's time; writing records is counted apart); total_s adds writing records and
the summary (no timeline.png: drawing it is not simulating); cpu_s is this process's CPU time over
the same span (on a shared machine less bent by the others than wall time). With --repeat, the
fastest run of each count is kept. Prints a table, then one JSON line: sim_speedup, wall_s, total_s
and cpu_s per request count, the load average before each count, and the environment."""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import tempfile
import time
from pathlib import Path

from batchsim.server.engine.run_config import RunConfig
from batchsim.server.engine.runner import run_workload
from batchsim.server.engine.session import Session, open_session

RATE_PER_S = 5.0


def session_for(count: int) -> Session:
    base = RunConfig(model="llama-3.1-8b", executor="sim", device_profile="M2 Ultra", quantize=4)
    workload = dataclasses.replace(base.workload, num_prompts=count, request_rate=RATE_PER_S,
                                   seed=3)
    return open_session(dataclasses.replace(base, workload=workload))


def run_once(count: int, out_dir: Path) -> dict:
    session = session_for(count)
    load = os.getloadavg()[0]
    t0, cpu0 = time.perf_counter(), time.process_time()
    outcome = run_workload(session, session.config.workload, out_dir=out_dir, label=str(count),
                           timeline=False)  # drawing is not simulating (and imports matplotlib)
    total_s, cpu_s = time.perf_counter() - t0, time.process_time() - cpu0
    s = outcome.summary
    return {"requests": count, "simulated_s": s["duration"], "wall_s": s["wall_s"],
            "total_s": total_s, "cpu_s": cpu_s, "loadavg_1m": load,
            "sim_speedup": s["sim_speedup"], "plans": s["num_plans"],
            "steps": s["num_steps"], "us_per_plan": 1e6 * s["wall_s"] / max(1, s["num_plans"])}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--large", action="store_true", help="add 10^5 requests (about 30 s)")
    p.add_argument("--counts", help="comma-separated request counts instead of 10^3, 10^4")
    p.add_argument("--repeat", type=int, default=1, help="runs per count; the fastest is kept")
    args = p.parse_args()
    counts = [int(c) for c in args.counts.split(",")] if args.counts else [1000, 10_000]
    if args.large:
        counts.append(100_000)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for count in counts:
            runs = [run_once(count, Path(tmp)) for _ in range(max(1, args.repeat))]
            rows.append(min(runs, key=lambda r: r["wall_s"]))
    print(f"{'requests':>9} {'simulated s':>12} {'wall s':>8} {'total s':>8} {'cpu s':>8} "
          f"{'x real time':>12} {'plans':>8} {'us/plan':>8} {'load':>5}")
    for r in rows:
        print(f"{r['requests']:>9} {r['simulated_s']:>12.1f} {r['wall_s']:>8.3f} "
              f"{r['total_s']:>8.3f} {r['cpu_s']:>8.3f} {r['sim_speedup']:>12.0f} "
              f"{r['plans']:>8} {r['us_per_plan']:>8.1f} {r['loadavg_1m']:>5.1f}")
    env = session_for(1).environment()
    env["loadavg_1m"] = os.getloadavg()[0]
    print(json.dumps({
        "sim_speedup": {str(r["requests"]): r["sim_speedup"] for r in rows},
        "wall_s": {str(r["requests"]): r["wall_s"] for r in rows},
        "total_s": {str(r["requests"]): r["total_s"] for r in rows},
        "cpu_s": {str(r["requests"]): r["cpu_s"] for r in rows},
        "loadavg_1m": {str(r["requests"]): r["loadavg_1m"] for r in rows},
        "repeat": args.repeat, "env": env}))


if __name__ == "__main__":
    main()
