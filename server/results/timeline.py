"""timeline.png: a run's course drawn from its records. Requests running and waiting, decode
batch and tokens per step, KV bytes against the budget with the overrun marked (the first step
where a request waited for memory), preemptions, and output tokens per second. A long run's steps
are aggregated into time bins (mean, and the range as a band), so an hour of 44,000 plans reads
like ten seconds of 40."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from operator import attrgetter
from typing import Any

import numpy as np
from batchsim.scheduler.pool_geometry import KV_STEP
from batchsim.server.results import request_arrays
from batchsim.server.results.json_text import from_jsonable_float
from batchsim.server.results.records import RequestRecord, StepRecord

TIMELINE = "timeline.png"
MAX_POINTS = 600  # bins across the run when it has more steps than this


@dataclasses.dataclass(frozen=True)
class Limits:
    """What the run allowed: the KV budget and the scheduler's per-step limits (None: unknown)."""

    kv_budget_bytes: int | None = None
    max_num_seqs: int | None = None
    max_num_batched_tokens: int | None = None


PANEL_INTS = (*request_arrays.STEP_INTS, "num_running", "num_waiting")  # what the panels read


def overrun_index(requests: Sequence[RequestRecord], steps: Sequence[StepRecord],
                  limits: Limits, col: dict[str, np.ndarray] | None = None) -> int | None:
    """The first step where a request waited for memory: one was preempted, or a queued request
    was passed over by a step with room for another sequence (after those it admitted) and a
    KV_STEP of tokens, so only memory held it back (not counting the first step after its
    arrival, which may have been planned before it). Without the scheduler's limits: the first
    preemption. `col`: the steps' PANEL_INTS columns (request_arrays.step_columns), if the caller
    has them."""
    col = col or request_arrays.step_columns(steps, PANEL_INTS)
    preempted = np.flatnonzero(col["num_preemptions"])
    first = int(preempted[0]) if preempted.size else None
    seqs, tokens = limits.max_num_seqs, limits.max_num_batched_tokens
    if not steps or seqs is None or tokens is None:
        return first
    starts = col["start_s"]
    running_before = np.concatenate(([0], col["num_running"][:-1]))
    admitted = admitted_per_step(steps, requests, starts)
    used = col["batch_size"] + col["num_prefill_tokens"]
    room = (running_before + admitted < seqs) & (used + KV_STEP <= tokens)
    # next_room[i]: the first step >= i with room (len(steps): none)
    idx = np.where(room, np.arange(len(steps)), len(steps))
    next_room = np.minimum.accumulate(idx[::-1])[::-1]
    # The steps planned while each request waited: after it arrived, before it ran (all requests
    # at once: an hour has 18,000). +1: the first step after an arrival may have been planned
    # before it (a real engine plans the next step while one runs), so only a later step passing
    # it over is memory.
    n = len(steps)
    arrived = np.fromiter((r.arrival_s for r in requests), np.float64, len(requests))
    ran_s = _ran_s(requests)
    lo = np.minimum(np.searchsorted(starts, arrived, side="right") + 1, n)
    hi = np.where(np.isnan(ran_s), n, np.searchsorted(starts, ran_s, side="left"))
    passed = np.append(next_room, n)[lo]  # n: none
    passed = passed[passed < hi]
    if passed.size and (first is None or passed.min() < first):
        first = int(passed.min())
    return first


def admitted_per_step(steps: Sequence[StepRecord], requests: Sequence[RequestRecord],
                      starts: np.ndarray | None = None) -> np.ndarray:
    """Requests each step admitted, the one count of the timeline's overrun and the sweep's
    memory waits: the scheduler's (num_admitted: new requests and preempted ones back); in
    records written before it, those the step first ran (first_scheduled_s is its start; a
    preempted request's return is missed). The prefill count is no measure of it under chunked
    prefill: a prompt's later chunks prefill requests admitted steps before."""
    if steps:
        try:  # one pass (None, in older records, fails it)
            return np.fromiter(map(attrgetter("num_admitted"), steps), np.int64, len(steps))
        except TypeError:
            pass
    if starts is None:
        starts = np.array([s.start_s for s in steps])
    firsts = np.fromiter((r.first_scheduled_s for r in requests
                          if r.first_scheduled_s is not None), np.float64)
    at = np.searchsorted(starts, firsts)
    ok = at < len(steps)
    ok[ok] = starts[at[ok]] == firsts[ok]
    return np.bincount(at[ok], minlength=len(steps))


