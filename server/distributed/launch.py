"""`batchsim run --ranks N`: start N ranks of the same command through mlx.launch (the ring
backend on loopback, or the hosts of `--hostfile`), pass rank 0's output through, and turn the
ranks' status files into one clear error when any rank failed."""

from __future__ import annotations

import json
import os
import random
import socket
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path

from batchsim.configs import ConfigError
from batchsim.server.distributed import ring_log
from batchsim.server.distributed.owner import OwnedLaunch
from batchsim.server.distributed.rank import (
    LAUNCHER_IGNORED_ENV,
    STATUS_DIR_ENV,
    TIMEOUT_ENV,
    rank_timeout_s,
)
from batchsim.server.platform.signals import STOP_SIGNALS, not_ignored

PASS_ENV = ("BATCHSIM_HOME", "BATCHSIM_BLAS", "BATCHSIM_FAULT_DIE_AT_STEP", TIMEOUT_ENV)


def check_hostfile(path: str, ranks: int) -> None:
    """A bad hostfile is a one-line error here, not mlx.launch's usage text or a hang."""
    from mlx._distributed_utils.common import Hostfile

    try:
        hosts = Hostfile.from_file(path).hosts
    except ValueError as exc:
        raise ConfigError(f"--hostfile: {exc}") from None
    if len(hosts) != ranks:
        raise ConfigError(f"--hostfile {path}: {len(hosts)} hosts for --ranks {ranks}")
    missing = [h.ssh_hostname for h in hosts if not h.ips]
    if missing:
        raise ConfigError(f"--hostfile {path}: host(s) {', '.join(missing)} have no 'ips' (the "
                          "ring backend connects to IP addresses)")


def prebuild(model: str, dtype: str, quantize: int | None, ranks: int, local: bool) -> None:
    """Refuse a model whose heads do not split across the ranks, then build a zoo model once
    before local ranks look for it (two ranks building one directory would race); skipped
    without importing mlx-lm when it is built already."""
    from batchsim.server.models.build import build_id, cache_root, is_built
    from batchsim.server.models.loader import resolve

    early = resolve(model, dtype, quantize, build=False)
    spec = early.spec
    if spec.num_heads % ranks or spec.num_kv_heads % ranks:
        raise ConfigError(f"model {spec.name}: {spec.num_heads} query / {spec.num_kv_heads} "
                          f"KV heads do not split across {ranks} ranks (tensor parallel)")
    if local and early.path == Path() and not is_built(cache_root() / build_id(early.spec.name,
                                                                               dtype, quantize),
                                             early.spec, dtype, quantize):
        resolve(model, dtype, quantize)


def launch_command(argv: list[str], ranks: int, hostfile: str | None, port: int,
                   status_dir: str) -> list[str]:
    """mlx.launch's arguments for running this same `batchsim` command line on every rank."""
    cmd = ["--starting-port", str(port)]
    cmd += ["--hostfile", hostfile] if hostfile else ["--backend", "ring", "-n", str(ranks)]
    answered = not_ignored()  # as the launcher stands now: nohup's SIGHUP ignored, passed down
    ignored = ",".join(s.name for s in STOP_SIGNALS if s not in answered)
    envs = [f"{STATUS_DIR_ENV}={status_dir}", f"{LAUNCHER_IGNORED_ENV}={ignored}"]
    envs += [f"{k}={os.environ[k]}" for k in PASS_ENV if k in os.environ]
    for e in envs:
        cmd += ["--env", e]
    return cmd + ["--", sys.executable, "-m", "batchsim.scripts.cli", *argv]


