"""The launcher's backstop after the group SIGTERM of a run's second Ctrl-C: mlx.launch ignores
SIGTERM (it must outlive the ranks so rank 0 keeps its records), so a rank blocked in a native
call, whose handler never runs, would hold the run until a third signal or the rank timeout:
GRACE_S after it the followers still running are killed (rank 0 blocked in a collective with
them is let go), and KEEP_RECORDS_S + GRACE_S after rank 0 began keeping its records (or after
the SIGTERM, if it never began) the group. Rank 0 records the signal the launcher got."""

from __future__ import annotations

import json
import signal
import types

from batchsim.server.distributed import owner, rank
from batchsim.server.distributed.rank import KEEP_RECORDS_S
from batchsim.server.platform.signals import STOP_SIGNALS


def _launch(tmp_path, sent: list[int]) -> owner.OwnedLaunch:
    launch = object.__new__(owner.OwnedLaunch)  # its state only: no mlx.launch started
    launch.status_dir, launch.plan = tmp_path, owner.STOP_PLANS["run"]
    launch.signals, launch._sent, launch.killed = 0, 0, []
    launch._names = ["SIGINT", "SIGINT"]
    launch._terminated_at, launch._keeping_at, launch._followers_ended = None, None, False
    launch._ended_followers, launch._failed_at = set(), None
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


GROUP = 4000


def _terminated(tmp_path, monkeypatch, now: list[float],
                groups: dict[int, int] | None = None) -> tuple[owner.OwnedLaunch, list, list]:
    """A launch whose group was sent SIGTERM at now[0]: rank 0 (4242) and rank 1 (5151) running,
    in GROUP unless `groups` says (pid -> its group); (launch, signals to the group, (pid, signal)
    sent to a process)."""
    groups = groups or {}
    monkeypatch.setattr(owner.time, "monotonic", lambda: now[0])
    sent: list[int] = []
    to_pid: list[tuple[int, int]] = []
    monkeypatch.setattr(owner.os, "kill", lambda pid, sig: to_pid.append((pid, sig)))
    launch = _launch(tmp_path, sent)
    launch.proc = types.SimpleNamespace(pid=GROUP)  # mlx.launch, its group's leader
    monkeypatch.setattr(owner.os, "getpgid", lambda pid: groups.get(pid, GROUP))
    (tmp_path / "rank0.pid").write_text("4242")
    (tmp_path / "rank1.pid").write_text("5151")
    launch.signals, launch._sent = 2, 1  # the first went to rank 0 already
    launch._forward()
    assert sent == [signal.SIGTERM]
    return launch, sent, to_pid


def test_rank_0_keeping_its_records_late_moves_the_backstop(tmp_path, monkeypatch):
    """Rank 0 began keeping its records 20 s after the SIGTERM (a long flush held its handler):
    the backstop counted from the SIGTERM and killed it 15 s into its own KEEP_RECORDS_S."""
    now = [100.0]
    launch, sent, _ = _terminated(tmp_path, monkeypatch, now)
    now[0] += 20
    launch._end_unanswered_term()
    (tmp_path / f"rank0{rank.KEEPING_SUFFIX}").touch()
    now[0] += 0.1
    launch._end_unanswered_term()  # seen now, at 120.1
    now[0] = 100 + KEEP_RECORDS_S + owner.GRACE_S + 1  # past the SIGTERM's deadline
    launch._end_unanswered_term()
    assert signal.SIGKILL not in sent
    now[0] = 120.1 + KEEP_RECORDS_S + owner.GRACE_S + 0.1
    launch._end_unanswered_term()
    assert sent == [signal.SIGTERM, signal.SIGKILL]


def test_followers_still_running_after_the_sigterm_are_killed_first(tmp_path, monkeypatch):
    now = [100.0]
    launch, sent, to_pid = _terminated(tmp_path, monkeypatch, now)
    now[0] += owner.GRACE_S - 0.1
    launch._end_unanswered_term()
    assert (5151, signal.SIGKILL) not in to_pid
    now[0] += 0.2
    launch._end_unanswered_term()
    launch._end_unanswered_term()  # once
    assert to_pid.count((5151, signal.SIGKILL)) == 1 and (4242, signal.SIGKILL) not in to_pid
    assert sent == [signal.SIGTERM]  # rank 0 still keeps its records


