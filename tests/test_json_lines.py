"""steps.jsonl lines written from a template are byte for byte what `dumps(to_json())` writes,
for ordinary records and for the values the template must hand back (None, non-finite floats,
bools, numpy scalars)."""

from __future__ import annotations

import math
import random

import numpy as np
from batchsim.server.results.json_lines import StepLines
from batchsim.server.results.jsonio import dumps
from batchsim.server.results.metrics import StepRecord

ODD_FLOATS = [0.0, -0.0, 1e-7, 1e16, 123456789.125, 1 / 3, 5e-324, 1.7976931348623157e308]


def _step(rng: random.Random, **changes) -> StepRecord:
    start = rng.choice(ODD_FLOATS + [rng.random() * 3600])
    values = {"step_index": rng.randrange(10**6), "start_s": start, "end_s": start + rng.random(),
                  "num_steps": rng.randrange(1, 99), "batch_size": rng.randrange(64),
                  "num_prefill_tokens": rng.randrange(4096),
                  "num_prefill_requests": rng.randrange(4),
                  "num_running": rng.randrange(64), "num_waiting": rng.randrange(10**4),
                  "kv_bytes": rng.randrange(1 << 40), "kv_bytes_measured": rng.randrange(1 << 40),
                  "pool_rows": rng.randrange(64), "pool_capacity_tokens": 256 * rng.randrange(64),
                  "num_preemptions": rng.randrange(3), "compute_s": rng.random()}
    values.update(changes)
    return StepRecord(**values)


def test_step_lines_match_dumps():
    rng, line = random.Random(0), StepLines()
    steps = [_step(rng) for _ in range(300)] + [
        _step(rng, kv_bytes_measured=None, compute_s=None),
        _step(rng, compute_s=math.inf), _step(rng, compute_s=math.nan),
        _step(rng, kv_bytes=np.int64(7)), _step(rng, compute_s=np.float64(0.1)),
        _step(rng, num_preemptions=True)]
    for step in steps:
        assert line(step) == dumps(step.to_json()) + "\n"
