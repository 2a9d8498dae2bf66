"""Fixes of reviewer r3's findings on h8's adversarial-pass commits (575be2e..ad28c2e)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time

import pytest

from tests.cli_calls import SIM, _main


@pytest.mark.timeout(120)
def test_a_bare_workload_from_a_pipe_runs_what_the_pipe_holds(capsys, tmp_path):
    """`batchsim run <(printf 'num_prompts: 3\\n...')`: the file was read twice, the second read
    of the pipe empty, so the default workload ran (64 requests, exit 0)."""
    fifo = tmp_path / "workload"
    os.mkfifo(fifo)
    text = "num_prompts: 3\ninput_len: 16\noutput_len: 4\n"
    writer = threading.Thread(target=lambda: fifo.write_text(text), daemon=True)
    writer.start()
    out = tmp_path / "out"
    rc, _, err = _main(["run", *SIM, str(fifo), "--no-timeline", "--out", str(out)], capsys)
    assert rc == 0, err
    (run_dir,) = out.iterdir()
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["completed"] == 3, summary


@pytest.mark.timeout(60)
def test_a_dangling_link_as_the_output_directory_is_refused_not_looped_on(capsys, tmp_path):
    """mkdir(parents=True) raised FileExistsError for the link itself and the next name was tried
    for ever; `compare --runs-dir <dangling link>` hung (--runs-dir was never checked)."""
    from batchsim.configs import ConfigError
    from batchsim.server.results import jsonio

    link = tmp_path / "gone"
    link.symlink_to(tmp_path / "nowhere")
    with pytest.raises(ConfigError, match="cannot write a run directory there"):
        jsonio.new_run_dir(link, "m")
    argv = ["compare", "--executor", "sim", "--device-profile", "M2 Max", "--model",
            "llama-3.2-1b", "--quantize", "4", "--batch", "2", "--num-prompts", "2",
            "--no-timeline", "--out", str(tmp_path / "out"), "--runs-dir", str(link)]
    rc, _, err = _main(argv, capsys)
    assert rc == 2 and f"output directory {link}: not writable" in err, err
    assert not (tmp_path / "out").exists() or not list((tmp_path / "out").iterdir())


def test_run_directories_of_one_name_are_capped(tmp_path, monkeypatch):
    from batchsim.configs import ConfigError
    from batchsim.server.results import jsonio

    # a second passes as the tries end: the message names the name tried, not the next second's
    stamps = iter(["20261205-080000"] * 3 + ["20261205-080001"])
    monkeypatch.setattr(jsonio, "timestamp", lambda: next(stamps))
    monkeypatch.setattr(jsonio, "MAX_SAME_NAME", 3)
    for name in ("20261205-080000-m", "20261205-080000-m-2", "20261205-080000-m-3"):
        (tmp_path / name).mkdir()
    with pytest.raises(ConfigError,
                       match="3 run directories named 20261205-080000-m exist already"):
        jsonio.new_run_dir(tmp_path, "m")


_IGNORED_THEN_SENT = """
import os, signal, sys
sig = getattr(signal, sys.argv.pop(1))
signal.signal(sig, signal.SIG_IGN)  # as nohup (SIGHUP) or `cmd &` in a script (SIGINT) leave it
sys.argv[0] = "batchsim"  # the program itself: cli.py's start-up handler is installed
from batchsim.server.platform import blas
blas.preload()
from batchsim.server.engine import runner
drive = runner._Run.drive
def sent(run):
    os.kill(os.getpid(), sig)
    return drive(run)
