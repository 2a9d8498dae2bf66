"""timeline.png drawn (timeline.py computes what it shows), here or by a drawing process: a
child started before a run imports matplotlib (and loads its fonts) on another core while the run
runs, then draws the run's panels while the run is summarized."""

from __future__ import annotations

import atexit
import io
import json
import os
import pickle
import select
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import numpy as np
from batchsim.server.platform.child import how_it_ended
from batchsim.server.results import drawing_start
from batchsim.server.results.plots import figure, save_figure
from batchsim.server.results.records import RequestRecord, StepRecord
from batchsim.server.results.timeline import (
    MAX_POINTS,
    TIMELINE,
    Limits,
    Panels,
    _Series,
    timeline_panels,
)

DPI = 100
_GIB = float(1 << 30)
DRAW_WAIT_S = 20.0  # the drawing child's time to answer once sent (matplotlib's import under load)
DRAW_WAIT_PER_STEP_S = 1e-4  # and per step of the run (its panels pickled, read, drawn)
POLL_S = 0.05  # how often that wait looks for a signal's answer (a signal alone cannot end it)
PRE_TICKS = 12  # tick objects a drawing process makes ahead per axis (a draw makes more if needed)
HEADROOM = 1.08  # y-axes reach a little past the tallest line (a line on the frame is hidden)
GRID_ALPHA = 0.3  # every axis's gridlines, twins included


def draw_panels(path: Path, panels: Panels, canvas: tuple | None = None) -> Path:
    """Write the run's timeline PNG at `path` (four panels sharing the time axis), on `canvas`
    if one was made for it. The run directory is not made again: removed, it stays so."""
    return save_figure(_figure(panels, canvas), path, dpi=DPI, tight=False,
                       fast=panels.series is not None, make_dir=False)


def _canvas(ahead: bool = False, grid: bool = True) -> tuple:
    """The timeline's figure and its four empty panels, gridded unless not `grid`; `ahead`: with
    the first two panels' right-hand axes (gridded) and PRE_TICKS tick objects on every axis made
    now (a fifth of a draw's work, the same picture: a drawing process makes them while the run
    runs)."""
    fig = figure(figsize=(11, 10))
    axes = fig.subplots(4, 1, sharex=True)
    fig.subplots_adjust(left=0.07, right=0.92, top=0.895, bottom=0.06, hspace=0.28)
    for ax in axes if grid else ():
        ax.grid(alpha=GRID_ALPHA)  # before the ticks: each is made with it, not restyled
    if not ahead:
        return fig, axes, None
    twins = _twins(axes)
    for ax in (*axes, *twins):
        ax.xaxis.get_major_ticks(PRE_TICKS)
        ax.yaxis.get_major_ticks(PRE_TICKS)
    return fig, axes, twins


def _twins(axes) -> tuple:
    """The first two panels' right-hand axes, sharing x, gridded."""
    twins = (axes[0].twinx(), axes[1].twinx())
    for twin in twins:
        twin.grid(alpha=GRID_ALPHA)
    return twins


def _figure(panels: Panels, canvas: tuple | None = None):
    series, limits, title = panels.series, panels.limits, panels.title
    if series is None or panels.rate is None:
        fig, axes, _ = _canvas(grid=False)  # no right-hand axes, no grid
        axes[0].text(0.5, 0.5, "no steps recorded", ha="center", transform=axes[0].transAxes)
        fig.suptitle(title)
        return fig
    fig, axes, twins = canvas or _canvas()
    twins = twins or _twins(axes)
    _requests_panel(axes[0], series, limits.max_num_seqs, twins[0])
    _batch_panel(axes[1], series, twins[1])
    _kv_panel(axes[2], series, panels.overrun_s, limits)
    x_s, rate, width_s = panels.rate
    axes[3].plot(x_s, rate, color="tab:green", lw=1)
    axes[3].set_ylabel("output tok/s")
    axes[3].set_title(f"output tokens per second ({width_s:g}-s bins)", fontsize=9, loc="left")
    axes[3].set_xlabel("time since the run started (s)")
    num_steps = len(series.t)
    how = (f"{num_steps} step records in {MAX_POINTS} time bins: mean, band from min to max"
           if series.binned else f"{num_steps} step records")
    fig.suptitle(f"{title}\n{how}", fontsize=10)
    for ax in fig.axes:  # twins included
        ax.set_ylim(0, max(ax.get_ylim()[1], 1e-9) * (1.0 if ax is axes[3] else HEADROOM))
    return fig


