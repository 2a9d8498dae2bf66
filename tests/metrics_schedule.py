"""A small fixed schedule of requests and steps (REQUESTS, STEPS) whose metrics are worked out
by hand (tests/test_metrics.py), and the record makers it is written with (`req`, `step`).

The schedule (seconds; a token is stamped with the end of the step that sampled it):

  R0 finished  arrives 0.00, scheduled 0.25, tokens 0.50 0.75 1.00 1.50, ends 1.75, prompt 8
  R1 finished  arrives 0.25, scheduled 0.75, token  1.00 (1 output token),  ends 1.00, prompt 4
  R2 finished  arrives 0.50, scheduled 0.50, tokens 1.00 1.50 | preempted | 2.50 2.75 3.00,
               ends 3.00, prompt 6
  R3 rejected  arrives 0.50, no token, prompt 100
  R4 aborted   arrives 0.75, scheduled 1.00, token 1.50, aborted 1.50, prompt 5

  step  span          n  batch  prefill (reqs)  kv    what happens
  S0    0.25-0.50     1  0      8 (1)           1000  prefill R0, samples R0@0.50
  S1    0.50-0.75     1  1      4 (1)           1600  decode R0; first 4 of R2's 6
  S2    0.75-1.00     1  1      6 (2)           2200  decode R0; R1 (4) and R2 (2) sample @1.00
  S3    1.00-1.50     1  2      5 (1)           2600  decode R0, R2; prefill R4, samples @1.50
  S4    1.50-2.25     1  0      4 (1)           1200  R2 preempted; recompute 4 of 8 (no sample)
  S5    2.25-2.50     1  0      4 (1)           1600  recompute last 4, samples R2@2.50
  S6    2.50-3.00     2  1      0               1800  two decode steps of R2: 2.75, 3.00

Completed: R0, R1, R2. The run lasts 3.0 s (the last completion).
"""

from __future__ import annotations

from batchsim.server.results.records import RequestRecord, StepRecord


def req(rid, status, arrival, sched, tokens, finished, prompt, preemptions=0) -> RequestRecord:
    return RequestRecord(rid, status, arrival, sched, tuple(tokens), finished, prompt, len(tokens),
                         num_preemptions=preemptions)


REQUESTS = [
    req(0, "finished", 0.0, 0.25, [0.5, 0.75, 1.0, 1.5], 1.75, 8),
    req(1, "finished", 0.25, 0.75, [1.0], 1.0, 4),
    req(2, "finished", 0.5, 0.5, [1.0, 1.5, 2.5, 2.75, 3.0], 3.0, 6, preemptions=1),
    req(3, "rejected", 0.5, None, [], 0.5, 100),
    req(4, "aborted", 0.75, 1.0, [1.5], 1.5, 5),
]


def step(i, start, end, n, batch, prefill, prefill_reqs, kv, measured=None,
         preempt=0) -> StepRecord:
    return StepRecord(i, start, end, n, batch, prefill, prefill_reqs, num_running=1, num_waiting=0,
                      kv_bytes=kv, kv_bytes_measured=measured, pool_rows=4,
                      pool_capacity_tokens=64, num_preemptions=preempt)


STEPS = [
    step(0, 0.25, 0.5, 1, 0, 8, 1, 1000),
    step(1, 0.5, 0.75, 1, 1, 4, 1, 1600),
    step(2, 0.75, 1.0, 1, 1, 6, 2, 2200),
    step(3, 1.0, 1.5, 1, 2, 5, 1, 2600, measured=2700),
    step(4, 1.5, 2.25, 1, 0, 4, 1, 1200, preempt=1),
    step(5, 2.25, 2.5, 1, 0, 4, 1, 1600),
    step(6, 2.5, 3.0, 2, 1, 0, 0, 1800, measured=1800),
]
