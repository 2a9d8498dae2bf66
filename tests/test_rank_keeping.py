"""Rank 0 keeps its records however its run ends (a signal, the watchdog, a lost peer) and no
exit timer outlives it: the watchdog and record-keeping paths of server/distributed/rank.py, in
process (split from test_distributed.py)."""

from __future__ import annotations

import json
from typing import Any

import pytest


def test_the_watchdog_ends_a_step_that_outlives_its_deadline():
    import threading

    from batchsim.server.distributed.watchdog import Watchdog

    fired: list[str] = []
    done = threading.Event()
    dog = Watchdog(0.2, on_expire=lambda msg: (fired.append(msg), done.set()))
    dog.arm("rank 0: step 7")
    assert dog.current() == "step 7"
    assert done.wait(10)
    assert fired == [("rank 0: step 7 took over 0.2 s: a peer rank is not answering (hung, or its "
                     "link is down)")]


def test_rank_0_names_its_kept_records_however_the_run_was_abandoned(tmp_path, monkeypatch):
    """The run is abandoned once (a signal, the watchdog or the error unwinding it, whichever came
    first); every later failure path still names where the records were kept."""
    from batchsim.server.distributed import rank
    from batchsim.server.engine.interrupts import Interrupts

    monkeypatch.setenv(rank.STATUS_DIR_ENV, str(tmp_path))
    status = rank._Status(0)
    assert rank._keep_records(status, "no run yet", 1) is None
    status.run = run = Interrupts(())
    calls = []

    def abandon(reason: str) -> None:
        calls.append(reason)
        run.abandon, run.abandoned_in = None, "DIR"  # as runner._abandon leaves it

    run.abandon = abandon
    assert rank._keep_records(status, "rank 0: SIGTERM", 143) == "DIR"
    assert rank._keep_records(status, "rank 0: lost a peer rank", 1) == "DIR"
    assert calls == ["rank 0: SIGTERM"]


def test_a_rank_whose_records_cannot_be_kept_still_exits(tmp_path, monkeypatch):
    """The watchdog keeps rank 0's records from its own thread while the main thread may wait in
    a collective: if keeping them blocks, the rank still exits (its timeout must end it), and its
    status file says the records were not kept."""
    import threading

    from batchsim.server.distributed import rank
    from batchsim.server.engine.interrupts import Interrupts

    monkeypatch.setenv(rank.STATUS_DIR_ENV, str(tmp_path))
    monkeypatch.setattr(rank, "KEEP_RECORDS_S", 0.05)
    exited, released = [], threading.Event()

    def exit_(code: int) -> None:  # os._exit, in this process: note it, let the abandon end
        exited.append(code)
        released.set()

    monkeypatch.setattr(rank.os, "_exit", exit_)
    status = rank._Status(0)
    status.run = Interrupts(())
    status.run.abandon = lambda reason: released.wait(10)  # a lock the main thread holds
    assert rank._keep_records(status, "rank 0: step 7 took over 1 s", 3) is None
    assert exited == [3]
    assert json.loads(status.path.read_text())["error"] == (
        "rank 0: step 7 took over 1 s (records not kept: still writing after 0.05 s)")


@pytest.fixture(autouse=True)
def _no_exit_timer_outlives_its_test(monkeypatch):
    """Every _exit_unkept timer a test starts is cancelled when it ends, whatever failed first:
    left running, it called the real os._exit(3) inside pytest once the test's stand-in was
    undone (a failed assert before the code under test cancelled it ended the whole session)."""
    from batchsim.server.distributed import rank

    timers: list = []
    start = rank._exit_unkept_later
    monkeypatch.setattr(rank, "_exit_unkept_later",
                        lambda *args: timers.append(start(*args)) or timers[-1])
    yield
    for timer in timers:
        timer.cancel()


def _finishing_rank_0(tmp_path, monkeypatch, keep_records_s: float = 3600.0
                      ) -> tuple[Any, Any, list[tuple[int, bool]]]:
    """Rank 0's status and run, the run writing its records and summary; os._exit recorded as
    (code, whether the run was done). Its records may take `keep_records_s` (long by default: no
    _exit_unkept timer fires while the test runs)."""
    from batchsim.server.distributed import rank

    monkeypatch.setattr(rank, "KEEP_RECORDS_S", keep_records_s)
    monkeypatch.setenv(rank.STATUS_DIR_ENV, str(tmp_path))
    exited: list[tuple[int, bool]] = []
    run = rank._RunInterrupts(())
    monkeypatch.setattr(rank.os, "_exit", lambda code: exited.append((code, run.done)))
    status = rank._Status(0)
    status.run = run
    run.abandon = lambda reason: None  # the run began ...
    run.abandon = None  # ... and now writes its records and summary
    assert run.finishing()
    return status, run, exited


def test_the_watchdog_firing_while_rank_0_writes_its_summary_ends_it_after(tmp_path,
                                                                           monkeypatch):
    """The deadline passes as the last step ends and rank 0 goes on to write its summary: the
    rank exits 3 once the summary is written, its status naming the run directory. Before, the
    watchdog's thread polled for `done` while the main thread went on (lead.finish, ok=true,
    printing, exit 0), so the outcome was whichever came first; now the watchdog returns and
    run_rank acts on its note, as for a SIGTERM then."""
    import threading

    from batchsim.server.distributed import rank

    status, run, exited = _finishing_rank_0(tmp_path, monkeypatch)
    dog = threading.Thread(target=rank._expire, args=(status, "rank 0: step 7 took over 1 s"))
    dog.start()
    dog.join(5)
    assert not dog.is_alive() and exited == [] and not status.path.exists()
    rank._run_ended(status, run, "DIR")  # the summary written: as run_rank marks it
    assert exited == [(3, True)]
    # and the timer that would exit unkept after KEEP_RECORDS_S is off: left running, it exited
    # 3 later from whatever ran then (the pytest process itself, once os._exit was real again)
    assert status.unkept is not None and status.unkept.finished.is_set()
    saved = json.loads(status.path.read_text())
    assert saved["error"] == "rank 0: step 7 took over 1 s" and saved["run_dir"] == "DIR"


def test_the_watchdog_after_rank_0s_run_ended_exits_at_once(tmp_path, monkeypatch):
    """The run marked done just before the watchdog looked: it exits 3 itself (run_rank, which
    may also have seen its note, would exit the same way)."""
    from batchsim.server.distributed import rank

    status, run, exited = _finishing_rank_0(tmp_path, monkeypatch)
    rank._run_ended(status, run, "DIR")
    assert exited == []
    rank._expire(status, "rank 0: the message that ends the run took over 1 s")
    assert exited == [(3, True)] and json.loads(status.path.read_text())["run_dir"] == "DIR"


def test_the_watchdog_waits_for_the_summary_no_longer_than_keep_records_s(tmp_path, monkeypatch):
    import time

    from batchsim.server.distributed import rank

    status, _, exited = _finishing_rank_0(tmp_path, monkeypatch, keep_records_s=0.05)
    rank._expire(status, "rank 0: step 7 took over 1 s")  # the summary's write never ends
    deadline = time.monotonic() + 5
    while not exited and time.monotonic() < deadline:
        time.sleep(0.01)
    assert exited == [(3, False)]
    assert json.loads(status.path.read_text())["error"] == (
        "rank 0: step 7 took over 1 s (records not kept: still writing after 0.05 s)")