def draw_timeline(path: Path, requests: Sequence[RequestRecord], steps: Sequence[StepRecord],
                  limits: Limits, title: str) -> Path:
    """Write the run's timeline PNG at `path` (four panels sharing the time axis)."""
    return draw_panels(path, timeline_panels(requests, steps, limits, title))


def write_timeline(run_dir: Path, requests: Sequence[RequestRecord], steps: Sequence[StepRecord],
                   limits: Limits, title: str) -> tuple[str | None, str | None]:
    """run_dir/timeline.png: (its path, None), or (None, why it could not be drawn): a picture
    never costs a run its records or summary."""
    return drawn(lambda: draw_timeline(run_dir / TIMELINE, requests, steps, limits, title))


def drawn(draw: Callable[[], Path]) -> tuple[str | None, str | None]:
    """(the path `draw` wrote, None), or (None, why it failed)."""
    try:
        return str(draw()), None
    except Exception as exc:  # noqa: BLE001 -- matplotlib's failures are many; say which, go on
        return _failed(exc)


def _failed(exc: Exception) -> tuple[None, str]:
    return None, f"{TIMELINE}: not drawn ({str(exc) or type(exc).__name__})"  # no class name


def _drawstyle(series: _Series) -> str:
    """Per-step lines hold each step's value until the next; binned ones join bin centres."""
    return "default" if series.binned else "steps-pre"


def _line(ax, series: _Series, name: str, label: str, color: str) -> None:
    ax.plot(series.x, series.get(name), color=color, lw=1, label=label,
            drawstyle=_drawstyle(series))
    if series.binned:
        ax.fill_between(series.x, series.get(name, "min"), series.get(name, "max"), color=color,
                        alpha=0.2, lw=0)


def _legend(ax, handles: list) -> None:
    """The panel's legend in one row above it, where it hides no line."""
    ax.legend(handles=handles, loc="lower left", bbox_to_anchor=(0, 1.0), ncol=len(handles),
              fontsize=8, frameon=False, borderaxespad=0.2, handlelength=1.5)


def _requests_panel(ax, series: _Series, max_num_seqs: int | None, right) -> None:
    _line(ax, series, "running", "running", "tab:blue")
    if max_num_seqs:  # a queue that grows under this line waits for a seat, not for memory
        ax.axhline(max_num_seqs, color="tab:blue", ls="--", lw=0.8,
                   label=f"seats (max_num_seqs {max_num_seqs})")
    ax.set_ylabel("running requests", color="tab:blue")
    # right: a queue can be 100 times the batch
    right.plot(series.x, series.get("waiting", "max"), color="tab:orange", lw=1,
               label="waiting (max per bin)" if series.binned else "waiting",
               drawstyle=_drawstyle(series))
    right.set_ylabel("waiting requests", color="tab:orange")
    right.set_ylim(bottom=0)
    _legend(ax, ax.get_legend_handles_labels()[0] + right.get_legend_handles_labels()[0])


def _batch_panel(ax, series: _Series, right) -> None:
    _line(ax, series, "batch", "decode batch (rows)", "tab:purple")
    ax.set_ylabel("decode batch")
    right.plot(series.x, series.get("tokens"), color="tab:gray", lw=0.8, alpha=0.8,
               label="tokens per step", drawstyle=_drawstyle(series))
    right.set_ylabel("tokens per step")
    right.set_ylim(bottom=0)
    _legend(ax, ax.get_legend_handles_labels()[0] + right.get_legend_handles_labels()[0])


