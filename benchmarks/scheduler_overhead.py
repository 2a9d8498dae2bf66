"""Scheduler and engine overhead per step at a fixed decode batch, with a zero-cost executor.

    .venv/bin/python benchmarks/scheduler_overhead.py [--batch 64] [--steps 2000]

Prints the median microseconds per step for (a) the policy alone (schedule + update), and
(b) the whole real-time engine loop (asyncio, executor thread hand-off, recorder) through
`batchsim run --executor fake`, then one JSON line."""

from __future__ import annotations

import argparse
import itertools
import json
import statistics
import time

from batchsim.scheduler.config import SchedulerConfig
from batchsim.scheduler.request import Request, SamplingParams
from batchsim.scheduler.scheduler import Scheduler
from batchsim.server.executors.fake_executor import FakeExecutor


def policy_us(batch: int, steps: int) -> float:
    s = Scheduler(SchedulerConfig(kv_budget_bytes=1 << 40, kv_bytes_per_token=512,
                                  max_model_len=1 << 20,
                                  max_num_seqs=batch, max_num_batched_tokens=max(4096, batch)))
    ex = FakeExecutor()
    for i in range(batch):
        s.add_request(Request(i, 128, SamplingParams(max_tokens=steps * 4, ignore_eos=True), 0.0))
    for _ in range(4):  # admissions and prefills
        plan = s.schedule()
        s.update_from_output(plan, ex.execute(plan))
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        plan = s.schedule()
        s.update_from_output(plan, ex.execute(plan))
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e6


def engine_us(batch: int) -> dict:
    from batchsim.server.engine.run_config import RunConfig, SchedulerSettings
    from batchsim.server.engine.runner import run_workload
    from batchsim.server.engine.session import open_session
    from batchsim.workloads.lengths import LengthSpec
    from batchsim.workloads.spec import WorkloadSpec

    spec = WorkloadSpec(name="overhead", num_prompts=batch, arrival="closed", concurrency=batch,
                        input_len=LengthSpec("fixed", value=64),
                        output_len=LengthSpec("fixed", value=400))
    cfg = RunConfig(model="smollm2-135m", executor="fake", workload=spec,
                    scheduler=SchedulerSettings(max_num_seqs=batch))
    session = open_session(cfg)
    out = run_workload(session, spec, out_dir=None, label="overhead")
    full = [s for s in out.steps if s.batch_size == batch]
    gaps = [b.end_s - a.end_s for a, b in itertools.pairwise(full)]
    return {"engine_step_us": statistics.median(gaps) * 1e6, "steps": len(full),
            "mean_batch_size": out.summary["mean_batch_size"]}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--steps", type=int, default=2000)
    args = p.parse_args()
    result = {"batch": args.batch, "policy_step_us": policy_us(args.batch, args.steps),
              **engine_us(args.batch)}
    print(f"batch {args.batch}: policy {result['policy_step_us']:.0f} us/step, "
          f"engine loop {result['engine_step_us']:.0f} us/step")
    print(json.dumps(result))


if __name__ == "__main__":
    main()
