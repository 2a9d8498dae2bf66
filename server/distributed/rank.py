"""One rank of `batchsim run|serve --ranks N`, started by mlx.launch: join the group, refuse
different model files, load this rank's shard, then rank 0 runs the workload (or serves) while the
others follow its plans. Each rank leaves a status file for the launching process."""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import signal
import sys
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from batchsim.configs import ConfigError
from batchsim.server.engine.interrupts import Interrupts
from batchsim.server.platform.signals import follow_launcher
from batchsim.server.results import record_process, run_files

if TYPE_CHECKING:
    from batchsim.server.distributed.executor import LeaderExecutor
    from batchsim.server.engine.run_config import RunConfig
    from batchsim.server.engine.run_path import RunView
    from batchsim.server.engine.session import Session

STATUS_DIR_ENV = "BATCHSIM_RANKS_DIR"  # set by the launcher: where ranks leave their status
LAUNCHER_IGNORED_ENV = "BATCHSIM_LAUNCHER_IGNORED"  # its stop signals ignored: "SIGHUP,..."
DIE_AT_STEP_ENV = "BATCHSIM_FAULT_DIE_AT_STEP"  # tests: rank 1 kills itself at this step
TIMEOUT_ENV = "BATCHSIM_RANK_TIMEOUT_S"
DEFAULT_TIMEOUT_S = 600.0  # per step: a long prefill on a loaded CPU must not trip it
PARENT_POLL_S = 0.25  # how often a rank checks that mlx.launch is still there
KEEP_RECORDS_S = 30.0  # a failing rank 0 keeping its records exits anyway after this long
# In the status directory: the signal the launcher got (SIGHUP, SIGTERM), which it forwards to
# rank 0 as SIGINT; and rank0.keeping, made when rank 0 begins keeping its records (the
# launcher's backstop counts KEEP_RECORDS_S from it).
STOP_SIGNAL_FILE = "stop_signal"
# Made by the launcher before its own SIGTERM to the whole group (its text: the signal it got):
# a rank that SIGTERM ends says the launcher stopped it, not that someone else did or it failed.
GROUP_STOP_FILE = "group_stop"
KEEPING_SUFFIX = ".keeping"


def rank_timeout_s() -> float:
    """BATCHSIM_RANK_TIMEOUT_S, seconds a step may take before a rank is taken as hung."""
    raw = os.environ.get(TIMEOUT_ENV)
    try:
        value = DEFAULT_TIMEOUT_S if raw is None else float(raw)
    except ValueError:
        value = float("nan")
    if not 0 < value < float("inf"):
        raise ConfigError(f"{TIMEOUT_ENV}={raw!r}: expected seconds, a number > 0")
    return value


def is_rank_process() -> bool:
    return STATUS_DIR_ENV in os.environ and "MLX_RANK" in os.environ


class _Status:
    def __init__(self, rank: int):
        self.path = Path(os.environ[STATUS_DIR_ENV]) / f"rank{rank}.json"
        self.rank = rank
        self.doing: Callable[[], str | None] = lambda: None  # the step under way (the watchdog's)
        self.run: Interrupts | None = None  # rank 0's run under way: a failure ends it, kept
        self.keep_until: float | None = None  # monotonic: when rank 0 gives up keeping records
        self.term_pending = False  # a SIGTERM came while rank 0's run wrote its records: after them
        self.expire_pending: str | None = None  # the watchdog's message, likewise
        self.unkept: threading.Timer | None = None  # _exit_unkept_later's: cancelled once kept
        self.interrupted = False  # rank 0's run ended so (a signal sent to it): the launcher's 130

    def write(self, ok: bool, error: str | None = None, **extra: Any) -> None:
        """Best effort: without its directory (a remote host, the launcher gone) no one reads it."""
        status = {"rank": self.rank, "ok": ok, "error": error, **extra}
        with contextlib.suppress(OSError):
            run_files.replace_atomically(self.path, json.dumps(status).encode())

    def write_pid(self) -> None:
        """The launcher's: to signal rank 0, and to see which local ranks are still running."""
        try:
            self.path.with_suffix(".pid").write_text(str(os.getpid()))
        except OSError:
            pass


