"""`batchsim report` redraws timeline.png with the title strip the run drew (marked redrawn)."""

from __future__ import annotations

import dataclasses

import pytest
from batchsim.server.engine.runner import run_workload
from batchsim.server.engine.session import open_session
from batchsim.server.results import rebuild, timeline_draw

from tests.sim_records import sim_config


@pytest.mark.parametrize("workload", [{"request_rate": float("inf")},
                                      {"arrival": "closed", "concurrency": 4},
                                      {"arrival": "ramp", "request_rate": 2.0,
                                       "ramp_end_rate": 5.0}])
def test_report_redraws_the_title_the_run_drew(tmp_path, monkeypatch, workload):
    """`report` builds the title from config.yaml, where an infinite rate is written 'inf': it
    said 'poisson' where the run said 'all at once'."""
    titles: list[str] = []
    draw = timeline_draw.draw_timeline
    monkeypatch.setattr(timeline_draw, "draw_timeline",
                        lambda *args: (titles.append(args[-1]), draw(*args))[1])
    cfg = sim_config(n=8)
    cfg = dataclasses.replace(cfg, workload=dataclasses.replace(cfg.workload, **workload))
    session = open_session(cfg)
    outcome = run_workload(session, session.config.workload, out_dir=tmp_path, label="t")
    _, notes = rebuild.rebuild_summary(outcome.run_dir)
    assert notes == [] and titles == [titles[0], f"{titles[0]} (redrawn by batchsim report)"]