runner._Run.drive = sent
from batchsim.scripts.cli import main
print("start-up handler:", signal.getsignal(sig) is signal.SIG_IGN, file=sys.stderr)
sys.exit(main(sys.argv[1:]))
"""


@pytest.mark.timeout(300)
@pytest.mark.parametrize("sig", ["SIGHUP", "SIGINT"])
def test_a_signal_the_shell_said_to_ignore_stays_ignored(tmp_path, sig):
    """Under nohup a SIGHUP stopped the run (exit 130, 0 completed): Interrupts installed its
    handler over the inherited SIG_IGN; cli.py replaced an ignored SIGINT when imported."""
    import subprocess
    import sys

    proc = subprocess.run([sys.executable, "-c", _IGNORED_THEN_SENT, sig, "run", *SIM,
                           "--num-prompts", "3", "--input-len", "16", "--output-len", "4",
                           "--no-timeline", "--out", str(tmp_path)],
                          capture_output=True, text=True, timeout=280, check=False)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "start-up handler: True" in proc.stderr
    (run_dir,) = tmp_path.iterdir()
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["completed"] == 3 and not summary.get("interrupt_reason"), summary


def test_two_writers_of_one_file_each_replace_it_whole(tmp_path):
    """One fixed temp name (`.summary.json.tmp`) for every writer: two threads writing one file
    failed 15 rounds of 15 ("No such file or directory"), one's rename taking the other's temp."""
    from batchsim.server.results.run_files import replace_atomically

    path, failed = tmp_path / "summary.json", []

    def write(data: bytes) -> None:
        try:
            for _ in range(300):
                replace_atomically(path, data)
        except OSError as exc:
            failed.append(exc)

    threads = [threading.Thread(target=write, args=(bytes([65 + i]) * 50_000,)) for i in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not failed, failed[0]
    assert path.read_bytes() in (b"A" * 50_000, b"B" * 50_000)
    assert [p.name for p in tmp_path.iterdir()] == ["summary.json"]


def test_an_interrupted_write_leaves_no_temp_and_a_file_keeps_its_mode(tmp_path, monkeypatch):
    from batchsim.server.results import run_files

    path = tmp_path / "summary.json"
    umask = os.umask(0o027)  # a new file: made as open() makes it, under the umask as it is now
    try:
        run_files.replace_atomically(path, b"{}")
    finally:
        os.umask(umask)
    assert path.stat().st_mode & 0o777 == 0o640
    path.chmod(0o600)
    run_files.replace_atomically(path, b"[]")
    assert path.stat().st_mode & 0o777 == 0o600 and path.read_bytes() == b"[]"

    def pressed(*_args):
        raise KeyboardInterrupt

    def no_modes(*_args):  # vfat, some network mounts
        raise PermissionError(1, "Operation not permitted")

    monkeypatch.setattr(run_files.os, "fchmod", no_modes)
    run_files.replace_atomically(path, b"[1]")  # written all the same, as open() would
    assert path.read_bytes() == b"[1]"
    monkeypatch.setattr(run_files.os, "replace", pressed)
    with pytest.raises(KeyboardInterrupt):
        run_files.replace_atomically(path, b"1")
    assert [p.name for p in tmp_path.iterdir()] == ["summary.json"]


@pytest.mark.timeout(120)
def test_a_count_past_int64_is_skipped_with_a_note_that_names_it(capsys, tmp_path):
    """Two fixes of one overflow (`< 2**63` on every number, `<= INT64_MAX` on int fields): now
    int fields only, INT64_MAX the one bound, and the skip note names the reason."""
    from batchsim.server.results import rebuild

    assert _main(["run", *SIM, "--num-prompts", "3", "--no-timeline", "--out", str(tmp_path)],
                 capsys)[0] == 0
    (run_dir,) = tmp_path.iterdir()
    steps = run_dir / "steps.jsonl"
    rows = [json.loads(line) for line in steps.read_text().splitlines()]
    rows[0]["batch_size"] = rebuild.INT64_MAX + 1
    rows[1]["batch_size"] = rebuild.INT64_MAX  # fits: kept
    steps.write_text("".join(json.dumps(r) + "\n" for r in rows))
    _, notes = rebuild.rebuild_summary(run_dir, timeline=False)
    (note,) = [n for n in notes if n.startswith("steps.jsonl: skipped")]
    assert "skipped 1 record(s)" in note and "a count not an int within int64" in note, note


def test_a_config_yaml_that_is_a_pipe_is_said_so_not_missing(tmp_path):
    from batchsim.server.results import rebuild

    (tmp_path / "steps.jsonl").write_text("")
    (tmp_path / "requests.jsonl").write_text("")
    os.mkfifo(tmp_path / "config.yaml")
    _, notes = rebuild.rebuild_summary(tmp_path, timeline=False)
    assert "config.yaml: a pipe, not a file; model and budget fields left out" in notes, notes


_CTRL_C_IN_A_FINALIZER = """
import gc, importlib, os, signal, sys
sys.argv[0] = "batchsim"  # the program itself: its Ctrl-C handler and unraisable hook
from batchsim.server.platform import blas
blas.preload()
module, name = sys.argv.pop(1).rsplit(".", 1)  # the call that Ctrl-C lands in, at its start
module = importlib.import_module(module)
called = getattr(module, name)

class Pressed:
    def __del__(self):
        os.kill(os.getpid(), signal.SIGINT)
        sum(range(1000))  # the handler runs here: Python swallows its KeyboardInterrupt

def pressed_in_a_finalizer(*args, **kwargs):
    Pressed()
    gc.collect()
    sum(range(100000))
    return called(*args, **kwargs)