def test_a_follower_the_backstop_killed_is_no_failure_that_ends_rank_0(tmp_path, monkeypatch):
    """Rank 1 stuck in a collective never ran its SIGTERM handler; killed GRACE_S after the
    SIGTERM, it was a dead rank without a status, so _end_stuck_ranks killed the group (rank 0
    mid-keep) 2 x GRACE_S after the SIGTERM instead of KEEP_RECORDS_S + GRACE_S."""
    now = [100.0]
    launch, sent, to_pid = _terminated(tmp_path, monkeypatch, now)
    monkeypatch.setattr(owner, "_alive", lambda pid: (pid, signal.SIGKILL) not in to_pid)
    while now[0] < 100 + KEEP_RECORDS_S + owner.GRACE_S - 0.5:  # the launcher's loop, in short
        now[0] += owner.POLL_S
        launch._end_unanswered_term()
        launch._end_stuck_ranks()
    assert (5151, signal.SIGKILL) in to_pid and sent == [signal.SIGTERM]
    (tmp_path / "rank2.pid").write_text("7272")  # a follower that died by itself still counts
    to_pid.append((7272, signal.SIGKILL))  # (dead, as _alive is mocked)
    launch._end_stuck_ranks()
    assert launch._failed_at is not None


def test_a_followers_pid_gone_to_another_group_is_not_killed(tmp_path, monkeypatch):
    """Rank 1 ended without a status and its pid went to another process (not in the launch's
    group): the backstop's SIGKILL went to that process."""
    now = [100.0]
    launch, _, to_pid = _terminated(tmp_path, monkeypatch, now, groups={5151: 1})
    now[0] += owner.GRACE_S + 0.1
    launch._end_unanswered_term()
    assert (5151, signal.SIGKILL) not in to_pid


def test_rank_0_records_the_signal_the_launcher_got(tmp_path, monkeypatch):
    """SIGHUP to a run's launcher reached rank 0 as SIGINT, and the summary said SIGINT."""
    sent: list[int] = []
    to_pid: list[tuple[int, int]] = []
    monkeypatch.setattr(owner.os, "kill", lambda pid, sig: to_pid.append((pid, sig)))
    launch = _launch(tmp_path, sent)
    (tmp_path / "rank0.pid").write_text("4242")
    launch._names, launch.signals = ["SIGHUP"], 1
    launch._forward()
    assert to_pid == [(4242, signal.SIGINT)]
    monkeypatch.setenv(rank.STATUS_DIR_ENV, str(tmp_path))
    assert rank.forwarded_signal("SIGINT") == "SIGHUP"


def test_rank_0s_sigterm_during_a_flush_starts_keeping_at_once(tmp_path, monkeypatch):
    """A flush under way holds the SIGTERM's answer back; the deadline and rank0.keeping (the
    launcher's backstop) start with the handler, not when the flush ends."""
    monkeypatch.setenv(rank.STATUS_DIR_ENV, str(tmp_path))
    status = rank._Status(0)
    status.run = object()  # a run under way
    deferred: list = []
    monkeypatch.setattr(rank.run_files, "when_not_flushing", lambda answer: deferred.append(answer)
                        or True)
    rank._on_term(status)
    assert len(deferred) == 1 and (tmp_path / f"rank0{rank.KEEPING_SUFFIX}").exists()
    assert status.keep_until is not None
    assert 0 < rank._start_keeping(status) <= KEEP_RECORDS_S  # the same deadline, once


