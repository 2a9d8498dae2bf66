"""The live progress line: what it leaves on the terminal when a run ends."""

from __future__ import annotations

import io
from types import SimpleNamespace

from batchsim.scripts import progress
from rich.console import Console
from rich.live import Live


def _engine(done: int, now_s: float, running: int, waiting: int, preempted: int = 0):
    scheduler = SimpleNamespace(running=[0] * running, waiting=[0] * waiting,
                                num_preemptions=preempted)
    recorder = SimpleNamespace(num_left=done)
    return SimpleNamespace(scheduler=scheduler, recorder=recorder, now=lambda: now_s)


def _plan(batch: int, kv_gib: float):
    return SimpleNamespace(decode_ids=list(range(batch)), kv_bytes=int(kv_gib * 2**30))


def _run(monkeypatch, width: int, steps: list, label: str = "llama-3.1-8b-default-sim") -> str:
    buf = io.StringIO()
    monkeypatch.setattr(progress, "err", Console(file=buf, width=width, color_system=None))
    # An hour between updates: the rate limit skips every step (as a fast simulated run's last).
    with progress.RunProgress(18000, label, min_interval_s=3600) as bar:
        for engine, plan in steps:
            bar.on_step(engine, plan, None)
    return buf.getvalue().rstrip().splitlines()[-1]


def test_the_last_line_is_the_runs_end_not_the_last_rate_limited_update(monkeypatch):
    steps = [(_engine(0, 0.3, 1, 0), _plan(0, 0.03)),
             (_engine(16881, 4229.8, 30, 1087), _plan(32, 1.0)),
             (_engine(18000, 4505.7, 0, 0), _plan(1, 0.02))]
    for width in (80, 200):
        line = _run(monkeypatch, width, steps)
        assert "18000/18000" in line and "4505.7s" in line, (width, line)
        assert len(line) <= width and "…" not in line, (width, line)


def test_a_narrow_terminal_keeps_every_count_whole(monkeypatch):
    line = _run(monkeypatch, 80, [(_engine(16881, 4229.8, 30, 1087, preempted=3), _plan(32, 1.0))])
    for part in ("16881/18000", "batch 32", "running 30", "waiting 1087", "KV 1.00 GiB"):
        assert part in line, (part, line)
    assert "…" not in line
    wide = _run(monkeypatch, 200, [(_engine(16881, 4229.8, 30, 1087, preempted=3), _plan(32, 1.0))])
    assert "llama-3.1-8b-default-sim" in wide and "preempted 3" in wide


def test_a_label_with_brackets_is_printed_as_it_is(monkeypatch):
    """The run's label carries the model name (a path: `--model /m/w[/x]`): it was formatted into
    rich markup (a MarkupError traceback when the progress line started)."""
    line = _run(monkeypatch, 200, [(_engine(5, 1.0, 1, 0), _plan(1, 0.1))], label="w[/x]-sim")
    assert "w[/x]-sim" in line, line


def test_the_line_is_redrawn_on_a_terminal_only(monkeypatch):
    """Not a terminal (a file, a pipe: `--json 2>log`): no refresh thread waking 10 times a second
    to build a line nobody sees (rich prints it once, at the end); a terminal keeps it live. Only
    this RunProgress's own thread is looked at: another Live's (one a test leaked) runs too."""
    other = Live(console=Console(file=io.StringIO(), force_terminal=True), auto_refresh=True)
    other.start()
    try:
        for terminal in (False, True):
            console = Console(file=io.StringIO(), width=120, force_terminal=terminal)
            monkeypatch.setattr(progress, "err", console)
            with progress.RunProgress(10, "run") as bar:
                thread = bar._progress.live._refresh_thread
                assert (thread is not None and thread.is_alive()) == terminal, terminal
            assert "0/10" in console.file.getvalue()
    finally:
        other.stop()
