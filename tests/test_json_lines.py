"""Record lines written the fast way (steps.jsonl from a template, a batch at once; requests.jsonl
with token times written once per step end, from a template per status and finish reason) are
byte for byte what `dumps(to_json())` writes, for ordinary records and for the values the fast
way must hand back (None, non-finite floats, bools, numpy scalars, strings json escapes)."""

from __future__ import annotations

import math
import random
import threading

import numpy as np
from batchsim.server.results import json_lines
from batchsim.server.results.json_lines import TokenTimesText, request_line, step_line, step_lines
from batchsim.server.results.json_text import dumps
from batchsim.server.results.records import RequestRecord, StepRecord

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
    rng = random.Random(0)
    steps = [_step(rng) for _ in range(300)]
    odd = [_step(rng, kv_bytes_measured=None, compute_s=None),
           _step(rng, compute_s=math.inf), _step(rng, compute_s=math.nan),
           _step(rng, kv_bytes=np.int64(7)), _step(rng, compute_s=np.float64(0.1)),
           _step(rng, num_preemptions=True), _step(rng, start_s=-0.0, end_s=0.0)]
    for step in steps + odd:
        assert step_line(step) == dumps(step.to_json()) + "\n"
    assert step_lines(steps) == "".join(dumps(s.to_json()) + "\n" for s in steps)
    for step in odd:  # one odd value in a batch: the batch line by line
        batch = [*steps[:5], step, *steps[5:9]]
        assert step_lines(batch) == "".join(dumps(s.to_json()) + "\n" for s in batch)
    assert step_lines([]) == ""


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
             for why in ("caf\u00e9", "a\\b", "tab\there\x7f", "", "100% of {x} %s", "%",
                         "info", "nan-ish", "stop")),
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


def test_request_templates_start_over_when_full(monkeypatch):
    """A long process's one-off reasons fill the cache: it starts over, so a common reason seen
    after them is kept too (review r4 item 3: it was made again for every line)."""
    monkeypatch.setattr(json_lines, "_templates", {})
    monkeypatch.setattr(json_lines, "MAX_TEMPLATES", 2)
    ends = [0.25, 0.5, 0.75]
    text = TokenTimesText(ends)([[0, 3]])
    for why in ("refused: 123 bytes", "refused: 456 bytes", "length", "length", "stop"):
        record = _request(ends, [[0, 3]], finish_reason=why)
        assert request_line(record, text) == dumps(record.to_json()) + "\n"
    assert list(json_lines._templates) == [("finished", "length"), ("finished", "stop")]


def test_known_texts_are_the_nonzero_finite_float_ends():
    ends = [0.5, -0.0, 0.0, 2.0, 3, math.inf, math.nan, 1 / 3]
    assert TokenTimesText(ends[:5]).known() == {}  # an int among them: none known
    texts = TokenTimesText([0.5, -0.0, 0.0, 2.0, math.inf, math.nan, 1 / 3])
    assert texts.known() == {0.5: "0.5", 2.0: "2.0", 1 / 3: repr(1 / 3)}
    assert texts([[0, 5]]) is None and texts([[6, 7]]) == repr(1 / 3)  # inf: the ordinary way


def test_step_lines_with_known_texts_match_dumps():
    """start_s and end_s written from the step ends' texts where they equal them, else their own
    way (an int equal to one, -0.0 beside 0.0): the lines are unchanged either way."""
    rng = random.Random(2)
    ends = [-0.0, 0.0, *sorted(rng.choice(ODD_FLOATS) + rng.random() for _ in range(400)), 7e308]
    known = TokenTimesText(ends).known()
    steps = []
    for i in range(1, len(ends)):
        n = rng.randrange(1, 3)
        end = ends[min(i + n - 1, len(ends) - 1)] if rng.random() < 0.9 else ends[i - 1] * 1.5
        steps.append(_step(rng, step_index=i, num_steps=n, start_s=ends[i - 1], end_s=end))
    assert step_lines(steps, known) == "".join(dumps(s.to_json()) + "\n" for s in steps)
    odd = [_step(rng, start_s=-0.0, end_s=0.0), _step(rng, start_s=0.0, end_s=ends[5]),
           _step(rng, start_s=2, end_s=7e308), _step(rng, compute_s=None)]
    for step in odd:
        batch = [*steps[:3], step, *steps[3:5]]
        assert step_lines(batch, known) == "".join(dumps(s.to_json()) + "\n" for s in batch)


def test_request_lines_with_known_texts_match_dumps():
    ends = [0.25, 0.5, 0.75, 1.0, 1.25, -0.0]
    texts = TokenTimesText(ends)
    runs = [[2, 4]]  # first scheduled at the end of step 1, finished at step 3's
    for changes in ({}, {"first_scheduled_s": 0.4}, {"finished_s": None}, {"finished_s": 1.5},
                    {"first_scheduled_s": None, "finish_reason": "a\\b"},
                    {"first_scheduled_s": 0.0, "finished_s": -0.0}, {"finished_s": 1}):
        record = _request(ends, runs, **{"first_scheduled_s": 0.5, "finished_s": 1.0, **changes})
        line = request_line(record, texts(runs), texts.known())
        assert line == dumps(record.to_json()) + "\n"


def test_known_texts_keep_the_latest_ends_only(monkeypatch):
    """known() holds the latest step ends, not one entry per step of the run (review r4 item 7);
    a value no longer known is written the same (its repr)."""
    monkeypatch.setattr(json_lines, "MAX_KNOWN_ENDS", 100, raising=False)
    ends: list[float] = []
    texts = TokenTimesText(ends)
    for i in range(1, 1001):
        ends.append(i / 7)
        if i % 30 == 0:
            assert len(texts.known()) < 130
    assert ends[-1] in texts.known() and ends[0] not in texts.known()
    record = _request(ends, [[0, 1000]], first_scheduled_s=ends[0])
    line = request_line(record, texts([[0, 1000]]), texts.known())
    assert line == dumps(record.to_json()) + "\n"


class _EndsTakenMidway(list):
    """Step ends whose first slice lets another thread's known() run to its end meanwhile (a
    watchdog's flush while the loop writes a request's token times)."""

    texts: TokenTimesText

    def __getitem__(self, index):
        taken = super().__getitem__(index)
        if isinstance(index, slice) and not hasattr(self, "other"):
            self.other = threading.Thread(target=self.texts.known)
            self.other.start()
            self.other.join(timeout=0.5)  # with the lock it waits for this extend instead
        return taken


def test_token_times_extend_once_under_a_flush_thread():
    """Review r4 item 2: both threads took the same new ends, so the texts were extended twice
    and stopped lining up with the step indices."""
    ends = _EndsTakenMidway([0.25, 0.5, 0.75])
    texts = ends.texts = TokenTimesText(ends)
    assert texts([[1, 3]]) == "0.5,0.75"
    ends.other.join()
    ends.append(1.0)
    assert texts([[2, 4]]) == "0.75,1.0" and len(texts._texts) == 4
