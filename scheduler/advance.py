"""Counters of a step's decode rows advanced without token ids (a simulated step): the hot loop of
a long simulation, kept apart from the general `Scheduler.update_from_output`, which it must match
exactly (tests/test_advance.py holds the two side by side)."""

from __future__ import annotations

from batchsim.scheduler.request import RUNNING, Request


def advance_decoded(rows: list[Request], step: int, k: int) -> list[Request]:
    """Each running row of a plan's decode pool emitted one token per step for `k` steps from
    `step`; returns the rows that reached their max_tokens (in row order), still to be finished."""
    end = step + k
    running = RUNNING
    reached: list[Request] = []
    for r in rows:
        if r.status is not running:  # aborted while the step ran
            continue
        r.num_computed_tokens += k
        out = r.num_output_tokens = r.num_output_tokens + k
        runs = r.token_runs
        if runs and runs[-1][1] == step:
            runs[-1][1] = end
        else:
            runs.append([step, end])
        if out >= r.sampling.max_tokens:
            reached.append(r)
    return reached
