"""What `batchsim run` shows a person: the header line and the summary table say the same thing
in the same units (GiB, as --memory-gb, timeline.png and `size` do)."""

from __future__ import annotations

import dataclasses
import io
import re

from batchsim.scripts import run_view
from batchsim.scripts.report import summary_table
from batchsim.server.engine.runner import run_workload
from batchsim.server.engine.session import open_session
from rich.console import Console

from tests.cli_calls import last_json
from tests.sim_records import sim_config


def test_header_and_table_name_the_weights_the_traffic_and_one_kv_budget(monkeypatch):
    buf = io.StringIO()
    monkeypatch.setattr(run_view, "err", Console(file=buf, width=400, color_system=None))
    session = open_session(dataclasses.replace(sim_config(n=6), memory_gb=12.0))
    run_view.ConsoleView(progress=False).opened(session)
    header = buf.getvalue()
    # a 4-bit model's header said "(float16)" alone; the traffic said nothing of its rate
    assert "llama-3.2-1b (float16, 4-bit weights) on sim (M2 Max, engine batchsim)" in header
    assert "workload mixed: 6 requests, poisson at 50 req/s" in header
    budget_gib = re.search(r"KV budget ([\d.]+) GiB", header).group(1)

    outcome = run_workload(session, session.config.workload, out_dir=None, label="t")
    console = Console(width=120, record=True)
    console.print(summary_table(outcome.summary))
    text = console.export_text()
    # the same budget, in the same unit, in both places (the table said 18.42 GB for 17.15 GiB)
    assert re.search(rf"KV budget \(GiB\)\s+│\s+{budget_gib}\s", text), (budget_gib, text)
    assert "Peak KV (GiB)" in text and "(GB" not in text
    # cached prompt tokens are why prompt tokens prefilled can be fewer than the input tokens
    assert "Prefix cache hit rate" in text and "Cached prompt tokens (not prefilled)" in text


def test_the_goodput_row_says_its_slos_in_words():
    from batchsim.server.results.metrics import summarize

    from tests.metrics_schedule import REQUESTS, STEPS

    s = summarize(REQUESTS, STEPS, duration_s=3.0, goodput_slo_ms={"ttft": 2000.0, "tpot": 200.0})
    console = Console(width=160, record=True)
    console.print(summary_table(s))
    text = console.export_text()
    # it printed the dict: "Request goodput (req/s) {'ttft': 2000.0, 'tpot': 200.0}"
    assert "Request goodput (req/s, TTFT <= 2000 ms, TPOT <= 200 ms)" in text and "{" not in text


def test_a_sweep_on_an_emulated_budget_says_what_the_device_itself_holds(tmp_path, capsys):
    """`batchsim sweep`'s default budget is sized for 12 sequences: its 'analytic limit 12' read
    as this machine's limit; the note gives the device's own budget and its limit."""

    from batchsim.scripts.cli import main

    assert main(["sweep", "--executor", "fake", "--batches", "1", "--no-progress", "--no-timeline",
                 "--out", str(tmp_path), "--runs-dir", str(tmp_path)]) == 0
    printed = capsys.readouterr().out
    result = last_json(printed)
    assert result["device_analytic_max_batch"] > result["analytic_overrun_batch"] == 12
    said = " ".join(printed.split())
    assert (f"holds {result['device_analytic_max_batch']} sequences of these lengths" in said
            and "The budget is emulated (--limit-batch 12" in said), said


def _print_console(monkeypatch) -> io.StringIO:
    """`out` (the summary table's console) on a terminal of 100 columns, colors on: a buffer."""
    from batchsim.scripts import common

    buf = io.StringIO()
    console = Console(file=buf, width=100, force_terminal=True, color_system="truecolor")
    monkeypatch.setattr(common, "out", console)
    monkeypatch.setattr(run_view, "out", console)
    return buf


def test_the_table_laid_out_while_the_picture_is_drawn_prints_as_it_would_have(monkeypatch):
    from batchsim.scripts import report

    session = open_session(sim_config(n=6))
    summary = run_workload(session, session.config.workload, out_dir=None, label="t").summary
    # the numbers, as on_summary has them: the picture, run directory and environment come after
    numbers = {k: v for k, v in summary.items() if k not in ("timeline_png", "run_dir", "env")}
    after = {"timeline_png": "t.png", "run_dir": "r", "env": {}}
    buf = _print_console(monkeypatch)
    run_view.print_summary({**numbers, **after})  # laid out when printed, as before
    direct = buf.getvalue()
    laid = []
    monkeypatch.setattr(report, "summary_table", lambda s: laid.append(s) or summary_table(s))
    for changed in ({}, {"completed": summary["completed"] - 1, "interrupted": True}):
        view = run_view.ConsoleView(progress=False)
        view.summarized(numbers)
        buf.seek(0), buf.truncate()
        view.finished({**numbers, **changed, **after})
        if not changed:  # the table laid out ahead, printed after the picture: the same text
            assert len(laid) == 1 and buf.getvalue() == direct
    # a summary that changed meanwhile (a signal while the picture was awaited) is laid out anew
    assert len(laid) == 3 and laid[2]["completed"] == summary["completed"] - 1
    assert f"{summary['completed'] - 1}" in buf.getvalue() and "interrupted:" in buf.getvalue()


def test_the_view_lays_out_the_summary_before_the_picture_is_awaited(tmp_path):
    from batchsim.server.engine.run_path import run_config
    from batchsim.server.results.timeline_draw import DrawingProcess

    events = []

    class Drawing(DrawingProcess):  # draws here (no child), noting when it is awaited
        def __init__(self) -> None:
            super().__init__()
            self._child.kill(), self._child.wait()
            self._child = None

        def result(self, stop=bool):
            events.append("awaited")
            return super().result(stop)

    class View(run_view.ConsoleView):
        def summarized(self, summary):
            events.append(("summarized", "timeline_png" in summary, summary["completed"]))

        def finished(self, summary):
            events.append(("finished", summary["timeline_png"] is not None))

    with Drawing() as drawing:
        run_config(sim_config(n=6), tmp_path, View(progress=False), timeline=drawing)
    assert events == [("summarized", False, 6), "awaited", ("finished", True)]


def test_a_failing_summary_hook_costs_neither_summary_json_nor_the_picture(tmp_path, caplog):
    """on_summary (the table laid out ahead) runs before summary.json is written: its failure
    lost summary.json and timeline.png (review r4 item 3); now one line, and both are there."""
    session = open_session(sim_config(n=6))

    def broken(summary):
        raise ValueError("no table")

    outcome = run_workload(session, session.config.workload, out_dir=tmp_path, label="t",
                           on_summary=broken)
    assert (outcome.run_dir / "summary.json").is_file()
    assert outcome.summary["timeline_png"] and (outcome.run_dir / "timeline.png").is_file()
    assert [r.getMessage() for r in caplog.records if r.name == "batchsim"] == [
        "the summary's early look failed: ValueError: no table"]
