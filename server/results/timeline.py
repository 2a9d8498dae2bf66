"""timeline.png: a run's course drawn from its records. Requests running and waiting, decode
batch and tokens per step, KV bytes against the budget with the overrun marked (the first step
where a request waited for memory), preemptions, and output tokens per second. A long run's steps
are aggregated into time bins (mean, and the range as a band), so an hour of 44,000 plans reads
like ten seconds of 40."""

from __future__ import annotations

import dataclasses
import itertools
import math
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
from batchsim.scheduler.pool_geometry import KV_STEP
from batchsim.server.results.metrics import RequestRecord, StepRecord
from batchsim.server.results.plots import figure, save_figure

TIMELINE = "timeline.png"
MAX_POINTS = 600  # bins across the run when it has more steps than this
DPI = 100
_GIB = float(1 << 30)
HEADROOM = 1.08  # y-axes reach a little past the tallest line (a line on the frame is hidden)


@dataclasses.dataclass(frozen=True)
class Limits:
    """What the run allowed: the KV budget and the scheduler's per-step limits (None: unknown)."""

    kv_budget_bytes: int | None = None
    max_num_seqs: int | None = None
    max_num_batched_tokens: int | None = None


def overrun_index(requests: Sequence[RequestRecord], steps: Sequence[StepRecord],
                  limits: Limits) -> int | None:
    """The first step where a request waited for memory: one was preempted, or a queued request
    was passed over by a step with room for another sequence (after those it admitted) and a
    KV_STEP of tokens, so only memory held it back (not counting the first step after its
    arrival, which may have been planned before it). Without the scheduler's limits: the first
    preemption."""
    preempted = [i for i, s in enumerate(steps) if s.num_preemptions]
    first = preempted[0] if preempted else None
    seqs, tokens = limits.max_num_seqs, limits.max_num_batched_tokens
    if not steps or seqs is None or tokens is None:
        return first
    starts = np.array([s.start_s for s in steps])
    running_before = np.array([0] + [s.num_running for s in steps[:-1]])
    firsts = [r.first_scheduled_s for r in requests if r.first_scheduled_s is not None]
    admitted = np.bincount(np.searchsorted(starts, firsts), minlength=len(steps) + 1)[:-1]
    used = np.array([s.batch_size + s.num_prefill_tokens for s in steps])
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
    ran_s = np.fromiter((_ran_s(r) for r in requests), np.float64, len(requests))
    lo = np.minimum(np.searchsorted(starts, arrived, side="right") + 1, n)
    hi = np.where(np.isnan(ran_s), n, np.searchsorted(starts, ran_s, side="left"))
    passed = np.append(next_room, n)[lo]  # n: none
    passed = passed[passed < hi]
    if passed.size and (first is None or passed.min() < first):
        first = int(passed.min())
    return first


def _ran_s(r: RequestRecord) -> float:
    """When a request first ran (else left): NaN if neither."""
    t = r.first_scheduled_s if r.first_scheduled_s is not None else r.finished_s
    return math.nan if t is None else t


class _Series:
    """The steps' columns, per step or per time bin (mean, low, high)."""

    def __init__(self, steps: Sequence[StepRecord]) -> None:
        cols = np.array([(s.start_s, s.end_s, s.num_running, s.num_waiting, s.batch_size,
                          s.batch_size + s.num_prefill_tokens, s.kv_bytes, s.num_preemptions)
                         for s in steps], dtype=np.float64).reshape(-1, 8)
        self.t = cols[:, 1]
        self._cols = dict(zip(("running", "waiting", "batch", "tokens", "kv", "preempted"),
                              cols[:, 2:].T))
        self.binned = len(steps) > MAX_POINTS
        if self.binned:
            edges = np.linspace(cols[0, 0], cols[-1, 1], MAX_POINTS + 1)
            self._bin = np.clip(np.searchsorted(edges, self.t, side="right") - 1, 0, MAX_POINTS - 1)
            self._filled = np.bincount(self._bin, minlength=MAX_POINTS) > 0
            self.x = ((edges[:-1] + edges[1:]) / 2)[self._filled]
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
        out = np.full(MAX_POINTS, -np.inf if how == "max" else np.inf)
        (np.maximum if how == "max" else np.minimum).at(out, self._bin, v)
        return out[self._filled]