setattr(module, name, pressed_in_a_finalizer)
from batchsim.scripts.cli import main
sys.exit(main(sys.argv[1:]))
"""


def _swallowed_ctrl_c(where: str, *argv: str) -> subprocess.CompletedProcess:
    """`batchsim ARGV` with a real SIGINT as `where` starts, raised where Python swallows it."""
    proc = subprocess.run([sys.executable, "-c", _CTRL_C_IN_A_FINALIZER, where, *argv],
                          capture_output=True, text=True, timeout=180, check=False)
    assert proc.returncode == 130, proc.stderr[-2000:]
    command = argv[0]
    assert proc.stderr.strip().splitlines()[-1] == f"batchsim {command}: interrupted", proc.stderr
    assert "Traceback" not in proc.stderr and "Exception ignored" not in proc.stderr
    return proc


@pytest.mark.timeout(200)
def test_a_ctrl_c_python_swallowed_still_stops_a_command_without_a_run(capsys, tmp_path):
    """e3b4e8b's unraisable hook hid a Ctrl-C raised in a finalizer (only noted, for a run that
    starts later): `report`, `size`, `fit-macs` never start one, so it was lost (exit 0); then
    (b66f3d2) they did all their work and exited 130. Now they stop where they next can
    (signals.stop_if_swallowed), as a run stops at its next step: report draws and writes
    nothing and prints no table."""
    assert _main(["run", *SIM, "--num-prompts", "3", "--no-timeline", "--out", str(tmp_path)],
                 capsys)[0] == 0
    (run_dir,) = tmp_path.iterdir()
    summary = (run_dir / "summary.json").stat()
    proc = _swallowed_ctrl_c("batchsim.server.results.rebuild.rebuild_summary", "report",
                             str(run_dir))
    assert "Serving Benchmark Result" not in proc.stdout and "Successful" not in proc.stdout
    assert (run_dir / "summary.json").stat().st_ino == summary.st_ino  # not written again
    assert not (run_dir / "timeline.png").exists()  # not drawn


@pytest.mark.timeout(200)
def test_size_and_fit_macs_stop_promptly_on_a_ctrl_c_python_swallowed(tmp_path):
    """size printed its table, appended size.jsonl and drew its PNG before its 130; fit-macs
    ran its whole fit (minutes) first. Now size stops before its output and fit-macs within its
    first fold: fast, nothing printed or written."""
    where = "batchsim.server.perf.macs.load_catalog"  # the first thing both commands do
    proc = _swallowed_ctrl_c(where, "size", "--model", "llama-3.2-1b", "--out", str(tmp_path))
    assert proc.stdout == "" and list(tmp_path.iterdir()) == []
    t0 = time.monotonic()
    proc = _swallowed_ctrl_c(where, "fit-macs")
    assert proc.stdout == "" and time.monotonic() - t0 < 60, proc.stderr[-2000:]


def test_a_ctrl_c_while_fit_macs_simulates_a_row_stops_the_fit():
    """A Ctrl-C (or one Python swallowed before, noted) while a published row's run is simulated,
    fit-macs's first seconds, was that run's: its Interrupts counted it and stopped the sending,
    the row's figure came from the cut-short run (kept for every later fit) and the fit went on
    to exit 0. The row's simulation now raises it as KeyboardInterrupt."""
    import signal

    from batchsim.server.perf import gpu_fit, macs
    from batchsim.server.perf.reference import load_published
    from batchsim.server.published import sim as ps

    row = next(r for r in load_published().rows if r.batch > 2 and r.cached_share is None)
    cost = ps.row_cost(row, macs.load_catalog(), ps.MacModel(gpu_fit.load_fit()))
    steps = []

    def press(engine, plan, result) -> None:  # a Ctrl-C at the run's first step
        steps.append(plan)
        if len(steps) == 1:
            os.kill(os.getpid(), signal.SIGINT)

    with pytest.raises(KeyboardInterrupt):
        ps._run(row, cost, on_step=press)
    assert steps


@pytest.mark.parametrize("scale", ["1e300", "-1", ".nan"])
def test_a_device_profile_host_scale_past_any_cpu_is_one_line(tmp_path, scale):
    """r3: StepCost multiplied the engine's capped host costs by an unbounded host_scale."""
    import dataclasses

    from batchsim.configs import ConfigError
    from batchsim.server.perf.devices import load_profile, save_profile

    from tests.sim_profile import PROFILE

    path = save_profile(dataclasses.replace(PROFILE, name="mine"), tmp_path / "mine.yaml")
    path.write_text(path.read_text().replace("host_scale: 1.0", f"host_scale: {scale}"))
    with pytest.raises(ConfigError, match="mine.yaml: host_scale must be >= 0 and at most 100"):
        load_profile(path)