def _kv_panel(ax, series: _Series, overrun_s: float | None, limits: Limits) -> None:
    kv_gib = series.get("kv", "max") / _GIB
    peak = f"peak {kv_gib.max():.3g} GiB"  # a line at 1% of the budget is too thin to read
    ax.plot(series.x, kv_gib, color="tab:red", lw=1,
            label=f"KV held (max per bin, {peak})" if series.binned else f"KV held ({peak})",
            drawstyle=_drawstyle(series))
    if limits.kv_budget_bytes:
        ax.axhline(limits.kv_budget_bytes / _GIB, color="black", ls="--", lw=1,
                   label=f"KV budget {limits.kv_budget_bytes / _GIB:.3g} GiB")
    if overrun_s is not None:
        t = overrun_s
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


_START_CHILD = drawing_start.START_CHILD  # this module run as __main__ (tests wrap it)


class DrawingProcess:
    """A child process that draws timeline.png: started before a run, it imports matplotlib on
    another core meanwhile; `send` gives it the panels when the run ends, `result` waits for the
    picture (after the summary is made) at most `wait_s`. No child (it could not start), or a
    child that failed: drawn here. A child that does not answer in time is killed."""

    def __init__(self) -> None:
        self._reply: tuple[str | None, str | None] | None = None
        self._job: tuple[Path, Panels] | None = None
        self._talk: threading.Thread | None = None
        self.wait_s = DRAW_WAIT_S
        # The one the program started at its start (drawing_start.start_early), else a new one.
        self._child: subprocess.Popen | None = (drawing_start.adopt()
                                                or drawing_start.start(_START_CHILD))

    def send(self, path: Path, make_panels: Callable[[], Panels], num_steps: int = 0) -> None:
        """Draw the panels `make_panels` gives at `path` (in the child, while this process goes
        on; their failure is this picture's, not the run's); a run of `num_steps` steps allows
        the child DRAW_WAIT_PER_STEP_S more each."""
        try:
            panels = make_panels()
            blob = (b"" if self._child is None else
                    pickle.dumps((path, panels), protocol=pickle.HIGHEST_PROTOCOL))
        except Exception as exc:  # noqa: BLE001 -- as drawn(): say which, the run goes on
            self._reply = _failed(exc)
            return
        self._job = (path, panels)
        if self._child is None:
            self._reply = drawn(lambda: draw_panels(path, panels))
            return
        self.wait_s = DRAW_WAIT_S + DRAW_WAIT_PER_STEP_S * num_steps
        # A thread writes: the pipe holds less than the panels while the child still imports.
        self._talk = threading.Thread(target=self._exchange, args=(self._child, blob), daemon=True)
        self._talk.start()

    def _exchange(self, child: subprocess.Popen, blob: bytes) -> None:
        try:
            out, err = child.communicate(blob)
        except (OSError, ValueError) as exc:  # the child is gone, or its pipes closed by close()
            out, err = b"", str(exc).encode()
        self._reply = _reply(out, err, child.returncode)

    def result(self, stop: Callable[[], bool] = bool) -> tuple[str | None, str | None]:
        """(the picture's path, None), or (None, why it was not drawn): the wait ends early
        (the child killed) once `stop()` is true, a signal's answer (checked every POLL_S)."""
        if self._talk is not None:
            waited = self._wait(self._talk, stop)
            if self._talk.is_alive():  # stopped or hung: the run's summary does not wait on it
                self._end_child()
                why = (f"interrupted after {waited:.1f} s" if stop() else
                       f"the drawing process did not answer in {self.wait_s:.1f} s")
                return None, f"{TIMELINE}: not drawn ({why}; stopped)"
        reply = self._reply or (None, f"{TIMELINE}: not drawn (nothing was sent to draw)")
        if reply[0] is None and self._job is not None and (reply[1] or "").startswith(
                _CHILD_FAILED):
            path, panels = self._job  # the child failed before drawing: drawn here instead
            here = drawn(lambda: draw_panels(path, panels))
            return here[0], reply[1].replace("not drawn", "drawn here", 1) if here[0] else here[1]
        return reply

    def _wait(self, talk: threading.Thread, stop: Callable[[], bool]) -> float:
        """Wait for `talk` at most `wait_s`, or until `stop()`: the seconds waited."""
        start = time.monotonic()
        left = self.wait_s
        while left > 0 and talk.is_alive() and not stop():
            talk.join(min(left, POLL_S))
            left = self.wait_s - (time.monotonic() - start)
        return time.monotonic() - start

    def _end_child(self) -> None:
        child = self._child
        if child is not None and child.poll() is None:
            child.kill()  # SIGKILL ends a stopped (SIGSTOP) child too
        if self._talk is not None:
            self._talk.join(DRAW_WAIT_S)

    def close(self) -> None:
        """A child not sent anything (the run failed) ends now; a child drawing is waited for
        (at most its `wait_s`)."""
        child = self._child
        if child is None:
            return
        if self._talk is None:
            child.kill()
        else:
            self._talk.join(self.wait_s)
            self._end_child()
        drawing_start.ended(child)

    def __enter__(self) -> DrawingProcess:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


