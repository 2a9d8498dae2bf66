"""Hostile outputs (issue 37 item 4, h8; split out of test_hostile_inputs.py): a closed or full
stdout, records past a file size limit, pipes and read-only directories where a run keeps its
files, two runs racing for one directory name; each one line and the right exit, never a
traceback or a hang."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from tests.cli_calls import SIM, _main, _one_line


def _batchsim(*args: str, **popen) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "batchsim.scripts.cli", *args],
                            stderr=subprocess.PIPE, text=True, **popen)


def test_json_to_a_reader_that_closed_the_pipe_is_exit_1_without_a_traceback():
    """`batchsim models --json | head -c 1`: a BrokenPipeError traceback from emit_json, then
    another from Python's flush at exit."""
    proc = _batchsim("models", "--json", stdout=subprocess.PIPE)
    proc.stdout.close()  # the reader is gone before the document is written
    err = proc.stderr.read()
    assert proc.wait(timeout=120) == 1 and "Traceback" not in err and "Exception" not in err, err


def test_json_to_a_full_disk_is_one_line_and_exit_1():
    """`batchsim models --json > /dev/full` (or a file on a full disk): an OSError traceback from
    emit_json."""
    with open("/dev/full", "w") as full:
        proc = _batchsim("models", "--json", stdout=full)
        err = proc.stderr.read()
    assert proc.wait(timeout=120) == 1, err
    assert _one_line(err) == ("batchsim: cannot write the JSON document to stdout: "
                              "No space left on device"), err


def test_a_run_that_lost_records_says_so_before_stdout_fails(tmp_path):
    """Its records past an 8 KiB file size limit, its JSON to /dev/full: the line naming the lost
    records came after the JSON, so the stdout failure ended the command before it was said."""
    import resource

    def limit() -> None:
        resource.setrlimit(resource.RLIMIT_FSIZE, (8192, resource.RLIM_INFINITY))

    with open("/dev/full", "w") as full:
        proc = _batchsim("run", *SIM, "--num-prompts", "300", "--json", "--out", str(tmp_path),
                         stdout=full, preexec_fn=limit)
        err = proc.stderr.read()
    assert proc.wait(timeout=120) == 1, err
    lines = err.strip().splitlines()
    assert "steps.jsonl: File too large (the run stopped" in lines[-2], err
    assert lines[-1].endswith("stdout: No space left on device"), err


def test_a_closed_stdout_is_not_a_traceback():
    """`batchsim models --json >&-`: sys.stdout is None, and reading its width was an
    AttributeError traceback while the commands loaded."""
    proc = _batchsim("models", "--json", preexec_fn=lambda: os.close(1))
    err = proc.stderr.read()
    assert proc.wait(timeout=120) == 0 and "Traceback" not in err, err


@pytest.mark.timeout(60)
def test_a_pipe_in_place_of_a_run_file_is_refused_not_waited_on(capsys, tmp_path):
    """A pipe where a run directory keeps a file (nothing writes to it) hung `report` and
    --acceptance-from for ever; /dev/zero linked in filled the memory."""
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / "steps.jsonl").write_text("")
    os.mkfifo(run_dir / "requests.jsonl")
    os.mkfifo(run_dir / "summary.json")
    rc, _, err = _main(["report", str(run_dir)], capsys)
    assert rc == 0 and "requests.jsonl: a pipe, not a file, read as empty" in err, err
    (run_dir / "summary.json").unlink()  # report wrote one; a pipe again
    os.mkfifo(run_dir / "summary.json")
    rc, _, err = _main(["run", *SIM, "--spec-method", "ngram", "--spec-tokens", "4",
                        "--acceptance-from", str(run_dir), "--out", str(tmp_path)], capsys)
    assert rc == 2 and _one_line(err).endswith("summary.json is a pipe, not a file"), err


def test_runs_started_together_into_one_out_each_get_their_directory(tmp_path, monkeypatch):
    """Two runs into one --out in the same second: the name was looked for, then made, so the
    run that lost the race between the look and mkdir failed ('cannot write a run directory
    there (File exists)'). The name is now taken by making it."""
    from batchsim.server.results import jsonio

    monkeypatch.setattr(jsonio, "timestamp", lambda: "20261205-080000")
    (tmp_path / "20261205-080000-m").mkdir()  # the other run's, made after this one looked
    monkeypatch.setattr(jsonio.Path, "exists", lambda self: False)
    assert jsonio.new_run_dir(tmp_path, "m").name == "20261205-080000-m-2"
    assert jsonio.new_run_dir(tmp_path, "m").name == "20261205-080000-m-3"


def test_report_on_a_read_only_run_directory_still_shows_the_summary(capsys, tmp_path,
                                                                     monkeypatch):
    """An archived (read-only) run directory: report rebuilt the summary, failed to write it and
    showed nothing ('[Errno 30] Read-only file system', exit 1). Now the table and the JSON line,
    then one line saying summary.json was not kept (exit 1): the path and the reason once (r3:
    they were twice, as a note and as the failure line), no class name in the redraw's note."""
    import errno

    from batchsim.server.results import run_files

    assert _main(["run", *SIM, "--num-prompts", "3", "--no-timeline", "--out", str(tmp_path)],
                 capsys)[0] == 0
    (run_dir,) = tmp_path.iterdir()
    if os.geteuid() != 0:  # root writes there anyway: the rename fails as it would
        run_dir.chmod(0o555)
    else:
        def read_only(*_args):
            raise OSError(errno.EROFS, "Read-only file system")

        monkeypatch.setattr(run_files.os, "replace", read_only)
    try:
        rc, out, err = _main(["report", str(run_dir)], capsys)
    finally:
        run_dir.chmod(0o755)
    reason = "Read-only file system" if os.geteuid() == 0 else "Permission denied"
    assert rc == 1 and "Serving Benchmark Result" in out and '"completed":3' in out
    assert _one_line(err) == (f"batchsim report: summary rebuilt but not kept: cannot write "
                              f"{run_dir / 'summary.json'}: {reason}"), err
    assert err.count("summary.json") == 1 and "Error" not in err, err
    drawn = f"timeline.png: not drawn (cannot write {run_dir / 'timeline.png'}: {reason})"
    assert drawn in err.replace("\n", ""), err  # the notes wrap at the terminal's width
