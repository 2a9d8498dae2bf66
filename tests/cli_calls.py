"""The CLI as the tests call it: in-process (`cli_exit_code`; `_main`, with pytest's capsys) or
as a child process (`_batchsim`; `batchsim` fails on a non-zero exit), the simulated run's flags
(SIM), a command's one-line error (`_one_line`), the JSON on its last stdout line (`last_json`,
`cli_summary`), each flag's help text (`flag_helps`), `size` in-process (`run_size`), a
draft-model sweep's argv, and `batchsim` run as code that flushes at every step (`OFTEN`), its
writer process stopped as it starts (`stopped_writer`), and whether a process has ended (`gone`;
Linux's /proc)."""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

SIM = ["--executor", "sim", "--model", "llama-3.1-8b", "--quantize", "4", "--device-profile",
       "M2 Ultra", "--no-progress"]

# `batchsim` flushing at every step: the writer process starts at the first (a period, even
# 10 ms, may not fall due in a short run on a fast machine: then none starts).
OFTEN = ("import sys; from batchsim.server.results import run_files; "
         "run_files.FLUSH_EVERY_S = 0.0; from batchsim.scripts.cli import main; "
         "sys.exit(main(sys.argv[1:]))")


def stopped_writer(wait_s: float) -> str:
    """Code to put before OFTEN: the writer process stops itself as it starts (a SIGSTOP from a
    test could come after a short run's writer has ended), and the run's close waits `wait_s`
    (FINISH_WAIT_S) for its answer."""
    return ("from batchsim.server.results import record_process as rp; rp._START_CHILD = "
            "'import os, signal; os.kill(os.getpid(), signal.SIGSTOP); ' + rp._START_CHILD; "
            f"rp.FINISH_WAIT_S = {wait_s}; ")


def proc_stat(pid: int) -> list[str]:
    """/proc/PID/stat's fields after the command's name: [state, parent's pid, ...] ([]: gone)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return []


def gone(pid: int) -> bool:
    """Process `pid` has ended: no such process, or a zombie (dead, not yet reaped)."""
    return proc_stat(pid)[:1] in ([], ["Z"], ["X"])


def cli_exit_code(argv: list[str]) -> int:
    """`batchsim ARGV` in this process: its exit code (argparse's too)."""
    from batchsim.scripts.cli import main

    try:
        return main(argv)
    except SystemExit as exc:  # argparse rejected a flag
        return int(exc.code)


def _main(argv: list[str], capsys) -> tuple[int, str, str]:
    """rc, stdout and stderr of the CLI run in-process (argparse's exit included)."""
    rc = cli_exit_code(argv)
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


def batchsim(*args: str, home: Path, timeout: float = 300, check: bool = True):
    """`_batchsim`, raising with the tail of stderr when it exits non-zero (unless not check)."""
    proc = _batchsim(*args, home=home, timeout=timeout)
    if check and proc.returncode != 0:
        raise AssertionError(f"exit {proc.returncode}\n{proc.stderr[-3000:]}")
    return proc


def last_json(stdout: str) -> dict:
    return json.loads(stdout.strip().splitlines()[-1])


def flag_helps(command: str) -> dict[str, str]:
    """Each of COMMAND's flags (its last spelling) and its help text as --help prints it, on one
    line."""
    from batchsim.scripts import cli

    parser = cli.build_parser()
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    formatter = sub.choices[command]._get_formatter()
    return {a.option_strings[-1]: " ".join(formatter._expand_help(a).split())
            for a in sub.choices[command]._actions if a.option_strings and a.help}


def cli_summary(capsys, argv: list[str]) -> dict:
    """The JSON summary `batchsim ARGV` prints last, run in-process; it must exit 0."""
    rc, out, err = _main(argv, capsys)
    assert rc == 0, err
    return last_json(out)


def run_size(tmp_path, *argv: str) -> dict:
    """`batchsim size ARGV --out tmp_path` in-process: its summary."""
    from batchsim.scripts import size

    parser = argparse.ArgumentParser()
    size.add_parser(parser)
    return size.run(parser.parse_args([*argv, "--out", str(tmp_path)]))


def draft_sweep_argv(tmp_path, *flags: str) -> list[str]:
    """A simulated sweep of Llama-3.1-8B 4-bit on an M2 Ultra with Llama-3.2-1B drafting,
    --limit-batch 6 and 700-token prompts, plus `flags`."""
    return ["sweep", "--executor", "sim", "--model", "llama-3.1-8b", "--quantize", "4",
            "--device-profile", "M2 Ultra", "--prompt-len", "700", "--limit-batch", "6",
            "--acceptance", "0.6", "--draft-model", "llama-3.2-1b", "--no-progress",
            "--no-timeline", "--out", str(tmp_path), "--runs-dir", str(tmp_path / "runs"),
            *flags]