def run_rank(cfg: RunConfig, out_dir: Path, view: RunView) -> dict | None:
    """This rank's part of `run --ranks`: rank 0 runs the workload into a run directory under
    `out_dir`, shown by `view`, and returns its summary; the others follow and return None."""
    from batchsim.server.engine.run_path import run_session

    with joined(cfg, forwarded=(signal.SIGINT,)) as lead:  # owner.STOP_PLANS["run"]
        if lead is None:
            return None
        status = lead.status
        run = status.run = _RunInterrupts(lead.stops, name=forwarded_signal)
        summary = run_session(lead.session, out_dir, view, run)
        status.interrupted = bool(summary.get("interrupted"))
        _run_ended(status, run, summary.get("run_dir"))
        return lead.finish(summary)


def _run_ended(status: _Status, run: _RunInterrupts, run_dir: str | None) -> None:
    """Rank 0's run kept its records in `run_dir`: a SIGTERM or the watchdog's expiry that came
    while it wrote them ends the rank now (as either does at once at any other time)."""
    run.abandoned_in, run.done = run_dir, True  # kept: a SIGTERM now names it
    if status.unkept is not None:  # kept in time: the exit below is the pending one's
        status.unkept.cancel()
    if status.term_pending:
        _terminated(status)
    if status.expire_pending is not None:  # set before the watchdog looked at `done`
        _expired(status, status.expire_pending)


class _RunInterrupts(Interrupts):
    """Rank 0's: knows whether its run has begun (the runner set `abandon`) and ended, so that a
    SIGTERM while the run writes its records and summary (`abandon` unset again) waits for them:
    the second Ctrl-C right after the first stopped the sending exited there, no summary.json."""

    started = done = False

    @property  # type: ignore[override]
    def abandon(self) -> Callable[[str], None] | None:
        return self._abandon

    @abandon.setter
    def abandon(self, answer: Callable[[str], None] | None) -> None:
        self._abandon = answer
        self.started = self.started or answer is not None

    def finishing(self) -> bool:
        """The run is writing its records and summary (no longer abandonable, not yet done)."""
        return self.started and self._abandon is None and not self.done


@dataclasses.dataclass
class Lead:
    """Rank 0's part: a session whose executor broadcasts each plan to the other ranks."""

    session: Session
    leader: LeaderExecutor
    status: _Status
    stops: tuple[signal.Signals, ...]  # as Ctrl-C: stop sending (serving), records kept
    t0: float = dataclasses.field(default_factory=time.perf_counter)

    def finish(self, summary: dict[str, Any]) -> dict[str, Any]:
        """Stop the followers; `summary` with what the ranks cost."""
        self.leader.stop()  # after a failure rank 0 exits instead, and mlx.launch stops the others
        channel = self.leader.channel
        summary.update({
            "ranks": channel.size, "parallel": "tensor",
            "plan_broadcast_s": channel.broadcast_s, "plan_messages": channel.num_messages,
            "ranks_wall_s": time.perf_counter() - self.t0,
        })
        return summary


def follow_launchers_word(environ: Mapping[str, str] = os.environ) -> tuple[signal.Signals, ...]:
    """Sets ignored here every stop signal the launcher ignored (its word, LAUNCHER_IGNORED_ENV:
    a remote rank starts from sshd's dispositions, fatal, not its nohup launcher's); returns the
    others this rank answers as Ctrl-C, less SIGTERM (the launcher's stop, answered apart)."""
    answered = follow_launcher(environ.get(LAUNCHER_IGNORED_ENV))
    return tuple(sig for sig in answered if sig != signal.SIGTERM)


@contextlib.contextmanager
def joined(cfg: RunConfig, forwarded: tuple[signal.Signals, ...] = ()
           ) -> Iterator[Lead | None]:
    """Join the group, refuse different model files, load this rank's shard. Rank 0 gets its
    Lead to run or serve with in the block; the others follow rank 0's plans to the end and get
    None. A failure, here or in the block, ends this rank in one line (and its status file).
    Rank 0's stop signals (Lead.stops) are noted while it loads and answered once the run starts:
    those the launcher answers, and `forwarded`: the launcher's own stop comes as it (run: SIGINT,
    answered even where a `cmd &` launcher ignores a Ctrl-C of its own)."""
    import mlx.core as mx
    from batchsim.server.engine import interrupts

    rank = int(os.environ["MLX_RANK"])
    status = _Status(rank)
    _exit_with_parent()
    signal.signal(signal.SIGTERM, lambda *_: _on_term(status))
    stops = tuple(dict.fromkeys((*forwarded, *follow_launchers_word())))  # on every rank, once
    interrupts.hold(stops if rank == 0 else (signal.SIGINT,))
    status.write_pid()
    try:
        yield _join(cfg, _init_group(mx), status, stops)
    except ConfigError as exc:
        status.write(False, f"rank {rank}: {exc}")
        raise
    except Exception as exc:  # noqa: BLE001 - one line per rank, not a traceback
        message = f"rank {rank}: {_plain(exc)}"
        status.write(False, message, run_dir=_keep_records(status, message, 1))
        from batchsim.server.distributed.channel import ModelMismatch

        if rank == 0 or not isinstance(exc, ModelMismatch):  # every rank sees that one: say it once
            print(message, file=sys.stderr, flush=True)
        raise SystemExit(1) from None
    status.write(True, interrupted=status.interrupted)


