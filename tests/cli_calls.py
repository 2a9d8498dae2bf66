"""The CLI as the tests call it: in-process (`_main`, with pytest's capsys) or as a child process
(`_batchsim`), the simulated run's flags (SIM), and a command's one-line error (`_one_line`)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

SIM = ["--executor", "sim", "--model", "llama-3.1-8b", "--quantize", "4", "--device-profile",
       "M2 Ultra", "--no-progress"]

def _main(argv: list[str], capsys) -> tuple[int, str, str]:
    """rc, stdout and stderr of the CLI run in-process (argparse's exit included)."""
    from batchsim.scripts.cli import main

    try:
        rc = main(argv)
    except SystemExit as exc:
        rc = int(exc.code)
    captured = capsys.readouterr()
    return rc, captured.out, captured.err


def _one_line(err: str) -> str:
    lines = err.strip().splitlines()
    assert len(lines) >= 1 and "Traceback" not in err, err
    return lines[-1]


def _batchsim(*args: str, home: Path | None = None, env: dict | None = None, timeout: float = 120):
    environ = {**os.environ, "HF_HUB_OFFLINE": "1", **(env or {})}
    if home is not None:
        environ["BATCHSIM_HOME"] = str(home)
    return subprocess.run([sys.executable, "-m", "batchsim.scripts.cli", *args],
                          capture_output=True, check=False, text=True, env=environ, timeout=timeout)
