"""Record lines written the fast way (steps.jsonl from a template, requests.jsonl with token times
written once per step end) are byte for byte what `dumps(to_json())` writes, for ordinary records
and for the values the fast way must hand back (None, non-finite floats, bools, numpy scalars)."""

from __future__ import annotations

import math
import random

import numpy as np
from batchsim.server.results.json_lines import (
    StepLines,
    TokenTimesText,
    request_known,
    request_line,
)
from batchsim.server.results.jsonio import dumps
from batchsim.server.results.metrics import RequestRecord, StepRecord

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


def _request(ends: list, runs: list[list[int]], **changes) -> RequestRecord:
    times = tuple(t for a, b in runs for t in ends[a:b])
    values = {"request_id": 7, "status": "finished", "arrival_s": 0.25, "first_scheduled_s": 0.5,
              "token_times_s": times, "finished_s": ends[-1], "num_prompt_tokens": 100,
              "num_output_tokens": len(times), "num_preemptions": len(runs) - 1,
              "finish_reason": "length"}
    return RequestRecord(**{**values, **changes})


def test_request_lines_match_dumps():
    rng = random.Random(1)
    ends: list = []
    text = TokenTimesText(ends)
    for _ in range(200):  # the recorder's list grows between requests
        ends.extend(rng.choice(ODD_FLOATS) + 3600 * rng.random() for _ in range(rng.randrange(9)))
        if len(ends) < 3:
            continue
        cut = sorted(rng.sample(range(len(ends) + 1), 2))
        runs = [[0, 1], cut] if cut[0] > 1 else [cut]
        record = _request(ends, runs)
        assert request_line(record, text(runs)) == dumps(record.to_json()) + "\n"
    runs = [[0, 2]]
    odd = [_request(ends, runs, finish_reason='says "token_times_s":[] itself'),
           _request(ends, runs, arrival_s=math.nan), _request(ends, runs, first_scheduled_s=None),
           *(_request(ends, runs, finish_reason=why)
             for why in ("caf\u00e9", "a\\b", "tab\there\x7f", "", "100% of {x} %s")),
           _request(ends, runs, request_id=np.int64(7)), _request(ends, runs, num_preemptions=True),
           _request(ends, runs, arrival_s=-0.0), _request(ends, runs, arrival_s=np.float64(0.1)),
           _request(ends, runs, finished_s=math.inf), _request(ends, runs, finished_s=None)]
    for record in odd:
        assert request_line(record, text(runs)) == dumps(record.to_json()) + "\n"
    refused = _request(ends, [], status="rejected", first_scheduled_s=None, finish_reason=(
        "its KV cache at full length (123 bytes) exceeds the KV budget (45 bytes)"))
    assert request_line(refused, text([])) == dumps(refused.to_json()) + "\n"
    for value in (math.inf, math.nan, np.float64(0.1), 3, True):  # end times json writes its way
        ends = [0.5, value, 2.0]
        record = _request(ends, [[0, 3]])
        text = TokenTimesText(ends)([[0, 3]])
        assert request_line(record, text) == dumps(record.to_json()) + "\n"


def test_end_texts_only_for_equal_nonzero_floats():
    ends = [0.5, -0.0, 2.0, 3, math.nan, 1 / 3]
    texts = TokenTimesText(ends)
    assert texts.texts_of(0.5, 0, 1 / 3, 5) == ("0.5", repr(1 / 3))
    assert texts.texts_of(0.0, 1, 2.5, 2) == (0.0, 2.5)  # 0.0 equals -0.0 (other text); unequal
    assert texts.texts_of(3.0, 3, math.inf, 4) == (3.0, math.inf)  # an int end; not the end
    nan, half = math.nan, np.float64(0.5)
    assert texts.texts_of(nan, 4, half, 0) == (nan, half)  # nan equals nothing; not a float
    assert texts.texts_of(0.5, -1, 0.5, 6) == (0.5, 0.5)  # no such end
    assert texts.texts_of(None, 0, "null", 0) == (None, "null")


def test_step_lines_with_end_texts_match_dumps():
    """start_s and end_s written from the step ends' texts where they equal them, else their own
    way: the line is unchanged either way."""
    rng = random.Random(2)
    ends = [-0.0, 0.0, *sorted(rng.choice(ODD_FLOATS) + rng.random() for _ in range(400)), 7e308,
            math.inf]
    line = StepLines(TokenTimesText(ends))
    steps = []
    for i in range(1, len(ends)):
        n = rng.randrange(1, 3)
        end = ends[min(i + n - 1, len(ends) - 1)] if rng.random() < 0.9 else ends[i - 1] * 1.5
        steps.append(_step(rng, step_index=i, num_steps=n, start_s=ends[i - 1], end_s=end))
    steps += [_step(rng, step_index=0), _step(rng, step_index=3, num_steps=9),
              _step(rng, step_index=3, compute_s=None, kv_bytes_measured=None)]
    for step in steps:
        assert line(step) == dumps(step.to_json()) + "\n"


def test_request_lines_with_known_texts_match_dumps():
    ends = [0.25, 0.5, 0.75, 1.0, 1.25]
    texts = TokenTimesText(ends)
    runs = [[2, 4]]  # first scheduled at the end of step 1, finished at step 3's
    record = _request(ends, runs, first_scheduled_s=0.5, finished_s=1.0)
    known = request_known(record, runs, texts)
    assert known == ("0.5", "1.0")
    assert request_line(record, texts(runs), known) == dumps(record.to_json()) + "\n"
    for changes in ({"first_scheduled_s": 0.4}, {"finished_s": None}, {"finished_s": 1.5},
                    {"first_scheduled_s": None, "finish_reason": "a\\b"}):
        odd = _request(ends, runs, **changes)
        line = request_line(odd, texts(runs), request_known(odd, runs, texts))
        assert line == dumps(odd.to_json()) + "\n"
    assert request_known(record, [], texts) is None
