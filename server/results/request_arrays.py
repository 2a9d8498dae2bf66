"""A run's records (records.RequestRecord, StepRecord) as arrays, for its summary: a simulated hour
has 18,000 requests, 26,000 step records and a million token times, too many to go over one
property at a time."""

from __future__ import annotations

import functools
import itertools
import math
from collections.abc import Iterable, Sequence
from operator import attrgetter, is_not, itemgetter
from typing import Any

import numpy as np


def token_times(requests: Sequence[Any]) -> tuple[np.ndarray, np.ndarray]:
    """Every request's token times end to end, and which request each belongs to (by position)."""
    counts = np.fromiter(map(len, (r.token_times_s for r in requests)), np.int64, len(requests))
    times = np.fromiter(itertools.chain.from_iterable(r.token_times_s for r in requests),
                        np.float64, int(counts.sum()))
    return times, np.repeat(np.arange(len(requests)), counts)


class RunTokens:
    """A run's token times from where they came: the token_runs of each of `ran` (Requests, in
    `requests`' order), [first, end) ranges of steps whose end times are `step_end_s` (a
    recorder's: a record's token_times_s is step_end_s[first:end] run after run). Gathered by
    index, not float by float from the records, and counted per step, not sorted token by token:
    where step_end_s goes back (the simulated hour's last step ends an ulp before the one
    before it), its 36,000 steps are sorted, not its million tokens. A run reaching outside
    step_end_s, or a step ending at NaN or below zero: from `requests`' token_times_s, and
    np.sort."""

    def __init__(self, step_end_s: Sequence[float], ran: Iterable[Any], requests: Sequence[Any]
                 ) -> None:
        runs = [r.token_runs for r in ran]
        self._per_request = np.fromiter(map(len, runs), np.int64, len(runs))
        bounds = np.fromiter(itertools.chain.from_iterable(itertools.chain.from_iterable(runs)),
                             np.int64, 2 * int(self._per_request.sum())).reshape(-1, 2)
        self._first, self._end = bounds[:, 0], bounds[:, 1]
        self._ends_s = np.asarray(step_end_s, dtype=np.float64)
        self._requests = requests
        self._inside = not ((self._first < 0) | (self._end < self._first)
                            | (self._end > len(self._ends_s))).any()
        ends = self._ends_s
        # Per step, the same floats and counts as np.sort's (NaN: one a token; -0.0: np.sort's)
        self._per_step = self._inside and not (np.isnan(ends) | np.signbit(ends)).any()
        self._clocked = self._per_step and bool((ends[1:] >= ends[:-1]).all())
        self._times: tuple[np.ndarray, np.ndarray, tuple[np.ndarray, np.ndarray]] | None = None
        self._counts: tuple[np.ndarray, np.ndarray] | None = None
        self._with_tokens: tuple[np.ndarray, ...] | None = None

    def counts(self) -> tuple[np.ndarray, np.ndarray]:
        """sorted_counts of every token time: a run's clock adds up its runs per step (36,000
        steps), not its million tokens. Made once (the picture's panels, then times())."""
        if not self._per_step:
            return self.times()[2]
        if self._counts is None:
            per_step = _covering(self._first, self._end, len(self._ends_s) + 1)[:-1]
            held = np.flatnonzero(per_step)
            ends_s, counts = self._ends_s[held], per_step[held]
            if not self._clocked:  # a clock that went back: its steps in order of their ends
                order = np.argsort(ends_s)  # equal ends: equal bits (no -0.0)
                ends_s, counts = ends_s[order], counts[order]
            self._counts = sorted_counts(ends_s, counts)
        return self._counts

    def times(self) -> tuple[np.ndarray, np.ndarray, tuple[np.ndarray, np.ndarray]]:
        """token_times(requests)'s two arrays, and counts()."""
        if self._times is None:
            times, owner = self._gathered() if self._inside else token_times(self._requests)
            ranked = self.counts() if self._per_step else sorted_counts(np.sort(times))
            self._times = (times, owner, ranked)
        return self._times

    def itls(self) -> np.ndarray:
        """itls(*times()[:2]), the same floats in the same order, without the million token
        times and their owners: within a run, the gaps between its steps' ends (np.diff of
        step_end_s); between two runs of one request, its tokens' gap across them."""
        if not self._inside:
            return itls(*self.times()[:2])
        first, end, joined, step_gaps, across = self._runs_with_tokens()
        sizes = end - first - 1
        sizes[joined] += 1  # and the gap to its next run, last
        at, starts = _spans(first, sizes, len(self._ends_s))
        gaps = step_gaps[at]
        gaps[starts[joined] + sizes[joined] - 1] = across
        return gaps

    def itl_counts(self) -> tuple[np.ndarray, np.ndarray] | None:
        """sorted_counts(np.sort(itls())), counted per step (the runs holding it and the next)
        with the gaps across runs, not sorted gap by gap; None where times() sorts its tokens."""
        if not self._per_step:
            return None
        first, end, joined, step_gaps, across = self._runs_with_tokens()
        n = len(self._ends_s)
        held_on = _covering(first, end - 1, n)[:n - 1]  # the runs holding steps s and s + 1
        step = np.flatnonzero(held_on)
        gaps = np.concatenate((step_gaps[step], across))
        counts = np.concatenate((held_on[step], np.ones(len(joined), np.int64)))
        order = np.argsort(gaps)  # equal gaps are equal bits (no -0.0): any order
        return sorted_counts(gaps[order], counts[order])

    def first_last_s(self) -> tuple[np.ndarray, np.ndarray] | None:
        """Each request's first and last token times (its record's token_times_s[0] and [-1]),
        from the steps' ends, not read from 18,000 tuples; None unless every request has a
        token inside step_end_s."""
        if not self._inside:
            return None
        first, end, joined = self._runs_with_tokens()[:3]
        begins = np.ones(len(first), dtype=bool)
        begins[joined + 1] = False  # a request's runs with tokens: from one joined to none before
        starts = np.flatnonzero(begins)
        if not len(starts) or len(starts) != len(self._per_request):  # a request without a token
            return None
        lasts = np.append(starts[1:], len(first)) - 1
        return self._ends_s[first[starts]], self._ends_s[end[lasts] - 1]

    def _runs_with_tokens(self) -> tuple[np.ndarray, ...]:
        """The runs' first and end steps, those without tokens left out; the runs i whose
        request's next run is i + 1; each step's gap to the next (np.diff of step_end_s, then
        0.0); and the gaps from each such run's last token to its request's next run's first
        (made once: itls(), then itl_counts())."""
        if self._with_tokens is None:
            kept = self._end > self._first
            first, end, owner = self._first[kept], self._end[kept], self._run_owner[kept]
            joined = np.flatnonzero(owner[1:] == owner[:-1])
            across = self._ends_s[first[joined + 1]] - self._ends_s[end[joined] - 1]
            self._with_tokens = (first, end, joined, np.append(np.diff(self._ends_s), 0.0), across)
        return self._with_tokens

    @functools.cached_property
    def _run_owner(self) -> np.ndarray:
        """Which request (by position) each run belongs to."""
        return np.repeat(np.arange(len(self._per_request)), self._per_request)

    def _gathered(self) -> tuple[np.ndarray, np.ndarray]:
        lengths = self._end - self._first
        step, _ = _spans(self._first, lengths, len(self._ends_s))
        return self._ends_s[step], np.repeat(self._run_owner, lengths)


