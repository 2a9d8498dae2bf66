"""timeline.png: drawn in every run directory (and again by `batchsim report`), named in the
summary, aggregated into time bins for long runs, with the overrun found where a request really
waited for memory."""

from __future__ import annotations

import dataclasses

import numpy as np
from batchsim.server.engine.runner import run_workload
from batchsim.server.engine.session import open_session
from batchsim.server.results import rebuild, request_arrays, timeline, timeline_draw
from batchsim.server.results.records import RequestRecord, StepRecord
from batchsim.server.results.timeline import Limits, overrun_index

from tests.sim_records import request_record, sim_config, step_record

PNG = b"\x89PNG\r\n\x1a\n"


def test_every_run_directory_gets_a_timeline_named_in_the_summary(tmp_path):
    session = open_session(sim_config(n=30))
    outcome = run_workload(session, session.config.workload, out_dir=tmp_path, label="t")
    png = outcome.run_dir / "timeline.png"
    assert outcome.summary["timeline_png"] == str(png) and png.read_bytes()[:8] == PNG

    png.unlink()  # report draws it again from the records, and gives the summary back as it was
    before = (outcome.run_dir / "summary.json").read_bytes()
    _summary, notes = rebuild.rebuild_summary(outcome.run_dir)
    assert png.read_bytes()[:8] == PNG and notes == []
    assert (outcome.run_dir / "summary.json").read_bytes() == before

    skipped = run_workload(session, session.config.workload, out_dir=tmp_path, label="u",
                           timeline=False)
    assert "timeline_png" not in skipped.summary
    assert not (skipped.run_dir / "timeline.png").exists()


def test_a_drawing_failure_costs_the_run_nothing(tmp_path, monkeypatch):
    def broken(*args, **kwargs):
        raise RuntimeError("no fonts")

    monkeypatch.setattr(timeline_draw, "draw_timeline", broken)
    session = open_session(sim_config(n=5))
    outcome = run_workload(session, session.config.workload, out_dir=tmp_path, label="t")
    assert outcome.summary["timeline_png"] is None and outcome.summary["completed"] == 5
    (outcome.run_dir / "summary.json").unlink()
    _, notes = rebuild.rebuild_summary(outcome.run_dir)
    assert any("timeline.png: not drawn (no fonts)" in n for n in notes)


def test_the_overrun_is_a_wait_for_memory_not_for_a_seat_or_tokens():
    limits = Limits(1 << 30, max_num_seqs=2, max_num_batched_tokens=2048)
    # Request 1 arrives at 0.5 and waits through steps 1 and 2 (starting at 1 and 2) and runs at 3.
    requests = [request_record(0, 0.0, 0.0), request_record(1, 0.5, 3.0)]
    full = [step_record(0, 0.0, 1, 1, prefill=16), step_record(1, 1.0, 2, 1),
            step_record(2, 2.0, 2, 1), step_record(3, 3.0, 2, 0, prefill=16)]
    # Step 0 leaves one seat, but steps 1 and 2 admit nobody with the seat free: only memory was
    # short. Step 1 may have been planned before the arrival (a real engine plans ahead), so the
    # overrun is the second step that passed the request over.
    twice = [full[0], step_record(1, 1.0, 1, 1), step_record(2, 2.0, 1, 1), full[3]]
    assert overrun_index(requests, twice, limits) == 2
    # Passed over only by the first step after it arrived: no overrun (the README's run marked one
    # at 2% of its KV budget before this rule).
    assert overrun_index(requests, full, limits) is None
    # Both seats taken (two running before step 1): waiting for a seat is not an overrun.
    seats = [step_record(0, 0.0, 2, 1, prefill=16), *full[1:]]
    assert overrun_index(requests, seats, limits) is None
    # The step's tokens used up (2048 prefill tokens): not memory either.
    tokens = [full[0], step_record(1, 1.0, 1, 1, prefill=2048),
              step_record(2, 2.0, 2, 1, prefill=2048), full[3]]
    assert overrun_index(requests, tokens, limits) is None
    # A preemption is an overrun wherever it comes; without the limits, only preemptions count.
    preempting = [*full[:3], step_record(3, 3.0, 2, 0, prefill=16, preempted=1)]
    assert overrun_index(requests, preempting, Limits()) == 3


