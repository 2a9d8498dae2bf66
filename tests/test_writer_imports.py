"""The records' writer process starts light: it shares the run's second core with the drawing child
and a run's close waits for its start-up, so it imports no numpy (records.py, not metrics.py) and
no yaml (json_text.py, not jsonio.py, whose ConfigError comes with the config loader)."""

from __future__ import annotations

import pickle
import subprocess
import sys

from batchsim.server.results import record_process, run_files

GUARD_S = 120.0


def _child_imports(run_dir) -> set[str]:
    """The modules the writer process imports, started as WriterProcess starts it (its -c code,
    the two files' descriptors) on an empty stdin: it writes nothing, answers, exits."""
    files = [open(run_dir / n, "wb") for n in (run_files.STEPS, run_files.REQUESTS)]  # noqa: SIM115
    fds = [f.fileno() for f in files]
    try:
        done = subprocess.run(
            [sys.executable, "-X", "importtime", "-c", record_process._START_CHILD, str(run_dir),
             *map(str, fds)],
            check=False, stdin=subprocess.DEVNULL, capture_output=True, pass_fds=fds,
            timeout=GUARD_S)
    finally:
        for f in files:
            f.close()
    assert done.returncode == 0, done.stderr.decode()[-2000:]
    answer = done.stdout.removeprefix(record_process.START_MARK)
    assert pickle.loads(answer) == ("written", ([], []))  # it ran to its answer
    return {line.rpartition("|")[2].strip() for line in done.stderr.decode().splitlines()
            if line.startswith("import time:")}


def test_the_writer_process_imports_neither_numpy_nor_yaml(tmp_path):
    imported = _child_imports(tmp_path)
    assert "batchsim.server.results.record_writer" in imported  # the import times are its own
    assert not {m for m in imported if m.partition(".")[0] in ("numpy", "yaml")}
