"""What one simulated plan costs the scheduler, by the number of decoding rows: B requests decode
together (simulated: no token ids, no finishes), one plan per step, and schedule() plus
update_from_output() are timed in CPU time per plan. Lazily advanced rows (scheduler/lazy_rows.py)
keep this nearly flat in B; a loop over the rows grows with it.

    .venv/bin/python benchmarks/plan_cost.py [--rows 32,128,512] [--plans 5000]

Prints a table, then one JSON line: us_per_plan per row count, the load average and the
environment."""

from __future__ import annotations

import argparse
import json
import os
import platform
import time

from batchsim.scheduler.config import SchedulerConfig
from batchsim.scheduler.plan import StepResult
from batchsim.scheduler.request import Request, SamplingParams
from batchsim.scheduler.scheduler import Scheduler

WARMUP_PLANS = 200  # plans after the last admission: every row decoding when the clock starts


def us_per_plan(rows: int, plans: int) -> float:
    cfg = SchedulerConfig(kv_budget_bytes=1 << 40, kv_bytes_per_token=131072,
                          max_model_len=1 << 20, max_num_seqs=rows + 1, max_lookahead_steps=1)
    sched = Scheduler(cfg)
    sampling = SamplingParams(max_tokens=1 << 19, ignore_eos=True)  # no finishes, fits the context
    for i in range(rows):
        sched.add_request(Request(i, 200 + 7 * i, sampling, arrival_s=0.0))

    def one_plan() -> None:
        plan = sched.schedule()
        sampled = plan.decode_ids + tuple(c.request_id for c in plan.prefills if c.sample)
        sched.update_from_output(plan, StepResult(plan.step_index, sampled, None, (0.01,),
                                                  plan.kv_bytes))

    for _ in range(WARMUP_PLANS * rows):  # until every row is admitted, then WARMUP_PLANS more
        one_plan()
        if len(sched.running) == rows and not sched.waiting:
            break
    for _ in range(WARMUP_PLANS):
        one_plan()
    t0 = time.process_time()
    for _ in range(plans):
        one_plan()
    return (time.process_time() - t0) / plans * 1e6


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rows", default="32,128,512", help="comma-separated decoding row counts")
    p.add_argument("--plans", type=int, default=5000, help="timed plans per row count")
    args = p.parse_args()
    try:
        counts = [int(c) for c in args.rows.split(",")]
    except ValueError:
        p.error(f"--rows takes comma-separated integers, got {args.rows!r}")
    if not counts or min(counts) < 1 or args.plans < 1:
        p.error("--rows and --plans must be >= 1")
    load = os.getloadavg()[0]
    result = {str(b): us_per_plan(b, args.plans) for b in counts}
    print(f"{'rows':>6} {'us/plan (cpu)':>14}")
    for b, us in result.items():
        print(f"{b:>6} {us:>14.1f}")
    print(json.dumps({"us_per_plan": result, "plans": args.plans, "loadavg_1m": load,
                      "env": {"python": platform.python_version(), "machine": platform.machine(),
                              "cores": os.cpu_count()}}))


if __name__ == "__main__":
    main()