def _spans(first: np.ndarray, sizes: np.ndarray, num_steps: int) -> tuple[np.ndarray, np.ndarray]:
    """The steps first[i], first[i] + 1, ... (sizes[i] of them), run after run, and where each
    run's steps begin among them. 32-bit steps where they fit: half the fresh memory (its page
    faults: 1-2 ms a 9 MB array)."""
    starts = np.cumsum(sizes) - sizes
    total = int(sizes.sum())
    index = np.int32 if max(total, num_steps) < 2**31 else np.int64
    at = np.arange(total, dtype=index)
    at += np.repeat((first - starts).astype(index), sizes)  # in place: one array made
    return at, starts


def _covering(first: np.ndarray, stops: np.ndarray, n: int) -> np.ndarray:
    """For each of n steps, how many [first, stop) ranges cover it."""
    return np.cumsum(np.bincount(first, minlength=n) - np.bincount(stops, minlength=n))


def itls(times: np.ndarray, owner: np.ndarray) -> np.ndarray:
    """Gaps between consecutive tokens of the same request (RequestRecord.itls_s, pooled)."""
    return np.diff(times)[owner[1:] == owner[:-1]]


def latencies_s(done: Sequence[Any], first_last_s: tuple[np.ndarray, np.ndarray] | None = None
                ) -> dict[str, np.ndarray]:
    """Completed requests' ttft_s, tpot_s, e2el_s and queue_s (each where it is not None), and
    arrival_s, in request order: the floats RequestRecord's properties give, by the same
    operations (`first_last_s`: their first and last token times, RunTokens.first_last_s')."""
    n = len(done)
    arrival = np.fromiter(map(attrgetter("arrival_s"), done), np.float64, n)
    if first_last_s is None:
        times = list(map(attrgetter("token_times_s"), done))  # a completed request has a token
        first_last_s = (np.fromiter(map(itemgetter(0), times), np.float64, n),
                        np.fromiter(map(itemgetter(-1), times), np.float64, n))
    ended, finished = _where_given(list(map(attrgetter("finished_s"), done)))
    scheduled, first_scheduled = _where_given(list(map(attrgetter("first_scheduled_s"), done)))
    tokens = np.fromiter(map(attrgetter("num_output_tokens"), done), np.int64, n)
    ttft = first_last_s[0] - arrival
    e2el = np.where(ended, finished, first_last_s[1]) - arrival
    many = tokens >= 2  # tpot: None below 2 tokens
    return {"ttft": ttft, "tpot": (e2el[many] - ttft[many]) / (tokens[many] - 1), "e2el": e2el,
            "queue": (first_scheduled - arrival)[scheduled], "arrival": arrival}