def test_a_run_that_preempts_marks_its_overrun_and_a_roomy_one_none(tmp_path):
    tight = dataclasses.replace(sim_config(n=40), memory_gb=0.75)
    session = open_session(tight)
    outcome = run_workload(session, session.config.workload, out_dir=None, label="t")
    sched = session.scheduler_config()
    limits = Limits(session.kv_budget_bytes, sched.max_num_seqs, sched.max_num_batched_tokens)
    assert outcome.summary["num_preemptions"] > 0
    first = overrun_index(outcome.requests, outcome.steps, limits)
    assert first is not None and first <= next(
        i for i, s in enumerate(outcome.steps) if s.num_preemptions)

    roomy = open_session(sim_config(n=40))
    outcome = run_workload(roomy, roomy.config.workload, out_dir=None, label="t")
    sched = roomy.scheduler_config()
    limits = Limits(roomy.kv_budget_bytes, sched.max_num_seqs, sched.max_num_batched_tokens)
    assert overrun_index(outcome.requests, outcome.steps, limits) is None


def test_long_runs_are_binned_and_the_output_rate_counts_every_token():
    steps = [step_record(i, float(i), i % 7, i % 3, batch=i % 5) for i in range(3000)]
    series = timeline._Series(steps)
    assert series.binned and len(series.x) == timeline.MAX_POINTS
    running = np.array([s.num_running for s in steps], dtype=float)
    assert series.get("running", "sum").sum() == running.sum()  # every step in one bin
    assert series.get("running", "max").max() == 6 and series.get("running", "min").min() == 0
    mean = series.get("running")  # about five steps a bin
    assert np.all((mean >= series.get("running", "min")) & (mean <= series.get("running", "max")))
    assert abs(mean.mean() - running.mean()) < 0.05
    assert not timeline._Series(steps[:100]).binned

    requests = [request_record(i, float(i), float(i)) for i in range(2999)]
    _x, rate, width = timeline.output_rate(request_arrays.token_times(requests)[0], 3000.0)
    assert width == 5.0 and round(float((rate * width).sum())) == 2999
    assert timeline.bin_width_s(0.3) == 0.5 and timeline.bin_width_s(7) == 10


def test_the_picture_says_what_ran_where_and_the_seats_a_queue_can_wait_for(tmp_path,
                                                                            monkeypatch):
    """The title names the model, its weights, the simulated device and the engine priced (the
    run's and `report`'s alike); the requests panel draws the seat limit, so a queue that grows
    under it reads as waiting for a seat, not for memory; legends sit above their panels."""
    from batchsim.server.results.plots import figure

    drawn = []
    draw = timeline_draw.draw_timeline

    def spy(path, requests, steps, limits, title):
        drawn.append(title)
        return draw(path, requests, steps, limits, title)

    monkeypatch.setattr(timeline_draw, "draw_timeline", spy)
    session = open_session(dataclasses.replace(sim_config(n=5), engine="mlx-lm-server"))
    outcome = run_workload(session, session.config.workload, out_dir=tmp_path, label="t")
    rebuild.rebuild_summary(outcome.run_dir)
    assert len(drawn) == 2
    for title in drawn:  # and the traffic, on its own line: the run's and the redrawn alike
        assert title.startswith("llama-3.2-1b (float16, 4-bit weights) on sim (M2 Max, engine "
                                "mlx-lm-server)\nworkload mixed: 5 requests, poisson at 50 req/s")

    ax = figure().subplots()
    steps = [step_record(i, float(i), running=8, waiting=3 * i) for i in range(5)]
    timeline_draw._requests_panel(ax, timeline._Series(steps), 8, ax.twinx())
    seats = [ln for ln in ax.get_lines() if ln.get_label() == "seats (max_num_seqs 8)"]
    assert len(seats) == 1 and set(seats[0].get_ydata()) == {8}
    assert ax.get_legend().get_bbox_to_anchor().y0 >= ax.bbox.y1 - 1  # above the panel