def _join(cfg: RunConfig, group: Any, status: _Status, stops: tuple[signal.Signals, ...]
          ) -> Lead | None:
    from batchsim.server.distributed.channel import PlanChannel, check_same_model, model_fingerprint
    from batchsim.server.distributed.doorbell import Doorbell
    from batchsim.server.distributed.executor import LeaderExecutor, follow, shard_for
    from batchsim.server.distributed.watchdog import Watchdog
    from batchsim.server.engine.session import open_session
    from batchsim.server.models.loader import resolve

    channel = PlanChannel(group)
    ref = resolve(cfg.model, cfg.dtype if cfg.dtype != "auto" else _auto(), cfg.quantize)
    check_same_model(channel.gather_bytes(model_fingerprint(ref.path)), ref.path)
    channel.doorbell = Doorbell.open(channel)
    session = open_session(cfg, prepare_model=shard_for(group, ref.name))
    timeout_s = rank_timeout_s()
    watchdog = Watchdog(timeout_s, on_expire=lambda msg: _expire(status, msg))
    status.doing = watchdog.current
    if channel.rank != 0:
        die = os.environ.get(DIE_AT_STEP_ENV)
        follow(session.executor, channel, watchdog, int(die) if die and channel.rank == 1 else None)
        return None
    leader = LeaderExecutor(session.executor, channel, watchdog)
    return Lead(dataclasses.replace(session, executor=leader), leader, status, stops)


def _init_group(mx: Any) -> Any:
    """mx.distributed.init with SIGINT blocked: the ring backend's accept() fails on EINTR
    ("Accept failed (error: 4)"); a SIGINT that came meanwhile is held once init returns."""
    old = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})
    try:
        return mx.distributed.init(strict=True)
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, old)


def _exit_with_parent() -> None:
    """A rank whose mlx.launch is gone (killed with its launcher) ends too: nothing else would
    end a rank waiting in a collective or serving on its port."""
    parent = os.getppid()

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(PARENT_POLL_S)
        os._exit(1)  # no one is left to read a message

    threading.Thread(target=watch, daemon=True, name="rank-parent").start()


def _plain(exc: BaseException) -> str:
    return str(exc).replace("[ring] ", "ring backend: ") or type(exc).__name__


def _auto() -> str:
    from batchsim.server.platform import env

    return env.default_dtype()


def forwarded_signal(name: str) -> str:
    """The name rank 0 records for the launcher's SIGINT: the signal the launcher itself got
    (a SIGHUP or SIGTERM to it stops the run as Ctrl-C does); `name` when it left none."""
    status_dir = os.environ.get(STATUS_DIR_ENV)
    return (status_dir and _read_text(Path(status_dir) / STOP_SIGNAL_FILE)) or name


def _read_text(path: Path) -> str | None:
    """A file the launcher left in the status directory; None if it left none."""
    try:
        return path.read_text()
    except OSError:
        return None


def _on_term(status: _Status) -> None:
    """SIGTERM: rank 0 of a run begins keeping its records now, even while a flush under way
    holds the answer back (its deadline and the launcher's count from here)."""
    if status.run is not None:
        _start_keeping(status)
    run_files.when_not_flushing(lambda: _terminated(status)) or _terminated(status)


def _start_keeping(status: _Status) -> float:
    """Rank 0 begins keeping its records (once): its deadline is set and rank0.keeping made for
    the launcher; the seconds left until the deadline."""
    if status.keep_until is None:
        status.keep_until = time.monotonic() + KEEP_RECORDS_S
        record_process.keep_until_s = status.keep_until  # the writer's close wait: within it
        with contextlib.suppress(OSError):
            status.path.with_suffix(KEEPING_SUFFIX).touch()
    return max(0.0, status.keep_until - time.monotonic())