def _where_given(values: list[float | None]) -> tuple[np.ndarray, np.ndarray]:
    """Which values are not None, and the values (None: NaN)."""
    given = np.fromiter(map(is_not, values, itertools.repeat(None)), bool, len(values))
    if given.all():  # floats (or ints) alone: fromiter's float() of each, np.array's own
        return given, np.fromiter(values, np.float64, len(values))
    return given, np.array(values, dtype=np.float64)


STEP_INTS = ("num_steps", "batch_size", "num_prefill_tokens", "kv_bytes", "num_preemptions")


def step_columns(steps: Sequence[Any], ints: Sequence[str] = STEP_INTS) -> dict[str, np.ndarray]:
    """The steps' `ints` (int64) and start_s, end_s (float64), one array each."""
    n = len(steps)
    cols = {name: np.fromiter(map(attrgetter(name), steps), np.int64, n) for name in ints}
    for name in ("start_s", "end_s"):
        cols[name] = np.fromiter(map(attrgetter(name), steps), np.float64, n)
    return cols


def order_stats(values: Any, percentiles: Sequence[float],
                counted: tuple[np.ndarray, np.ndarray] | None = None) -> tuple[float, list[float]]:
    """np.median(values) and np.percentile(values, p) for each p (its default, linear method):
    the same floats, by numpy's own operations, from one sorted copy (an hour's million ITLs:
    numpy partitioned a fresh copy per call, and its percentile's np.unique imported numpy.ma,
    10-20 ms). tests/test_request_arrays.py holds them to numpy's. Empty `values`: 0 (vLLM's
    np.mean(x or 0)). The same floats for float64 or integer `values` and each p within 0..100
    (callers validate them: run_config, rebuild); elsewhere it differs from numpy: float32 values
    (numpy computes in float32: ~1e-8), p outside 0..100 (numpy raises, this clamps), a NaN p
    (IndexError), and the sign of a 0.0 between -0.0 and 0.0. `counted`: `values`' sorted_counts
    (no NaN among them), to read the ranks from instead of sorting `values`."""
    if counted is not None and len(counted[0]):
        distinct, past = counted[0], np.cumsum(counted[1])  # the rank past each value's last
        n = int(past[-1])

        def ranked(at: Any) -> Any:
            return distinct[np.searchsorted(past, np.asarray(at) % n, side="right")]
    else:
        array = np.sort(np.asarray(values)) if len(values) else np.zeros(1)
        n, ranked = len(array), array.__getitem__
    if np.isnan(ranked(n - 1)):  # a NaN sorts last: numpy's answers are NaN
        return math.nan, [math.nan] * len(percentiles)
    median = np.mean(ranked(np.arange((n - 1) // 2, n // 2 + 1)))  # the middle one, or two
    virtual = (n - 1) * np.true_divide(np.asanyarray(list(percentiles)), 100)
    below = np.floor(virtual)
    above = below + 1
    below[virtual >= n - 1], above[virtual >= n - 1] = -1, -1
    below[virtual < 0], above[virtual < 0] = 0, 0
    below, above = below.astype(np.intp), above.astype(np.intp)
    gamma = virtual - below
    a, b = ranked(below), ranked(above)
    diff = b - a
    ranks = np.add(a, diff * gamma)  # numpy's _lerp: from the nearer end
    np.subtract(b, diff * (1 - gamma), out=ranks, where=gamma >= 0.5, casting="unsafe")
    return float(median), ranks.tolist()


def std_overwriting(x: np.ndarray) -> float:
    """float(np.std(x)) for a float64 array, by numpy's own operations (its _var: the sum over
    the count, the deviations squared and summed, over the count, the root), with `x` itself
    overwritten by the deviations: a million ITLs make no second 9 MB array (its page faults:
    more than the arithmetic). tests/test_request_arrays.py holds it to np.std's bits."""
    mean = np.add.reduce(x, axis=None, keepdims=True)
    np.true_divide(mean, np.intp(x.size), out=mean, casting="unsafe")
    np.subtract(x, mean, out=x)
    np.square(x, out=x)
    return float(np.sqrt(np.add.reduce(x, axis=None) / np.intp(x.size)))


def sorted_counts(sorted_times: np.ndarray, counts: np.ndarray | None = None
                  ) -> tuple[np.ndarray, np.ndarray]:
    """The distinct values of a sorted array and how often each occurs (a step's tokens share its
    end time: an hour's million token times are 36,000 values); `counts`: how often each of
    `sorted_times` occurs, if they are so counted already."""
    if not len(sorted_times):
        return sorted_times, np.zeros(0, np.int64)
    first = np.flatnonzero(np.concatenate(([True], sorted_times[1:] != sorted_times[:-1])))
    if counts is not None:
        return sorted_times[first], np.add.reduceat(counts, first)
    return sorted_times[first], np.diff(np.append(first, len(sorted_times)))


def emits_tokens(sorted_times_s: np.ndarray, starts: np.ndarray, ends: np.ndarray
                  ) -> np.ndarray:
    """Per step (`starts`, `ends`: its start_s, end_s): a token time falls in (start_s, end_s]
    (tokens are stamped with their step's end)."""
    if not len(sorted_times_s):
        return np.zeros(len(starts), dtype=bool)
    i = np.searchsorted(sorted_times_s, starts, side="right")
    nxt = sorted_times_s[np.minimum(i, len(sorted_times_s) - 1)]
    return (i < len(sorted_times_s)) & (nxt <= ends)