def test_a_real_runs_title_names_the_backend_and_device_and_every_arrival_reads_plainly():
    env = {"backend": "cpu", "device_name": "Intel(R) Xeon(R) Processor"}
    assert (timeline.run_title("smollm2-135m-instruct", "float32", None, "mlx", None, None, env)
            == "smollm2-135m-instruct (float32) on mlx (cpu, Intel(R) Xeon(R) Processor)")
    assert timeline.run_title("m", "float16", 4, "mlx", None, None, {"backend": "metal"}) == (
        "m (float16, 4-bit weights) on mlx (metal)")
    assert timeline.run_title("m", None, None, "mlx", None, None) == "m on mlx"  # no env: as was
    assert timeline.run_title("m", None, None, "fake", None, None, env) == "m on fake"
    label = timeline.arrival_label
    assert label({"arrival": "poisson", "request_rate": 5.0}) == "poisson at 5 req/s"
    assert label({"arrival": "poisson", "request_rate": float("inf")}) == "all at once"
    assert label({"arrival": "closed", "request_rate": 1.0, "concurrency": 8}) == (
        "closed loop of 8")
    assert label({"arrival": "ramp", "request_rate": 1.0, "ramp_end_rate": 4.0}) == (
        "ramp from 1 to 4 req/s")
    assert label({"arrival": "trace", "request_rate": 1.0}) == "trace replay"
    assert label({"arrival": "trace", "trace": {"time_scale": 0.5}}) == "trace replay, time x0.5"
    assert label({}) == "?"  # a config.yaml without a workload: no crash, nothing invented


def test_the_timeline_title_and_the_console_name_a_run_through_one_formatter():
    """run_title and the commands' executor_label named a simulated run two ways ('sim (M2 Max,
    engine vllm)' vs 'sim, engine vllm'); now one formatter, the profile where it is known."""
    from batchsim.scripts.common import executor_label as console_label

    assert console_label is timeline.executor_label
    assert console_label("sim", "vllm") == "sim (engine vllm)"
    assert console_label("sim", "vllm", "M2 Max") == "sim (M2 Max, engine vllm)"
    assert console_label("mlx", "vllm") == "mlx"
    assert timeline.run_title("m", "float16", 4, "sim", "M2 Max", "vllm") == (
        f"m (float16, 4-bit weights) on {console_label('sim', 'vllm', 'M2 Max')}")
    assert timeline.run_title("m", None, None, "sim", None, None) == (
        "m on sim (this machine, engine batchsim)")


