"""A signal while `batchsim run` waits for its drawing child ends the wait at once: the child is
killed, the records and summary are kept, and the summary says the run was interrupted."""

from __future__ import annotations

import json
import os
import signal
import threading
import time

import pytest
from batchsim.server.engine.interrupts import Interrupts
from batchsim.server.engine.runner import run_workload
from batchsim.server.engine.session import open_session
from batchsim.server.results import timeline_draw
from batchsim.server.results.timeline_draw import DrawingProcess

from tests.sim_records import sim_config


@pytest.mark.timeout(60)
def test_a_signal_while_the_drawing_is_awaited_ends_the_wait(tmp_path, monkeypatch, caplog):
    monkeypatch.setattr(timeline_draw, "DRAW_WAIT_S", 40.0)  # far longer than the test allows
    session = open_session(sim_config(n=30))
    awaited, waited, lock = threading.Event(), threading.Event(), threading.Lock()

    class Watched(DrawingProcess):
        def result(self, *args, **kwargs):
            awaited.set()
            try:
                return super().result(*args, **kwargs)
            finally:
                with lock:  # not before a SIGINT being sent has reached its handler
                    waited.set()

    def interrupt() -> None:
        if awaited.wait(30):  # else never awaited: no SIGINT into whatever test runs then
            time.sleep(0.3)  # inside the wait ...
            with lock:  # ... unless it ended early: then a SIGINT would land in pytest's handler
                if not waited.is_set():
                    os.kill(os.getpid(), signal.SIGINT)

    sender = threading.Thread(target=interrupt, daemon=True)
    with Watched() as drawing:
        child = drawing._child
        assert child is not None
        os.kill(child.pid, signal.SIGSTOP)  # never answers
        sender.start()
        start = time.monotonic()
        try:
            outcome = run_workload(session, session.config.workload, out_dir=tmp_path,
                                   label="t", timeline=drawing)
        finally:
            with lock:  # never awaited, or it raised: no SIGINT after this
                waited.set()
            awaited.set()
        waited_s = time.monotonic() - start
    sender.join(35)
    assert waited_s < 20.0  # not the 40 s wait
    assert child.poll() is not None  # killed, not left behind
    saved = json.loads((outcome.run_dir / "summary.json").read_text())
    assert saved["completed"] == 30 and saved["timeline_png"] is None
    assert saved["interrupted"] is True and saved["interrupt_reason"] == "SIGINT"
    assert (outcome.run_dir / "requests.jsonl").read_text().count("\n") == 30
    [message] = [r.getMessage() for r in caplog.records if r.name == "batchsim"]
    assert message.startswith("timeline.png: not drawn (interrupted after ")


@pytest.mark.timeout(60)
@pytest.mark.parametrize("first", [None, "SIGINT"])
def test_a_signal_while_the_run_is_summarized_does_not_wait_for_the_drawing(tmp_path,
                                                                           monkeypatch, first):
    """The signal came after the run ended, before the wait began (while it was summarized):
    only noted there, it let the wait run its full length; also when it is a second one, after
    a first stopped the run (`received` kept the first: the same as when the run ended)."""
    from batchsim.server.engine import runner

    monkeypatch.setattr(timeline_draw, "DRAW_WAIT_S", 40.0)
    summarize, finish = runner.summarize, runner._finish

    def stopped_first(*args, **kwargs):
        os.kill(os.getpid(), signal.SIGINT)  # as the run ends: noted, the run interrupted
        return finish(*args, **kwargs)

    if first:
        monkeypatch.setattr(runner, "_finish", stopped_first)

    def signalled(*args, **kwargs):
        os.kill(os.getpid(), signal.SIGTERM)  # answered at once: noted, as during summarize
        return summarize(*args, **kwargs)

    monkeypatch.setattr(runner, "summarize", signalled)
    session = open_session(sim_config(n=30))
    interrupts = Interrupts((signal.SIGINT, signal.SIGTERM))
    with interrupts, DrawingProcess() as drawing:
        child = drawing._child
        assert child is not None
        os.kill(child.pid, signal.SIGSTOP)  # never answers
        start = time.monotonic()
        outcome = run_workload(session, session.config.workload, out_dir=tmp_path, label="t",
                               timeline=drawing, interrupts=interrupts)
        waited_s = time.monotonic() - start
    assert waited_s < 20.0 and child.poll() is not None
    saved = json.loads((outcome.run_dir / "summary.json").read_text())
    assert saved["completed"] == 30 and saved["timeline_png"] is None
    assert saved["interrupted"] is True and saved["interrupt_reason"] == (first or "SIGTERM")