def launch(argv: list[str], ranks: int, hostfile: str | None, server: bool = False) -> None:
    """Run the ranks; rank 0 prints the tables and the summary. Raises RuntimeError naming the
    rank that failed first (a dead rank over the others it took down). SIGINT/SIGTERM here stop
    the ranks through rank 0 (owner.STOP_PLANS); a run stopped so raises KeyboardInterrupt once
    they ended, as a 1-rank run's Ctrl-C does (a server stopped so just returns, unless it was
    stopped before it served). Nothing of the
    run outlives this call."""
    if hostfile:
        check_hostfile(hostfile, ranks)
    timeout_s = rank_timeout_s()  # a bad value: one line, before any process starts
    with tempfile.TemporaryDirectory(prefix="batchsim-ranks-") as status_dir:
        cmd = launch_command(argv, ranks, hostfile, free_port(ranks), status_dir)
        owned = OwnedLaunch(cmd, Path(status_dir), "serve" if server else "run", timeout_s)
        try:
            returncode = owned.wait()
        finally:
            owned.kill()
        error = ranks_error(Path(status_dir), ranks, owned.killed, owned.stopped)
        # Kept only where an error names them; else they go with the status directory.
        reported = not owned.signals and (error or returncode)
        ring = ring_log.keep(Path(status_dir), rank0_run_dir(Path(status_dir))) if reported else ""
        served = server and _rank_ok(Path(status_dir), 0)
        stopped = _rank_ok(Path(status_dir), 0, "interrupted")  # a signal sent to rank 0 itself
    if owned.signals and served:
        return  # the user stopped a server that ran: the ranks' "stopped" lines are no failure
    if owned.signals:  # a run (rank 0 printed its summary, marked interrupted) or a server that
        raise KeyboardInterrupt  # was stopped while its ranks started: interrupted either way
    if error:
        raise RuntimeError(error + ring)
    if returncode:
        raise RuntimeError(f"mlx.launch exited with status {returncode}{ring}")
    if stopped:  # its summary says interrupted: the exit status says so too, as for a 1-rank run
        raise KeyboardInterrupt


def _rank_ok(status_dir: Path, rank: int, field: str = "ok") -> bool:
    """Whether `rank` ended well (a server: it served, then drained); or its status's `field`."""
    path = status_dir / f"rank{rank}.json"
    return path.exists() and bool(json.loads(path.read_text()).get(field))


def ranks_error(status_dir: Path, ranks: int, killed: Sequence[int] = (),
                stopped: Sequence[int] = ()) -> str | None:
    """One line from the ranks' status files: the dead ranks, those `killed` for not ending after
    another failed, then what the others reported (the same message from several ranks once),
    then the steps that ranks stopped by mlx.launch were waiting in; last, where rank 0 kept the
    run's records (its summary marked interrupted)."""
    statuses = {r: json.loads(p.read_text()) for r in range(ranks)
                if r not in killed and (p := status_dir / f"rank{r}.json").exists()}
    kept = statuses.get(0, {}).get("run_dir")
    error = _failures(statuses, ranks, killed, stopped)
    return f"{error}; records kept in {kept}" if error and kept else error


def _failures(statuses: dict[int, dict], ranks: int, killed: Sequence[int],
              stopped: Sequence[int]) -> str | None:
    if stopped:  # what the others saw of it (waiting for its next plan) says nothing more
        return "; ".join(f"rank {r} stayed stopped (SIGSTOP) past the rank timeout "
                         f"({TIMEOUT_ENV}); the run was ended" for r in stopped)
    dead = [r for r in range(ranks) if r not in killed and r not in statuses]
    errors, stopped_by_launch, waiting = [], [], []
    for status in statuses.values():
        if status["ok"]:
            continue
        if not status.get("terminated"):
            errors.append(status["error"])
        elif status.get("during"):
            waiting.append(status["error"])
        else:
            stopped_by_launch.append(status["error"])
    if not dead and not killed and not errors and not stopped_by_launch and not waiting:
        return None
    parts = [f"rank {r} died (killed or crashed before reporting)" for r in dead]
    parts += [f"rank {r} did not answer (stopped or hung) and was killed" for r in killed]
    parts += _once(errors) + waiting
    return "; ".join(parts or stopped_by_launch)


def _once(errors: list[str]) -> list[str]:
    """'rank 0: X', 'rank 1: X' -> 'ranks 0, 1: X' (e.g. different model files, seen by all)."""
    by_text: dict[str, list[str]] = {}
    for error in errors:
        head, sep, text = error.partition(": ")
        rank = head.removeprefix("rank ") if sep and head.startswith("rank ") else None
        if rank is None:
            by_text.setdefault(error, [])
        else:
            by_text.setdefault(text, []).append(rank)
    return [f"rank{'s' if len(r) > 1 else ''} {', '.join(r)}: {text}" if r else text
            for text, r in by_text.items()]


def rank0_run_dir(status_dir: Path) -> str | None:
    """Where rank 0 keeps the run's records (None: it reported none)."""
    path = status_dir / "rank0.json"
    return json.loads(path.read_text()).get("run_dir") if path.exists() else None


def free_port(ranks: int) -> int:
    """A starting port with `ranks` free ports after it on loopback (parallel runs must not
    meet)."""
    for _ in range(50):
        port = random.randrange(20000, 60000 - ranks)
        if all(_is_free(port + i) for i in range(ranks)):
            return port
    raise RuntimeError("no free loopback ports for the ranks")


def _is_free(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True