def test_a_rank_the_launchers_group_sigterm_ends_says_so_and_is_no_failure(tmp_path,
                                                                           monkeypatch):
    """The launcher's own SIGTERM to the group (a run's second Ctrl-C) reached a follower while
    rank 0 was alive: it said 'SIGTERM reached its process ..., not through the launcher', a
    failure (the launcher's any_rank_failed then killed rank 0 GRACE_S later, mid-keep)."""
    sent: list[int] = []
    launch = _launch(tmp_path, sent)
    launch._sent, launch.signals = 1, 2  # the first went to rank 0 already
    seen: list[bool] = []
    launch._signal_group = lambda sig: (sent.append(sig),
                                        seen.append((tmp_path / rank.GROUP_STOP_FILE).exists()))
    launch._forward()
    assert sent == [signal.SIGTERM] and seen == [True]  # marked before it is sent
    monkeypatch.setenv(rank.STATUS_DIR_ENV, str(tmp_path))
    exited: list[int] = []
    monkeypatch.setattr(rank.os, "_exit", exited.append)
    (tmp_path / "rank0.pid").write_text(str(owner.os.getpid()))  # rank 0: alive
    (tmp_path / "rank1.pid").write_text("5151")
    follower = rank._Status(1)
    follower.doing = lambda: "step 7"
    rank._terminated(follower)
    assert exited == [143]
    status = json.loads(follower.path.read_text())
    assert status["error"] == "rank 1: stopped by the launcher, which got SIGINT, during step 7"
    assert status["terminated"] is True and not owner.any_rank_failed(tmp_path)


def test_a_group_stop_file_being_written_is_not_read_as_a_signal_name(tmp_path, monkeypatch):
    """The launcher wrote GROUP_STOP_FILE in place and a rank read it mid-write (empty): 'stopped
    by the launcher, which got , during step 7'. It is now written whole (a rename) and an empty
    one names no signal."""
    monkeypatch.setenv(rank.STATUS_DIR_ENV, str(tmp_path))
    monkeypatch.setattr(rank.os, "_exit", lambda code: None)
    (tmp_path / "rank0.pid").write_text(str(owner.os.getpid()))  # rank 0: alive
    (tmp_path / "rank1.pid").write_text("5151")
    (tmp_path / rank.GROUP_STOP_FILE).write_text("")
    follower = rank._Status(1)
    follower.doing = lambda: "step 7"
    rank._terminated(follower)
    assert "which got ," not in json.loads(follower.path.read_text())["error"]
    launch = _launch(tmp_path, [])
    launch._sent, launch.signals = 1, 2
    launch._forward()
    assert (tmp_path / rank.GROUP_STOP_FILE).read_text() == "SIGINT"
    # no temp left beside it (mkstemp names, such as .group_stop.mmlyayab: nothing to filter on)
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(
        [rank.GROUP_STOP_FILE, "rank0.pid", "rank1.pid", follower.path.name])


def test_the_launcher_leaves_a_signal_nohup_said_to_ignore_ignored(tmp_path):
    """`nohup batchsim run --ranks 2` stopped on hangup: OwnedLaunch.wait put its handler over
    the inherited SIG_IGN. It now answers SIGINT and SIGTERM only, and gives them back after."""
    launch = _launch(tmp_path, [])
    seen: dict[signal.Signals, object] = {}

    def wait(timeout: float) -> int:  # mlx.launch ends at once: the handlers as they were then
        seen.update({sig: signal.getsignal(sig) for sig in STOP_SIGNALS})
        return 0

    launch.proc = types.SimpleNamespace(wait=wait)
    wanted = {signal.SIGINT: signal.default_int_handler, signal.SIGTERM: signal.SIG_DFL,
              signal.SIGHUP: signal.SIG_IGN}  # nohup's
    before = {sig: signal.signal(sig, handler) for sig, handler in wanted.items()}
    try:
        assert launch.wait() == 0
        after = {sig: signal.getsignal(sig) for sig in STOP_SIGNALS}
    finally:
        for sig, handler in before.items():
            signal.signal(sig, handler)
    assert seen == {signal.SIGINT: launch._note, signal.SIGTERM: launch._note,
                    signal.SIGHUP: signal.SIG_IGN}
    assert after == wanted
