"""A simulated run's program ends without the interpreter freeing its heap object by object, after
what exit must do (atexit's callbacks, the standard streams flushed); a running thread is waited
for as usual."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from tests.cli_calls import last_json

PROBE = """
import atexit, sys, threading, time
from batchsim.scripts import cli

class Held:
    def __del__(self):
        print("freed", flush=True)

held = Held()
atexit.register(lambda: print("atexit ran", file=sys.stderr))
if sys.argv[1] == "thread":
    threading.Thread(target=time.sleep, args=(0.2,)).start()
sys.stdout.write("unflushed line")
cli._exit_without_teardown(3)
print(" returned", flush=True)
"""


def _probe(mode: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", PROBE, mode], capture_output=True, text=True,
                          timeout=60, check=False)


def test_the_program_ends_after_atexit_without_freeing_its_objects():
    done = _probe("plain")
    assert done.returncode == 3
    assert done.stdout == "unflushed line"  # flushed; no "freed": nothing torn down
    assert done.stderr == "atexit ran\n"


def test_a_running_thread_leaves_the_exit_to_the_interpreter():
    done = _probe("thread")
    assert done.returncode == 0 and "returned" in done.stdout and "freed" in done.stdout


def test_only_a_simulated_run_exits_without_teardown(tmp_path, monkeypatch, capsys):
    from batchsim.scripts import cli

    quick = []
    monkeypatch.setattr(cli, "_PROGRAM", True)  # as the batchsim program, argv from sys.argv
    monkeypatch.setattr(cli, "_exit_without_teardown", quick.append)
    sim = ["--executor", "sim", "--device-profile", "M2 Max", "--model", "llama-3.2-1b",
           "--quantize", "4", "--num-prompts", "4", "--no-progress", "--no-timeline"]
    monkeypatch.setattr(sys, "argv", ["batchsim", "run", *sim, "--out", str(tmp_path)])
    assert cli.main() == 0 and quick == [0]
    run_dir = last_json(capsys.readouterr().out)["run_dir"]
    monkeypatch.setattr(sys, "argv", ["batchsim", "report", run_dir])
    assert cli.main() == 0 and quick == [0]  # a report of that run (executor sim) exits as usual


def test_a_pipe_reader_gets_the_whole_json_line_and_the_picture_is_there(tmp_path):
    """The simulated run's program, as a pipeline runs it: stdout a pipe read only after the
    program ended (os._exit), so what was not flushed before it is lost. The last line is the
    whole summary, and the timeline.png it names is on disk when the program has returned.
    Block-buffered stdout, as for a user (PYTHONUNBUFFERED would flush every write)."""
    cmd = [sys.executable, "-m", "batchsim.scripts.cli", "run", "--executor", "sim",
           "--device-profile", "M2 Max", "--model", "llama-3.2-1b", "--quantize", "4",
           "--num-prompts", "300", "--request-rate", "50", "--json", "--out", str(tmp_path)]
    env = {k: v for k, v in os.environ.items() if k != "PYTHONUNBUFFERED"}
    with subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, env=env) as proc:
        # Read after it ended: all it writes must fit the pipe's buffer (64 KiB on Linux), or it
        # blocks writing and the wait times out; the table and the JSON line are a few KB.
        assert proc.wait(timeout=120) == 0  # ended before a byte was read
        out = proc.stdout.read().decode()
    assert len(out) < 32_768, "near the pipe's 64 KiB: read it while the program runs"
    summary = last_json(out)
    assert out.endswith("}\n") and summary["completed"] == 300
    png = summary["timeline_png"]
    assert png and Path(png).read_bytes().startswith(b"\x89PNG")
