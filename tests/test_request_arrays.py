"""The summary's latencies as arrays (request_arrays.latencies_s): exactly the floats the
records' properties give, None left out as the properties leave it."""

from __future__ import annotations

import collections
import math
import random
import types

import numpy as np
from batchsim.server.results import request_arrays
from batchsim.server.results.metrics import summarize
from batchsim.server.results.records import RequestRecord, StepRecord
from batchsim.server.results.timeline import output_rate


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


def test_order_stats_are_numpys_median_and_percentiles_exactly():
    rng = np.random.default_rng(5)
    percentiles = [0, 1, 33.3, 50, 66.7, 90, 95, 99, 99.9, 99.99, 100]
    for trial in range(600):
        n = int(rng.integers(1, 40)) if trial % 50 else 10_001
        values = [rng.integers(0, 50, n), rng.random(n) * 10.0 ** rng.integers(-6, 7),
                  np.round(rng.random(n), 2)][trial % 3]  # ints, spans, ties
        median, ranks = request_arrays.order_stats(values, percentiles)
        assert median == float(np.median(values))
        assert ranks == [float(np.percentile(values, p)) for p in percentiles]
        counted = request_arrays.sorted_counts(np.sort(values))  # read by rank, not sorted
        assert request_arrays.order_stats(None, percentiles, counted) == (median, ranks)
    assert request_arrays.order_stats((), [50, 99]) == (0.0, [0.0, 0.0])  # vLLM's np.mean(x or 0)
    median, ranks = request_arrays.order_stats([math.nan, 1.0], [50])  # NaN: as numpy's
    assert math.isnan(median) and math.isnan(ranks[0])


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


def test_sorted_counts_and_step_columns():
    values, counts = request_arrays.sorted_counts(np.array([0.5, 0.5, 1.0, 2.0, 2.0, 2.0]))
    assert values.tolist() == [0.5, 1.0, 2.0] and counts.tolist() == [2, 1, 3]
    assert [len(a) for a in request_arrays.sorted_counts(np.zeros(0))] == [0, 0]
    steps = [StepRecord(i, i * 0.5, i * 0.5 + 0.25, 1 + i % 2, i, 3 * i, 1, 2, 0, 100 * i, None,
                        4, 64, i % 3) for i in range(5)]
    col = request_arrays.step_columns(steps)
    assert col["num_steps"].tolist() == [s.num_steps for s in steps]
    assert col["kv_bytes"].tolist() == [s.kv_bytes for s in steps]
    assert col["end_s"].tolist() == [s.end_s for s in steps]


def _reference_peaks(done: list[RequestRecord]) -> tuple[float, int]:
    """The busiest second's tokens and requests, one record and one token at a time."""
    t0 = min(r.arrival_s for r in done)
    ends = [r.arrival_s + r.e2el_s for r in done]
    n = math.ceil(max(ends) - t0) + 1
    tokens = collections.Counter(int(t - t0) for r in done for t in r.token_times_s)
    active = [sum(int(r.arrival_s - t0) <= b <= int(e - t0) for r, e in zip(done, ends))
              for b in range(n)]
    return float(max(tokens.values())), max(active)


def test_peaks_and_batch_view_match_the_records_one_at_a_time():
    """Token times shared by many requests (a step's), unfinished requests left out of the peaks
    and counted in the generation tokens: the vectorized summary gives the per-record values."""
    for seed in range(10):
        rng = random.Random(seed)
        ends = sorted(rng.random() * 30 for _ in range(40))  # the steps' end times
        records = []
        for i in range(60):
            first = rng.randrange(len(ends) - 1)
            times = tuple(ends[first:first + rng.randint(1, 6)])
            status = rng.choice(["finished", "finished", "unfinished"])
            arrival = max(0.0, times[0] - rng.random())
            records.append(RequestRecord(i, status, arrival, arrival, times,
                                         times[-1] if status == "finished" else None, 8,
                                         len(times)))
        steps = [StepRecord(i, start, end, 1, rng.randint(0, 3), rng.choice([0, 16]), 1, 2, 0,
                            rng.randint(0, 10**6), None, 4, 64, 0)
                 for i, (start, end) in enumerate(zip([0.0, *ends], ends))]
        s = summarize(records, steps, duration_s=30.0)
        done = [r for r in records if r.status == "finished"]
        assert (s["max_output_tokens_per_s"], s["max_concurrent_requests"]) == \
            _reference_peaks(done)
        assert s["generation_tokens"] == sum(r.num_output_tokens for r in records)
        assert s["prompt_tps"] == 16 * sum(x.num_prefill_tokens > 0 for x in steps) / sum(
            x.duration_s for x in steps if x.num_prefill_tokens > 0)
        assert s["peak_kv_bytes"] == max(x.kv_bytes for x in steps)


