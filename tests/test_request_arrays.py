"""The summary's latencies as arrays (request_arrays.latencies_s): exactly the floats the
records' properties give, None left out as the properties leave it."""

from __future__ import annotations

import random

from batchsim.server.results import request_arrays
from batchsim.server.results.metrics import RequestRecord, summarize


def _records(seed: int, n: int) -> list[RequestRecord]:
    rng, out = random.Random(seed), []
    for i in range(n):
        arrival = rng.choice([0, rng.random() * 10, rng.random() * 1e6])  # an int, as JSON has
        times, t = [], arrival + rng.random()
        for _ in range(rng.randint(1, 4)):  # 1 token: no TPOT
            t += rng.random() * rng.choice([1e-3, 0.1, 3.0])
            times.append(t)
        scheduled = rng.choice([None, arrival + rng.random() * 0.5])
        finished = rng.choice([None, times[-1] + rng.random() * 1e-3])  # None: the last token
        out.append(RequestRecord(i, "finished", arrival, scheduled, tuple(times), finished, 8,
                                 len(times)))
    return out


def test_latencies_are_the_properties_floats_exactly():
    for seed in range(20):
        done = _records(seed, 40)
        lat = request_arrays.latencies_s(done)
        assert lat["ttft"].tolist() == [r.ttft_s for r in done]
        assert lat["e2el"].tolist() == [r.e2el_s for r in done]
        assert lat["tpot"].tolist() == [r.tpot_s for r in done if r.tpot_s is not None]
        assert lat["queue"].tolist() == [r.queue_s for r in done if r.queue_s is not None]


def test_the_busiest_second_is_counted_alike_over_a_short_and_a_long_span():
    """Per-second counts (a short run) and the occupied seconds alone (a span of 1e9 s) agree."""
    done = [RequestRecord(i, "finished", t, t, (t + 0.1, t + 0.15), t + 0.2, 8, 2)
            for i, t in enumerate(x / 10 for x in range(50))]  # 5 s: counted per second
    short = summarize(done, [], duration_s=10.0)
    far = RequestRecord(99, "finished", 1e9, 1e9, (1e9 + 0.5,), 1e9 + 0.5, 8, 1)
    long = summarize([*done, far], [], duration_s=1e9)
    assert short["max_output_tokens_per_s"] == long["max_output_tokens_per_s"] == 20
