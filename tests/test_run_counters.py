"""Running counters the simulated path keeps instead of recounting each step, held equal to the
count they replace."""

from __future__ import annotations

from batchsim.server.engine.runner import run_workload
from batchsim.server.engine.session import open_session

from tests.sim_records import sim_config


def test_the_recorder_counts_requests_that_left_as_the_progress_line_used_to_count_them():
    session = open_session(sim_config(n=40))
    seen = []  # (counter, recount) at each step: the counter lags the step's own finishes

    def look(engine, plan, result):
        recount = sum(1 for r in engine.recorder.requests.values() if r.is_finished)
        seen.append((engine.recorder.num_left, recount))

    outcome = run_workload(session, session.config.workload, out_dir=None, label="t", on_step=look)
    assert all(prev_recount <= left <= recount
               for (left, recount), (_, prev_recount) in zip(seen[1:], seen, strict=False))
    assert seen[-1][1] == len(outcome.requests) == 40
    assert len({left for left, _ in seen}) > 5  # it moved as requests left