def _runs_and_records(rng: random.Random, ends: list[float], n: int):
    """Requests' token runs over `ends` (preempted: several runs; speculative: one step repeated)
    and their records, whose token_times_s are ends[first:end] run after run, as a recorder's."""
    ran, records = [], []
    for i in range(n):
        runs, step = [], rng.randrange(len(ends))
        for _ in range(rng.randint(1, 3)):
            end = min(len(ends), step + rng.randint(0, 5))
            runs += [[step, end]] * rng.choice([1, 1, 2])
            step = min(len(ends) - 1, end + rng.randint(0, 3))
        times = tuple(t for first, end in runs for t in ends[first:end])
        ran.append(types.SimpleNamespace(token_runs=runs))
        status = "finished" if times else "unfinished"
        records.append(RequestRecord(i, status, 0.0, None, times, None, 4, len(times)))
    return ran, records


def test_run_tokens_are_the_records_times_and_sorted_counts():
    """Gathered from the token runs: the records' own arrays (token_times), and the sorted_counts
    of np.sort's, byte for byte, on a clock with ties, a clock that goes back (np.sort's way) and
    a run past the last step (the records' way); the output rate binned from those counts."""
    rng = random.Random(3)
    for trial in range(200):
        ends = sorted(rng.choice([1.0, 2.5, rng.random() * 100]) for _ in range(rng.randint(1, 30)))
        if trial % 7 == 1:
            ends.reverse()
        if trial % 5 == 3 and len(ends) > 1:  # the last step an ulp before the one before it
            ends[-1] = math.nextafter(ends[-2], -math.inf)
        if trial % 13 == 4:  # a clock at -0.0 (np.sort's, with 0.0) or below zero
            ends[rng.randrange(len(ends))] = rng.choice([-0.0, 0.0, -1.0])
        ran, records = _runs_and_records(rng, ends, rng.randint(1, 12))
        if trial % 11 == 2:
            ran[0].token_runs.append([len(ends), len(ends) + 2])  # nothing recorded there
        tokens = request_arrays.RunTokens(ends, ran, records)
        counts = tokens.counts()  # first: before times, from the runs alone
        times, owner, ranked = tokens.times()
        assert all(a.tobytes() == b.tobytes() for a, b in zip(counts, ranked))
        want_times, want_owner = request_arrays.token_times(records)
        assert times.tobytes() == want_times.tobytes() and times.dtype == want_times.dtype
        assert owner.tobytes() == want_owner.tobytes() and owner.dtype == want_owner.dtype
        for got, want in zip(ranked, request_arrays.sorted_counts(np.sort(want_times))):
            assert got.tobytes() == want.tobytes() and got.dtype == want.dtype
        end_s = max(ends) * rng.choice([0.5, 1.0])  # tokens past the last bin: left out alike
        for got, want in zip(output_rate(ranked, end_s), output_rate(want_times, end_s)):
            assert np.array_equal(got, want) and np.asarray(got).dtype == np.asarray(want).dtype
        itls = request_arrays.RunTokens(ends, ran, records).itls()
        want_itls = request_arrays.itls(want_times, want_owner)
        assert itls.tobytes() == want_itls.tobytes() and itls.dtype == want_itls.dtype
        first_last = request_arrays.RunTokens(ends, ran, records).first_last_s()
        if first_last is not None:  # every request has a token: its record's first and last
            for got, index in zip(first_last, (0, -1)):
                want = np.array([r.token_times_s[index] for r in records], dtype=np.float64)
                assert got.tobytes() == want.tobytes()
            got_lat, want_lat = request_arrays.latencies_s(records, first_last), \
                request_arrays.latencies_s(records)
            assert all(got_lat[k].tobytes() == want_lat[k].tobytes() for k in want_lat)
        else:
            assert not all(r.token_times_s for r in records) or trial % 11 == 2
        counted = request_arrays.RunTokens(ends, ran, records).itl_counts()
        if counted is not None:  # per step: np.sort's sorted_counts of the ITLs, byte for byte
            for got, want in zip(counted, request_arrays.sorted_counts(np.sort(want_itls))):
                assert got.tobytes() == want.tobytes() and got.dtype == want.dtype
        done = [r for r in records if r.status == "finished"]
        if done:  # the summary from them is the one from the records
            want = summarize(records, [], duration_s=9.0)
            assert summarize(records, [], duration_s=9.0, run_tokens=request_arrays.RunTokens(
                ends, ran, records)) == want