def _ran_s(requests: Sequence[RequestRecord]) -> np.ndarray:
    """When each request first ran (else left): NaN if neither."""
    first = np.array([r.first_scheduled_s for r in requests], dtype=np.float64)  # None: NaN
    left = np.array([r.finished_s for r in requests], dtype=np.float64)
    return np.where(np.isnan(first), left, first)


class _Series:
    """The steps' columns, per step or per time bin (mean, low, high)."""

    def __init__(self, steps: Sequence[StepRecord], col: dict[str, np.ndarray] | None = None
                 ) -> None:
        col = col or request_arrays.step_columns(steps, PANEL_INTS)
        self.t = col["end_s"]
        batch = col["batch_size"]
        self._cols = {name: values.astype(np.float64) for name, values in (
            ("running", col["num_running"]), ("waiting", col["num_waiting"]), ("batch", batch),
            ("tokens", batch + col["num_prefill_tokens"]), ("kv", col["kv_bytes"]),
            ("preempted", col["num_preemptions"]))}
        self.binned = len(steps) > MAX_POINTS
        if self.binned:
            edges = np.linspace(col["start_s"][0], col["end_s"][-1], MAX_POINTS + 1)
            self._bin = np.clip(np.searchsorted(edges, self.t, side="right") - 1, 0, MAX_POINTS - 1)
            self._filled = np.bincount(self._bin, minlength=MAX_POINTS) > 0
            self.x = ((edges[:-1] + edges[1:]) / 2)[self._filled]
            # Where each filled bin's steps begin, if the steps come in time order (a run's do).
            ordered = (self._bin[1:] >= self._bin[:-1]).all()
            self._starts = np.flatnonzero(np.diff(self._bin, prepend=-1)) if ordered else None
        else:
            self.x = self.t

    def get(self, name: str, how: str = "mean") -> np.ndarray:
        v = self._cols[name]
        if not self.binned:
            return v
        if how == "sum":
            return np.bincount(self._bin, v, MAX_POINTS)[self._filled]
        if how == "mean":
            n = np.bincount(self._bin, minlength=MAX_POINTS)
            return (np.bincount(self._bin, v, MAX_POINTS) / np.maximum(n, 1))[self._filled]
        extreme = np.maximum if how == "max" else np.minimum
        if self._starts is not None:  # bin by bin: ufunc.at took 0.9 ms a call, in the drawing
            return extreme.reduceat(v, self._starts)  # child, after the run: the same values
        out = np.full(MAX_POINTS, -np.inf if how == "max" else np.inf)
        extreme.at(out, self._bin, v)
        return out[self._filled]


def output_rate(times_s: np.ndarray | tuple[np.ndarray, np.ndarray], end_s: float,
                step_s: float = 0.0) -> tuple[np.ndarray, np.ndarray, float]:
    """Output tokens per second (`times_s`: every token's time, or request_arrays.sorted_counts of
    them: a step's tokens binned at once) in bins of 1 s (a wider 1-2-5 width on long runs or for
    steps over half a second (`step_s`: their median), narrower on runs under 20 s): bin centers,
    rates and the bin width."""
    width_s = bin_width_s(max(end_s / MAX_POINTS if end_s > MAX_POINTS else min(1.0, end_s / 20),
                              2 * step_s))  # steps longer than a bin would alias
    edges = np.arange(0.0, end_s + width_s, width_s)
    times_s, each = times_s if isinstance(times_s, tuple) else (times_s, None)
    counts, _ = np.histogram(times_s, edges, weights=each)  # integer weights: integer counts
    return (edges[:-1] + edges[1:]) / 2, counts / width_s, width_s


def bin_width_s(at_least_s: float) -> float:
    """The smallest 1, 2 or 5 times a power of ten that is at least `at_least_s`."""
    if not at_least_s > 0:
        return 1.0
    power = 10.0 ** np.floor(np.log10(at_least_s))
    return float(next(m * power for m in (1, 2, 5, 10) if m * power >= at_least_s * (1 - 1e-9)))