def output_rate(requests: Sequence[RequestRecord], end_s: float, step_s: float = 0.0
                ) -> tuple[np.ndarray, np.ndarray, float]:
    """Output tokens per second in bins of 1 s (a wider 1-2-5 width on long runs or for steps
    over half a second (`step_s`: their median), narrower on runs under 20 s): bin centers, rates
    and the bin width."""
    times = np.fromiter(itertools.chain.from_iterable(r.token_times_s for r in requests),
                        np.float64)
    width = bin_width_s(max(end_s / MAX_POINTS if end_s > MAX_POINTS else min(1.0, end_s / 20),
                            2 * step_s))  # steps longer than a bin would alias
    edges = np.arange(0.0, end_s + width, width)
    counts, _ = np.histogram(times, edges)
    return (edges[:-1] + edges[1:]) / 2, counts / width, width


def bin_width_s(at_least_s: float) -> float:
    """The smallest 1, 2 or 5 times a power of ten that is at least `at_least_s`."""
    if not at_least_s > 0:
        return 1.0
    power = 10.0 ** np.floor(np.log10(at_least_s))
    return float(next(m * power for m in (1, 2, 5, 10) if m * power >= at_least_s * (1 - 1e-9)))


def draw_timeline(path: Path, requests: Sequence[RequestRecord], steps: Sequence[StepRecord],
                  limits: Limits, title: str) -> Path:
    """Write the run's timeline PNG at `path` (four panels sharing the time axis)."""
    fig = figure(figsize=(11, 10))
    axes = fig.subplots(4, 1, sharex=True)
    fig.subplots_adjust(left=0.07, right=0.92, top=0.895, bottom=0.06, hspace=0.28)
    if not steps:
        axes[0].text(0.5, 0.5, "no steps recorded", ha="center", transform=axes[0].transAxes)
        fig.suptitle(title)
        return save_figure(fig, path, dpi=DPI, tight=False)
    series = _Series(steps)
    _requests_panel(axes[0], series, limits.max_num_seqs)
    _batch_panel(axes[1], series)
    _kv_panel(axes[2], series, overrun_index(requests, steps, limits), steps, limits)
    step_s = float(np.median([s.duration_s / s.num_steps for s in steps]))
    x, rate, width = output_rate(requests, float(steps[-1].end_s), step_s)
    axes[3].plot(x, rate, color="tab:green", lw=1)
    axes[3].set_ylabel("output tok/s")
    axes[3].set_title(f"output tokens per second ({width:g}-s bins)", fontsize=9, loc="left")
    axes[3].set_xlabel("time since the run started (s)")
    how = (f"{len(steps)} step records in {MAX_POINTS} time bins: mean, band from min to max"
           if series.binned else f"{len(steps)} step records")
    fig.suptitle(f"{title}\n{how}", fontsize=10)
    for ax in fig.axes:  # twins included
        ax.grid(alpha=0.3)
        ax.set_ylim(0, max(ax.get_ylim()[1], 1e-9) * (1.0 if ax is axes[3] else HEADROOM))
    return save_figure(fig, path, dpi=DPI, tight=False, fast=True)


def _line(ax, series: _Series, name: str, label: str, color: str) -> None:
    ax.plot(series.x, series.get(name), color=color, lw=1, label=label,
            drawstyle="default" if series.binned else "steps-pre")
    if series.binned:
        ax.fill_between(series.x, series.get(name, "min"), series.get(name, "max"), color=color,
                        alpha=0.2, lw=0)


def _legend(ax, handles: list) -> None:
    """The panel's legend in one row above it, where it hides no line."""
    ax.legend(handles=handles, loc="lower left", bbox_to_anchor=(0, 1.0), ncol=len(handles),
              fontsize=8, frameon=False, borderaxespad=0.2, handlelength=1.5)