def test_a_clock_that_goes_back_is_counted_per_step_not_per_token():
    """The simulated hour's last step ends an ulp before the one before it: its token times'
    sorted_counts are still counted per step (the steps sorted), not by sorting every token
    time (a million: 30 ms of the hour's summary), and are np.sort's."""
    ends = [0.5 * i for i in range(1, 60)]
    ends[-1] = math.nextafter(ends[-2], -math.inf)
    ran, records = _runs_and_records(random.Random(5), ends, 40)
    tokens = request_arrays.RunTokens(ends, ran, records)
    counts = tokens.counts()
    assert tokens._times is None  # nothing gathered token by token
    want = request_arrays.sorted_counts(np.sort(request_arrays.token_times(records)[0]))
    assert all(a.tobytes() == b.tobytes() and a.dtype == b.dtype for a, b in zip(counts, want))


def test_a_finished_runs_summary_takes_its_itls_from_the_steps_not_the_token_times():
    """Every request finished: the summary's ITLs are RunTokens.itls (the steps' end-to-end
    gaps, and one across a request's runs), its counts RunTokens.counts: the million token
    times and their owners are not gathered (20-30 ms of the simulated hour's summary), and the
    summary is the records' own."""
    rng = random.Random(8)
    ends = sorted(rng.random() * 50 for _ in range(40))
    ran, records = _runs_and_records(rng, ends, 30)
    kept = [i for i, r in enumerate(records) if r.status == "finished"]
    ran, records = [ran[i] for i in kept], [records[i] for i in kept]
    assert any(len(r.token_runs) > 1 for r in ran)  # a gap across runs is among them
    tokens = request_arrays.RunTokens(ends, ran, records)
    assert summarize(records, [], duration_s=9.0, run_tokens=tokens) \
        == summarize(records, [], duration_s=9.0)
    assert tokens._times is None
    none = request_arrays.RunTokens([], [], [])  # a run stopped before any request came
    assert summarize([], [], duration_s=0.0, run_tokens=none) == summarize([], [], duration_s=0.0)


def test_std_overwriting_is_numpys_std_bit_for_bit():
    """The ITLs' std with the array itself for the deviations: np.std's float exactly (sums
    of every length around numpy's pairwise blocks, spans, ties, a NaN or an infinity)."""
    rng = np.random.default_rng(4)
    for trial in range(300):
        n = int(rng.integers(1, 3000)) if trial % 100 else 1_100_000
        values = [rng.random(n), rng.standard_normal(n) * 10.0 ** rng.integers(-8, 9),
                  np.round(rng.random(n), 3) * 1e6][trial % 3]
        if trial % 37 == 5:
            values[rng.integers(n)] = [math.nan, math.inf, -math.inf][trial % 3]
        with np.errstate(invalid="ignore"):
            want = np.float64(np.std(values))
            got = np.float64(request_arrays.std_overwriting(values.copy()))
        assert got.tobytes() == want.tobytes()