def test_a_canvas_made_ahead_draws_the_same_picture(tmp_path):
    """The drawing process makes the right-hand axes and their tick objects while the run runs
    (a fifth of the draw): pixel for pixel the picture drawn from nothing, binned or per step,
    and with no steps (drawn without right-hand axes); a canvas made plain too (review r4 item 5:
    it lost its grid)."""
    from PIL import Image

    for n in (3000, 100, 0):
        steps = [step_record(i, float(i), i % 7, 40 * (i % 13), batch=i % 5,
                             prefill=16 * (i % 4 == 0), preempted=int(i == n // 2))
                 for i in range(n)]
        requests = [request_record(i, float(i), float(i) + 0.5) for i in range(n)]
        panels = timeline.timeline_panels(requests, steps, Limits(1 << 22, 8, 64), f"{n} steps")
        plain = timeline_draw.draw_panels(tmp_path / f"plain{n}.png", panels)
        ahead = timeline_draw.draw_panels(tmp_path / f"ahead{n}.png", panels,
                                          timeline_draw._canvas(ahead=True))
        assert np.array_equal(np.asarray(Image.open(plain)), np.asarray(Image.open(ahead))), n
        made = timeline_draw.draw_panels(tmp_path / f"made{n}.png", panels, timeline_draw._canvas())
        assert np.array_equal(np.asarray(Image.open(plain)), np.asarray(Image.open(made))), n


def test_a_picture_the_disk_cut_short_is_not_left_torn(tmp_path):
    """h8: a full disk (here a 4 KiB file size limit) while timeline.png was written left a torn
    PNG (0 bytes on a full tmpfs, 4096 here) beside a run that said it was not drawn; a picture
    is now written whole or not at all, and an older one stays."""
    import subprocess
    import sys

    png = tmp_path / "timeline.png"
    png.write_bytes(b"the picture before")
    code = ("import resource, sys\n"
            "from pathlib import Path\n"
            "from batchsim.server.results.timeline import Limits\n"
            "from batchsim.server.results.timeline_draw import write_timeline\n"
            "resource.setrlimit(resource.RLIMIT_FSIZE, (4096, 4096))\n"
            "path, why = write_timeline(Path(sys.argv[1]), [], [], Limits(), 'cut short')\n"
            "print(path, why)\n")
    out = subprocess.run([sys.executable, "-c", code, str(tmp_path)], capture_output=True,
                         text=True, timeout=120, check=True).stdout
    assert out.startswith("None timeline.png: not drawn"), out
    assert png.read_bytes() == b"the picture before"
    assert [p.name for p in tmp_path.iterdir()] == ["timeline.png"]  # no temporary file left


def test_the_panels_read_the_steps_as_columns_once():
    """timeline_panels reads the steps' columns once (request_arrays.step_columns) for the overrun
    and the series: the same values as each step's fields, the same overrun either way."""
    steps = [step_record(i, float(i), i % 7, 3 * (i % 5), batch=i % 4, prefill=16 * (i % 3 == 0),
                         preempted=int(i == 40)) for i in range(60)]
    requests = [request_record(i, float(i), float(i) + 2.0 if i % 9 else None) for i in range(50)]
    col = request_arrays.step_columns(steps, timeline.PANEL_INTS)
    series = timeline._Series(steps, col)
    assert series.get("waiting").tolist() == [float(s.num_waiting) for s in steps]
    assert series.get("tokens").tolist() == [float(s.batch_size + s.num_prefill_tokens)
                                             for s in steps]
    found = {}
    for limits in (Limits(1 << 30, 8, 512), Limits(1 << 30, 1, 300), Limits(1 << 30, 8, 64),
                   Limits()):
        found[limits] = _overrun_step_by_step(requests, steps, limits)
        assert overrun_index(requests, steps, limits, col) == found[limits], limits
        assert overrun_index(requests, steps, limits) == found[limits], limits
    assert list(found.values()) == [2, 29, 40, 40]  # passed over, or the first preemption


def _overrun_step_by_step(requests: list[RequestRecord], steps: list[StepRecord],
                          limits: Limits) -> int | None:
    """overrun_index's rule one step and one request at a time (steps in start order)."""
    found = [i for i, s in enumerate(steps) if s.num_preemptions]
    if limits.max_num_seqs is not None and limits.max_num_batched_tokens is not None:
        for i, s in enumerate(steps):
            admitted = sum(r.first_scheduled_s == s.start_s for r in requests)
            before = steps[i - 1].num_running if i else 0
            room = (before + admitted < limits.max_num_seqs and s.batch_size
                    + s.num_prefill_tokens + timeline.KV_STEP <= limits.max_num_batched_tokens)
            for r in requests:
                ran = r.first_scheduled_s if r.first_scheduled_s is not None else r.finished_s
                after = [j for j, t in enumerate(steps) if t.start_s > r.arrival_s][1:]
                if room and i in after and (ran is None or s.start_s < ran):
                    found.append(i)
    return min(found, default=None)


def test_a_finished_run_reads_its_steps_as_columns_once(tmp_path, monkeypatch):
    """The summary and the picture sent to the drawing child share one step_columns (r1: the
    parent built them twice after the loop, metrics and timeline)."""
    calls = []
    real = request_arrays.step_columns

    def counted(steps, *args, **kwargs):
        calls.append(len(steps))
        return real(steps, *args, **kwargs)

    monkeypatch.setattr(request_arrays, "step_columns", counted)
    session = open_session(sim_config(n=30))
    with timeline_draw.DrawingProcess() as drawing:
        outcome = run_workload(session, session.config.workload, out_dir=tmp_path, label="t",
                               timeline=drawing)
    assert outcome.summary["timeline_png"] and len(calls) == 1, calls


def test_binned_extremes_are_those_of_every_step_in_the_bin():
    """A long run's bins: min and max per bin bin by bin (steps in time order) are the values
    ufunc.at gives, and steps out of order (records rebuilt from a damaged file) still bin."""
    rng = np.random.default_rng(7)
    n = timeline.MAX_POINTS * 7
    for ordered in (True, False):
        ends = np.cumsum(rng.exponential(1.0, n)) if ordered else rng.random(n) * n
        steps = [StepRecord(i, float(e) - 0.5, float(e), 1, int(rng.integers(0, 33)), 0, 0,
                            int(rng.integers(0, 40)), int(rng.integers(0, 900)),
                            int(rng.integers(0, 2**40)), None, 1, 1, int(rng.integers(0, 2)))
                 for i, e in enumerate(ends)]
        series = timeline._Series(steps)
        assert series.binned and (series._starts is not None) == ordered
        for name in ("running", "waiting", "batch", "kv"):
            values = series._cols[name]
            for how, ufunc, start in (("max", np.maximum, -np.inf), ("min", np.minimum, np.inf)):
                want = np.full(timeline.MAX_POINTS, start)
                ufunc.at(want, series._bin, values)
                got = series.get(name, how)
                assert got.tobytes() == want[series._filled].tobytes(), (ordered, name, how)
