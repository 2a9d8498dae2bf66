"""How fast the simulator replays traffic: simulated seconds per wall second at 10^3, 10^4 and
(with --large) 10^5 requests of the issue-37 workload (Llama-3.1-8B 4-bit on an M2 Ultra, Poisson
at 5 req/s, the default lengths, seed 3; 18,000 requests are the simulated hour).

    .venv/bin/python benchmarks/sim_speed.py [--large] [--repeat 3] [--counts 1000,18000]

Each run goes through `run_workload` with a run directory, as `batchsim run` does. wall_s is the
summary's (the engine's time; writing records is counted apart); total_s adds writing records and
the summary (no timeline.png: drawing it is not simulating); cpu_s is this process's CPU time over
the same span (on a shared machine less bent by the others than wall time). With --repeat, the
fastest run of each count is kept. Prints a table, then one JSON line: sim_speedup, wall_s, total_s
and cpu_s per request count, the load average before each count, and the environment.

With --instructions, each count also runs once under valgrind's callgrind, which counts the
instructions of the simulation loop alone (VirtualRun's, from the first plan to the last) less
encoding and writing records, as wall_s leaves them out: a measure the other processes on a shared
machine do not bend, for comparing two versions of the code (about 1 min per 1,000 requests). The
JSON line gains loop_instructions and instructions_per_plan per count."""

from __future__ import annotations

import argparse
import contextvars
import dataclasses
import json
import operator
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

from batchsim.server.engine.run_config import RunConfig
from batchsim.server.engine.runner import run_workload
from batchsim.server.engine.session import Session, open_session
from batchsim.server.engine.virtual_run import VirtualRun
from batchsim.server.results.recorder import RunRecorder
from batchsim.server.results.run_files import RecordStream

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


def loop_instructions(count: int) -> dict:
    """Instructions the simulation loop runs for `count` requests, less writing records: this
    file, run under callgrind with --loop-only, enters the loop through operator.call and each
    writing of records inside it through a context's run, and callgrind counts from entering the
    first to leaving it, except from entering the second to leaving it (--toggle-collect)."""
    argv = [__file__, "--loop-only", str(count)]
    totals, proc = callgrind(["_operator_call", "context_run"], argv,
                             f"callgrind run of {count} requests")
    plans = json.loads(proc.stdout.strip().splitlines()[-1])["plans"]
    return {"loop_instructions": totals, "instructions_per_plan": round(totals / max(1, plans))}


def callgrind(toggles: list[str], argv: list[str], what: str,
              env: dict[str, str] | None = None) -> tuple[int, subprocess.CompletedProcess]:
    """(instructions callgrind counts inside the `toggles` functions while Python runs `argv`,
    the process); an exit naming `what` where valgrind is missing or nothing was counted."""
    valgrind = shutil.which("valgrind")
    if valgrind is None:
        raise SystemExit("benchmarks: instruction counts need valgrind (apt-get install valgrind)")
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "callgrind.out"
        proc = subprocess.run(
            [valgrind, "--tool=callgrind", *[f"--toggle-collect={t}" for t in toggles],
             f"--callgrind-out-file={out}", sys.executable, *argv],
            capture_output=True, text=True, check=False, env=env)
        totals = callgrind_totals(out.read_text()) if out.exists() else 0
    if proc.returncode != 0 or not totals:
        why = (proc.stderr.strip().splitlines() or ["nothing counted"])[-1]
        raise SystemExit(f"{Path(argv[0]).stem}: {what} failed: {why}")
    return totals, proc


def callgrind_totals(text: str) -> int:
    """The instruction count in a callgrind output file (0: none)."""
    found = re.search(r"^totals: (\d+)", text, re.MULTILINE)
    return int(found[1]) if found else 0


def _loop_only(count: int) -> None:
    """The inner run of loop_instructions: one run, its loop entered through operator.call and
    the writings inside it that wall_s leaves out (RecordStream.flush, RunRecorder.on_finish)
    through a context's run."""
    loop, context, inside = VirtualRun._loop, contextvars.copy_context(), [False]

    def counted_loop(run: VirtualRun, *args: object) -> None:
        inside[0] = True
        try:
            operator.call(loop, run, *args)
        finally:
            inside[0] = False

    def uncounted(method: Callable) -> Callable:
        return lambda *args: context.run(method, *args) if inside[0] else method(*args)

    VirtualRun._loop = counted_loop
    RecordStream.flush = uncounted(RecordStream.flush)
    RunRecorder.on_finish = uncounted(RunRecorder.on_finish)
    with tempfile.TemporaryDirectory() as tmp:
        print(json.dumps(run_once(count, Path(tmp))))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--large", action="store_true", help="add 10^5 requests (about 30 s)")
    p.add_argument("--counts", help="comma-separated request counts instead of 10^3, 10^4")
    p.add_argument("--repeat", type=int, default=1, help="runs per count; the fastest is kept")
    p.add_argument("--instructions", action="store_true",
                   help="also count the loop's instructions under callgrind (deterministic)")
    p.add_argument("--loop-only", type=int, help=argparse.SUPPRESS)  # loop_instructions' child
    args = p.parse_args()
    if args.loop_only:
        return _loop_only(args.loop_only)
    counts = [int(c) for c in args.counts.split(",")] if args.counts else [1000, 10_000]
    if args.large:
        counts.append(100_000)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for count in counts:
            runs = [run_once(count, Path(tmp)) for _ in range(max(1, args.repeat))]
            rows.append(min(runs, key=lambda r: r["wall_s"]))
            if args.instructions:
                rows[-1].update(loop_instructions(count))
    print(f"{'requests':>9} {'simulated s':>12} {'wall s':>8} {'total s':>8} {'cpu s':>8} "
          f"{'x real time':>12} {'plans':>8} {'us/plan':>8} {'load':>5}")
    for r in rows:
        print(f"{r['requests']:>9} {r['simulated_s']:>12.1f} {r['wall_s']:>8.3f} "
              f"{r['total_s']:>8.3f} {r['cpu_s']:>8.3f} {r['sim_speedup']:>12.0f} "
              f"{r['plans']:>8} {r['us_per_plan']:>8.1f} {r['loadavg_1m']:>5.1f}")
        if args.instructions:
            print(f"{'':>9} loop instructions {r['loop_instructions']:,} "
                  f"({r['instructions_per_plan']:,} a plan, callgrind)")
    env = session_for(1).environment()
    env["loadavg_1m"] = os.getloadavg()[0]
    keys = ["sim_speedup", "wall_s", "total_s", "cpu_s", "loadavg_1m"]
    if args.instructions:
        keys += ["loop_instructions", "instructions_per_plan"]
    doc = {key: {str(r["requests"]): r[key] for r in rows} for key in keys}
    print(json.dumps({**doc, "repeat": args.repeat, "env": env}))


if __name__ == "__main__":
    main()
