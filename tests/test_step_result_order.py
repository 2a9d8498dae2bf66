"""StepResult.sampled_ids in the one order scheduler/plan.py documents, from every executor: the
decode rows in plan.decode_ids order, then the sampling prefill chunks in plan order."""

from __future__ import annotations

import pytest
from batchsim.scheduler.config import SchedulerSettings
from batchsim.server.engine.run_config import RunConfig
from batchsim.server.engine.runner import run_workload
from batchsim.server.engine.session import open_session
from batchsim.workloads.lengths import parse_length
from batchsim.workloads.spec import WorkloadSpec


@pytest.mark.parametrize("executor", ["fake", "sim", "mlx"])
def test_every_executor_reports_sampled_ids_in_the_documented_order(executor):
    # Chunked prefills beside decodes, rows that leave at different lengths and rows that join:
    # a pool whose row order drifts from the order the scheduler lists its decodes in.
    spec = WorkloadSpec(name="order", num_prompts=12, request_rate=float("inf"), seed=5,
                        input_len=parse_length("uniform:40:200"),
                        output_len=parse_length("uniform:2:12"))
    cfg = RunConfig(model="tiny", executor=executor, workload=spec,
                    device_profile="M2 Max" if executor == "sim" else None,
                    scheduler=SchedulerSettings(max_num_seqs=4, max_num_batched_tokens=256,
                                              prefill_step_size=256))
    seen: list[tuple[tuple[int, ...], tuple[int, ...]]] = []
    mixed = []  # steps where decodes and sampling prefills share the step

    def check(engine, plan, result) -> None:
        sampling = tuple(c.request_id for c in plan.prefills if c.sample)
        seen.append((result.sampled_ids, (*plan.decode_ids, *sampling)))
        if plan.decode_ids and sampling:
            mixed.append(plan.step_index)

    outcome = run_workload(open_session(cfg), spec, out_dir=None, label="order", on_step=check)
    assert outcome.summary["completed"] == 12 and mixed
    assert [got for got, _ in seen] == [expected for _, expected in seen]
