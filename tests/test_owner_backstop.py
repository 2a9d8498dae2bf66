"""The launcher's backstop after the group SIGTERM of a run's second Ctrl-C: mlx.launch ignores
SIGTERM (it must outlive the ranks so rank 0 keeps its records), so a rank blocked in a native
call, whose handler never runs, would hold the run until a third signal or the rank timeout;
past KEEP_RECORDS_S + GRACE_S the launcher kills the group."""

from __future__ import annotations

import signal

from batchsim.server.distributed import owner
from batchsim.server.distributed.rank import KEEP_RECORDS_S


def _launch(tmp_path, sent: list[int]) -> owner.OwnedLaunch:
    launch = object.__new__(owner.OwnedLaunch)  # its state only: no mlx.launch started
    launch.status_dir, launch.plan = tmp_path, owner.STOP_PLANS["run"]
    launch.signals, launch._sent, launch.killed = 0, 0, []
    launch._terminated_at = None
    launch._signal_group = sent.append
    return launch


def test_the_group_is_killed_when_its_sigterm_goes_unanswered(tmp_path, monkeypatch):
    now = [100.0]
    monkeypatch.setattr(owner.time, "monotonic", lambda: now[0])
    sent: list[int] = []
    launch = _launch(tmp_path, sent)
    (tmp_path / "rank0.pid").write_text("4242")  # rank 0's pid known: the 1st goes to it alone
    to_rank0: list[tuple[int, int]] = []
    monkeypatch.setattr(owner.os, "kill", lambda pid, sig: to_rank0.append((pid, sig)))
    launch.signals = 2  # two Ctrl-Cs: SIGINT to rank 0, then SIGTERM to the group
    launch._forward()
    assert to_rank0 == [(4242, signal.SIGINT)] and sent == [signal.SIGTERM]
    now[0] += KEEP_RECORDS_S + owner.GRACE_S - 1  # rank 0 may still be keeping its records
    launch._end_unanswered_term()
    assert sent == [signal.SIGTERM]
    now[0] += 2
    launch._end_unanswered_term()
    assert sent == [signal.SIGTERM, signal.SIGKILL]
    launch._end_unanswered_term()  # once
    assert sent == [signal.SIGTERM, signal.SIGKILL]
