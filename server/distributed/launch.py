"""`batchsim run --ranks N`: start N ranks of the same command through mlx.launch (the ring
backend on loopback, or the hosts of `--hostfile`), pass rank 0's output through, and turn the
ranks' status files into one clear error when any rank failed."""

from __future__ import annotations

import json
import os
import random
import signal
import socket
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from batchsim.configs import ConfigError
from batchsim.server.distributed.rank import STATUS_DIR_ENV

# mlx.launch's main(), with its select() told to never wait for the ranks' stdin to be writable:
# a pipe always is, so each rank's output thread would spin a core (an idle server's for hours).
# Nothing is ever written to the ranks' stdin here.
_LAUNCH_MAIN = ("import select, mlx._distributed_utils.launch as m; "
                "m.select = lambda r, w, x, t: select.select(r, [], x, t); m.main()")
PASS_ENV = ("BATCHSIM_HOME", "BATCHSIM_BLAS", "BATCHSIM_FAULT_DIE_AT_STEP", "BATCHSIM_RANK_TIMEOUT_S")


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
        raise ConfigError(f"--hostfile {path}: host(s) {', '.join(missing)} have no 'ips' (the ring "
                          "backend connects to IP addresses)")


def prebuild(model: str, dtype: str, quantize: int | None, ranks: int, local: bool) -> None:
    """Refuse a model whose heads do not split across the ranks, then build a zoo model once
    before local ranks look for it (two ranks building one directory would race); skipped
    without importing mlx-lm when it is built already."""
    from batchsim.server.models.build import build_id, cache_root, is_built
    from batchsim.server.models.loader import resolve

    early = resolve(model, dtype, quantize, build=False)
    spec = early.spec
    if spec.num_heads % ranks or spec.num_kv_heads % ranks:
        raise ConfigError(f"model {spec.name}: {spec.num_heads} query / {spec.num_kv_heads} KV heads "
                          f"do not split across {ranks} ranks (tensor parallel)")
    if local and early.path == Path() and not is_built(cache_root() / build_id(early.spec.name, dtype, quantize),
                                             early.spec, dtype, quantize):
        resolve(model, dtype, quantize)


def launch_command(argv: list[str], ranks: int, hostfile: str | None, port: int,
                   status_dir: str) -> list[str]:
    """mlx.launch running this same `batchsim` command line on every rank."""
    cmd = [sys.executable, "-c", _LAUNCH_MAIN, "--starting-port", str(port)]
    cmd += ["--hostfile", hostfile] if hostfile else ["--backend", "ring", "-n", str(ranks)]
    envs = [f"{STATUS_DIR_ENV}={status_dir}"]
    envs += [f"{k}={os.environ[k]}" for k in PASS_ENV if k in os.environ]
    for e in envs:
        cmd += ["--env", e]
    return cmd + ["--", sys.executable, "-m", "batchsim.scripts.cli", *argv]


def launch(argv: list[str], ranks: int, hostfile: str | None, server: bool = False) -> None:
    """Run the ranks; rank 0 prints the tables and the summary. Raises RuntimeError naming the
    rank that failed first (a dead rank over the others it took down). `server`: SIGINT/SIGTERM
    here stop the ranks through rank 0 (it drains, then tells the others to stop)."""
    if hostfile:
        check_hostfile(hostfile, ranks)
    with tempfile.TemporaryDirectory(prefix="batchsim-ranks-") as status_dir:
        cmd = launch_command(argv, ranks, hostfile, free_port(ranks), status_dir)
        if server:
            proc, stopped = run_stoppable(cmd, Path(status_dir))
        else:
            proc, stopped = subprocess.Popen(cmd, stdin=subprocess.PIPE), False
            proc.wait()
        error = ranks_error(Path(status_dir), ranks)
    if stopped:
        return  # the user stopped it: the ranks' "stopped" lines are no failure
    if error:
        raise RuntimeError(error)
    if proc.returncode:
        raise RuntimeError(f"mlx.launch exited with status {proc.returncode}")


def run_stoppable(cmd: list[str], status_dir: Path) -> tuple[Any, bool]:
    """mlx.launch in a session of its own (a terminal's Ctrl-C reaches only this process); the
    first two signals go to rank 0 (drain, then cut the drain short), a third kills them all."""
    # stdin: a pipe never written, not /dev/null: mlx.launch polls stdin, and /dev/null is always
    # readable (at EOF), so it would spin a core for as long as the server runs.
    proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, start_new_session=True)
    signals: list[int] = []

    def forward(signum: int, _frame: Any) -> None:
        signals.append(signum)
        rank0 = _read_pid(status_dir / "rank0.pid")
        try:
            if rank0 is not None and len(signals) <= 2:
                os.kill(rank0, signal.SIGTERM)
            else:  # rank 0 not started yet (or deaf): end the whole group
                os.killpg(proc.pid, signal.SIGTERM if len(signals) <= 2 else signal.SIGKILL)
        except ProcessLookupError:
            pass

    previous = {s: signal.signal(s, forward) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        proc.wait()
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)
    return proc, bool(signals)


def _read_pid(path: Path) -> int | None:
    try:
        return int(path.read_text())
    except (OSError, ValueError):
        return None


def ranks_error(status_dir: Path, ranks: int) -> str | None:
    """One line from the ranks' status files: the dead ranks, then what the others reported (the
    same message from several ranks once), then the steps that ranks stopped by mlx.launch were
    waiting in."""
    dead, errors, stopped, waiting = [], [], [], []
    for r in range(ranks):
        path = status_dir / f"rank{r}.json"
        if not path.exists():
            dead.append(r)
            continue
        status = json.loads(path.read_text())
        if status["ok"]:
            continue
        if not status.get("terminated"):
            errors.append(status["error"])
        elif status.get("during"):
            waiting.append(status["error"])
        else:
            stopped.append(status["error"])
    if not dead and not errors and not stopped and not waiting:
        return None
    parts = [f"rank {r} died (killed or crashed before reporting)" for r in dead]
    parts += _once(errors) + waiting
    return "; ".join(parts or stopped)


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


def free_port(ranks: int) -> int:
    """A starting port with `ranks` free ports after it on loopback (parallel runs must not meet)."""
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