@dataclasses.dataclass(frozen=True)
class Panels:
    """What timeline.png shows, from a run's records: the steps' series, the overrun and the
    output rate (a drawing process is sent this, not the records)."""

    title: str
    limits: Limits
    series: _Series | None = None  # None: no steps recorded
    overrun_s: float | None = None  # when the first step that waited for memory started
    rate: tuple[np.ndarray, np.ndarray, float] | None = None  # output_rate's (x_s, /s, width_s)


def timeline_panels(requests: Sequence[RequestRecord], steps: Sequence[StepRecord],
                    limits: Limits, title: str,
                    token_times_s: np.ndarray | tuple[np.ndarray, np.ndarray] | None = None,
                    col: dict[str, np.ndarray] | None = None) -> Panels:
    """The run's timeline, ready to draw (`token_times_s`: request_arrays.token_times's times or
    their sorted_counts, `col`: the steps' PANEL_INTS columns, if the caller has them)."""
    if not steps:
        return Panels(title, limits)
    col = col or request_arrays.step_columns(steps, PANEL_INTS)
    first = overrun_index(requests, steps, limits, col)
    step_s = request_arrays.order_stats((col["end_s"] - col["start_s"]) / col["num_steps"], ())[0]
    if token_times_s is None:
        token_times_s = request_arrays.token_times(requests)[0]
    overrun_s = None if first is None else steps[first].start_s
    return Panels(title, limits, _Series(steps, col), overrun_s,
                  output_rate(token_times_s, float(steps[-1].end_s), step_s))


def weights_label(dtype: str | None, quantize: int | None) -> str:
    """`float16, 4-bit weights`: the compute dtype and, for a quantized model, its weights' bits."""
    return ", ".join(x for x in (dtype, f"{quantize}-bit weights" if quantize else None) if x)


def arrival_label(workload: Mapping[str, Any]) -> str:
    """How the requests came, from a workload's fields (a WorkloadSpec's or config.yaml's):
    `poisson at 5 req/s`, `all at once`, `closed loop of 8`."""
    arrival, rate = workload.get("arrival"), from_jsonable_float(workload.get("request_rate"))
    came = f"{arrival} at {rate:g} req/s" if isinstance(rate, (int, float)) else str(arrival or "?")
    if arrival == "closed":
        came = f"closed loop of {workload.get('concurrency')}"
    elif arrival == "trace":
        scale = (workload.get("trace") or {}).get("time_scale", 1.0)
        came = "trace replay" + (f", time x{scale:g}" if scale != 1.0 else "")
    elif rate == float("inf"):
        came = "all at once"
    elif arrival == "ramp":
        came = f"ramp from {rate:g} to {workload.get('ramp_end_rate') or rate:g} req/s"
    return came


def executor_label(executor: str | None, engine: str | None,
                   device_profile: str | None = None) -> str:
    """How titles and headers name what ran: a simulated run `sim (PROFILE, engine NAME)`, the
    device profile where the caller knows it and the serving engine whose costs it priced; else
    the executor alone (a real run is batchsim's own engine)."""
    if executor != "sim":
        return executor or "?"
    where = ", ".join(x for x in (device_profile, f"engine {engine or 'batchsim'}") if x)
    return f"sim ({where})"


def run_title(model: str, dtype: str | None, quantize: int | None, executor: str | None,
              device_profile: str | None, engine: str | None,
              env: Mapping[str, Any] | None = None) -> str:
    """What ran where, for the picture's title: a simulated run names its device profile and the
    serving engine whose costs it priced, a real one MLX's backend and device (from `env`, the
    environment a summary records)."""
    weights = weights_label(dtype, quantize)
    where = executor_label(executor, engine, device_profile or "this machine")
    if executor == "mlx" and env and env.get("backend"):  # fake and sim ran on no device
        device = env.get("device_name")
        where = f"{where} ({env['backend']}{f', {device}' if device else ''})"
    return f"{model} ({weights}) on {where}" if weights else f"{model} on {where}"


def timeline_title(what: str, workload: Mapping[str, Any], num_requests: int) -> str:
    """The timeline's title: what ran where (run_title), then the traffic."""
    return (f"{what}\nworkload {workload.get('name', '?')}: {num_requests} requests, "
            f"{arrival_label(workload)}")