def _requests_panel(ax, series: _Series, max_num_seqs: int | None) -> None:
    _line(ax, series, "running", "running", "tab:blue")
    if max_num_seqs:  # a queue that grows under this line waits for a seat, not for memory
        ax.axhline(max_num_seqs, color="tab:blue", ls="--", lw=0.8,
                   label=f"seats (max_num_seqs {max_num_seqs})")
    ax.set_ylabel("running requests", color="tab:blue")
    right = ax.twinx()  # a queue can be 100 times the batch
    right.plot(series.x, series.get("waiting", "max"), color="tab:orange", lw=1,
               label="waiting (max per bin)" if series.binned else "waiting",
               drawstyle="default" if series.binned else "steps-pre")
    right.set_ylabel("waiting requests", color="tab:orange")
    right.set_ylim(bottom=0)
    _legend(ax, ax.get_legend_handles_labels()[0] + right.get_legend_handles_labels()[0])


def _batch_panel(ax, series: _Series) -> None:
    _line(ax, series, "batch", "decode batch (rows)", "tab:purple")
    ax.set_ylabel("decode batch")
    right = ax.twinx()
    right.plot(series.x, series.get("tokens"), color="tab:gray", lw=0.8, alpha=0.8,
               label="tokens per step", drawstyle="default" if series.binned else "steps-pre")
    right.set_ylabel("tokens per step")
    right.set_ylim(bottom=0)
    _legend(ax, ax.get_legend_handles_labels()[0] + right.get_legend_handles_labels()[0])


def _kv_panel(ax, series: _Series, first: int | None, steps: Sequence[StepRecord],
              limits: Limits) -> None:
    kv_gib = series.get("kv", "max") / _GIB
    peak = f"peak {kv_gib.max():.3g} GiB"  # a line at 1% of the budget is too thin to read
    ax.plot(series.x, kv_gib, color="tab:red", lw=1,
            label=f"KV held (max per bin, {peak})" if series.binned else f"KV held ({peak})",
            drawstyle="default" if series.binned else "steps-pre")
    if limits.kv_budget_bytes:
        ax.axhline(limits.kv_budget_bytes / _GIB, color="black", ls="--", lw=1,
                   label=f"KV budget {limits.kv_budget_bytes / _GIB:.3g} GiB")
    if first is not None:
        t = steps[first].start_s
        ax.axvline(t, color="tab:orange", ls=":", lw=1.5,
                   label=f"overrun: first wait for memory at {t:.4g} s")
    else:
        ax.plot([], [], " ", label="no request waited for memory")
    preempted = series.get("preempted", "sum")
    hit = preempted > 0
    if hit.any():  # a mark along the bottom per step (or bin) that preempted
        ax.plot(series.x[hit], np.zeros(int(hit.sum())), "|", color="black", ms=10,
                label=f"preemptions ({int(preempted.sum())})")
    else:
        ax.plot([], [], " ", label="no preemptions")
    _legend(ax, ax.get_legend_handles_labels()[0])
    ax.set_ylabel("KV (GiB)")


def weights_label(dtype: str | None, quantize: int | None) -> str:
    """`float16, 4-bit weights`: the compute dtype and, for a quantized model, its weights' bits."""
    return ", ".join(x for x in (dtype, f"{quantize}-bit weights" if quantize else None) if x)


def arrival_label(workload: Mapping[str, Any]) -> str:
    """How the requests came, from a workload's fields (a WorkloadSpec's or config.yaml's):
    `poisson at 5 req/s`, `all at once`, `closed loop of 8`."""
    arrival, rate = workload.get("arrival"), workload.get("request_rate")
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


def write_timeline(run_dir: Path, requests: Sequence[RequestRecord], steps: Sequence[StepRecord],
                   limits: Limits, title: str) -> tuple[str | None, str | None]:
    """run_dir/timeline.png: (its path, None), or (None, why it could not be drawn): a picture
    never costs a run its records or summary."""
    try:
        return str(draw_timeline(run_dir / TIMELINE, requests, steps, limits, title)), None
    except Exception as exc:  # noqa: BLE001 -- matplotlib's failures are many; say which, go on
        return None, f"{TIMELINE}: not drawn ({type(exc).__name__}: {exc})"