def _terminated(status: _Status) -> None:
    """SIGTERM: the launcher's to the group (GROUP_STOP_FILE names the signal it got: a run's
    second Ctrl-C), mlx.launch's after another rank failed (a local peer is gone), or one sent to
    this rank's process by someone else; keep an error this rank already reported, else say which,
    and the step it was in. Rank 0's run keeps its records and an interrupted summary."""
    doing = status.doing()
    launcher = _read_text(status.path.parent / GROUP_STOP_FILE)
    by_launch = bool(launcher) or peers_lost(status.path.parent, status.rank)
    if launcher:
        message = (f"rank {status.rank}: stopped by the launcher, which got {launcher}"
                   + (f", during {doing}" if doing else ""))
    elif by_launch:
        message = (f"rank {status.rank}: stopped by mlx.launch (another rank failed)"
                   + (f" during {doing}, waiting on its peers" if doing else ""))
    else:
        message = (f"rank {status.rank}: SIGTERM reached its process (pid {os.getpid()}), not "
                   "through the launcher, and stopped the run"
                   + (f" during {doing}" if doing else ""))
    run = status.run
    if isinstance(run, _RunInterrupts) and run.finishing():  # run_rank ends the rank after them
        status.term_pending = True
        _exit_unkept_later(status, message, 143)
        return
    run_dir = _keep_records(status, message, 143)
    if not _reported_error(status.path):
        status.write(False, message, terminated=by_launch, during=doing, run_dir=run_dir)
    os._exit(143)


def peers_lost(status_dir: Path, rank: int = 0) -> bool:
    """Whether a peer of `rank` on this host has stopped: it left a status file (followers write
    one only when they end) or its process is gone. Ranks on other hosts leave no pid here."""
    for pid_path in status_dir.glob("rank*.pid"):
        if pid_path.stem == f"rank{rank}":
            continue
        if pid_path.with_suffix(".json").exists():
            return True
        try:
            os.kill(int(pid_path.read_text()), 0)
        except ProcessLookupError:
            return True
        except (OSError, ValueError):
            pass  # not ours to signal, or a pid file being written: treat as alive
    return False


def _keep_records(status: _Status, reason: str, exit_code: int) -> str | None:
    """Rank 0 in a run that cannot go on: end it where it stands (records, a summary marked
    interrupted with `reason`), unless it ended so already; its run directory, if kept. Best
    effort: the rank exits next, with `exit_code` after KEEP_RECORDS_S even if keeping them
    blocks (the watchdog's thread while the main one waits in a collective)."""
    run = status.run
    if run is None:
        return None
    if run.abandon is not None:
        timer = _exit_unkept_later(status, reason, exit_code)
        try:
            with contextlib.suppress(Exception):  # the rank's own error line matters more
                run.abandon(reason)
        finally:
            timer.cancel()  # kept: the caller exits now
    return run.abandoned_in


def _reported_error(path: Path) -> bool:
    try:
        return not json.loads(path.read_text())["ok"]
    except (OSError, ValueError, KeyError):
        return False


def _exit_unkept_later(status: _Status, reason: str, exit_code: int) -> threading.Timer:
    """_exit_unkept once rank 0's time to keep its records (KEEP_RECORDS_S from when it began)
    is up; the timer, started."""
    timer = threading.Timer(_start_keeping(status), _exit_unkept, (status, reason, exit_code))
    timer.daemon = True
    timer.start()
    status.unkept = timer
    return timer


def _exit_unkept(status: _Status, reason: str, exit_code: int) -> None:
    if not _reported_error(status.path):
        status.write(False, f"{reason} (records not kept: still writing after "
                     f"{KEEP_RECORDS_S:g} s)")
    os._exit(exit_code)


def _expire(status: _Status, message: str) -> None:
    """The watchdog's (its thread): rank 0's run is ended where it stands and the rank exits 3;
    while the run writes its records and summary (the deadline passed as the last step ended),
    run_rank does so once they are written, or _exit_unkept after KEEP_RECORDS_S."""
    print(message, file=sys.stderr, flush=True)  # before keeping records, which may not end
    status.expire_pending = message  # before `done` is looked at: run_rank sees one or the other
    run = status.run
    if isinstance(run, _RunInterrupts) and run.finishing():
        _exit_unkept_later(status, message, 3)
        return
    _expired(status, message)


def _expired(status: _Status, message: str) -> None:
    status.write(False, message, run_dir=_keep_records(status, message, 3))
    os._exit(3)