_CHILD_FAILED = f"{TIMELINE}: not drawn (the drawing process "  # it ended without an answer


def _reply(out: bytes, err: bytes, returncode: int | None) -> tuple[str | None, str | None]:
    """The child's answer (its last line on stdout: a sitecustomize's banner may come first),
    or why it gave none (its last line on stderr)."""
    try:
        path, why = json.loads(out.rsplit(b"\n", 1)[-1])
        return path, why
    except (ValueError, TypeError):
        return None, f"{_CHILD_FAILED}{how_it_ended(returncode, err)})"


def _warm() -> None:
    """What a first picture loads once (the Agg renderer, PIL's PNG writer and its plugins, the
    font) loaded by a picture of one square inch: the timeline is drawn as fast after it as after
    a whole timeline drawn to memory, which took 0.2 s of CPU from the run's writer process."""
    fig = figure(figsize=(1, 1))
    ax = fig.subplots()
    ax.plot([0, 1], [0, 1], label="warm")
    ax.legend(fontsize=8, frameon=False)
    ax.set_title("warm", fontsize=9)
    fig.savefig(io.BytesIO(), format="png", dpi=DPI)


def _serve() -> int:
    """The child: warm up while the run runs (a short run sends first: no time to), then draw
    the (path, panels) read from stdin; stdout: [path, why]. Nothing sent (the run failed or was
    not drawn): exit."""
    canvas = _canvas(ahead=True)  # matplotlib imported, the figure made while the run runs
    if not select.select([sys.stdin], [], [], 0)[0]:  # the panels not sent yet: time to warm up
        _warm()
    blob = sys.stdin.buffer.read()
    if not blob:
        return 0
    path, panels = pickle.loads(blob)  # from the parent process that started this one
    answer = json.dumps(drawn(lambda: draw_panels(path, panels, canvas)))
    sys.stdout.write(f"\n{answer}")  # a line of its own
    return 0


if __name__ == "__main__":
    code = _serve()
    # Answered: gone at once. The interpreter's teardown (matplotlib's objects and modules freed,
    # 0.5 s at load 9) would hold the parent's wait for this process after the picture is done.
    # Its exit functions still run (matplotlib's removes the temporary config directory it made
    # where HOME is not writable), and both streams are flushed; its own TMPDIR goes too.
    atexit._run_exitfuncs()
    drawing_start.remove_tmp(os.environ.get(drawing_start.OWN_TMP))
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
