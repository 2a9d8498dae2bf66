"""Run records on disk: streamed while the run goes, byte-identical at a clean finish, rebuilt into
a summary after a kill; the output directory checked before any compute; and the defaults that
used to surprise (the simulator's device profile, a trace's length)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from batchsim.configs import ConfigError
from batchsim.server.engine.run_config import RunConfig
from batchsim.server.engine.runner import run_workload
from batchsim.server.engine.session import open_session
from batchsim.server.results import rebuild, run_files
from batchsim.server.results.json_text import dumps
from batchsim.workloads.lengths import LengthSpec
from batchsim.workloads.spec import WorkloadSpec

from tests.sim_records import request_record, sim_config, step_record

SHIPPED = Path(__file__).parent.parent / "configs" / "devices" / "linux-x86_64-openblas-2core.yaml"


def test_records_stream_during_the_run_and_end_as_a_finished_run_always_had_them(
        tmp_path, monkeypatch):
    monkeypatch.setattr(run_files, "FLUSH_EVERY_S", 0.0)  # every step goes out as it completes
    # No writer process can start: written here, each flush on disk when it returns (a writer
    # process writes them a little later: test_record_process.py).
    monkeypatch.setattr(sys, "executable", "")
    session = open_session(sim_config())
    seen = []

    def look(engine, plan, result):  # after the step is recorded
        run_dir = next(tmp_path.glob("*/"))
        lines = (run_dir / "steps.jsonl").read_bytes().splitlines()
        seen.append((len(engine.recorder.steps), len(lines), json.loads(lines[-1])["step_index"]))

    outcome = run_workload(session, session.config.workload, out_dir=tmp_path, label="t",
                           on_step=look)
    assert all(n_steps == n_lines for n_steps, n_lines, _ in seen)
    assert [idx for *_, idx in seen] == [s.step_index for s in outcome.steps]
    finish_order = sorted(outcome.requests, key=lambda r: r.finished_s)
    assert [r.request_id for r in finish_order] != [r.request_id for r in outcome.requests]
    run_dir = outcome.run_dir
    expected = {"requests.jsonl": outcome.requests, "steps.jsonl": outcome.steps}
    for name, rows in expected.items():  # what write_jsonl wrote at the end before streaming
        assert (run_dir / name).read_text() == "".join(dumps(r.to_json()) + "\n" for r in rows)
    assert sorted(p.name for p in run_dir.iterdir()) == [
        "config.yaml", "requests.jsonl", "steps.jsonl", "summary.json",
        "timeline.png"]  # no temporary left

    # `batchsim report` on a finished run gives its summary back, byte for byte.
    before = (run_dir / "summary.json").read_bytes()
    summary, notes = rebuild.rebuild_summary(run_dir)
    assert notes == [] and (run_dir / "summary.json").read_bytes() == before
    assert summary["interrupted"] is False


@pytest.mark.parametrize("chunk_bytes", [1, 5_000])
def test_requests_put_in_arrival_order_in_chunks_of_any_size(tmp_path, monkeypatch, chunk_bytes):
    """requests.jsonl, streamed in finish order, is rewritten in arrival order a chunk at a time
    (a line per chunk, or several lines and a chunk cut between two)."""
    monkeypatch.setattr(run_files, "WRITE_CHUNK_BYTES", chunk_bytes)
    monkeypatch.setattr(run_files, "FLUSH_EVERY_S", 0.0)  # nothing held: completion order
    session = open_session(sim_config())
    outcome = run_workload(session, session.config.workload, out_dir=tmp_path, label="c",
                           timeline=False)
    text = (outcome.run_dir / "requests.jsonl").read_text()
    assert text == "".join(dumps(r.to_json()) + "\n" for r in outcome.requests)
    assert len(text) > 3 * 5_000  # several chunks


def test_report_after_a_kill_skips_a_torn_line_and_marks_the_run_interrupted(tmp_path):
    session = open_session(sim_config(n=20))
    run_dir = run_workload(session, session.config.workload, out_dir=tmp_path, label="t").run_dir
    (run_dir / "summary.json").unlink()  # as a killed run leaves it
    data = (run_dir / "requests.jsonl").read_bytes()
    (run_dir / "requests.jsonl").write_bytes(data[:-40])  # the last line cut mid-write
    summary, notes = rebuild.rebuild_summary(run_dir)
    assert summary["interrupted"] is True and summary["completed"] == 19
    assert summary["model"] == "llama-3.2-1b" and summary["num_plans"] == len(
        (run_dir / "steps.jsonl").read_bytes().splitlines())
    assert any("torn last line" in n for n in notes) and any("never finished" in n for n in notes)
    assert json.loads((run_dir / "summary.json").read_text()) == summary

    lines = data.splitlines(keepends=True)
    (run_dir / "requests.jsonl").write_bytes(b"".join([lines[0], b"{oops\n", *lines[1:]]))
    summary, notes = rebuild.rebuild_summary(run_dir)  # a bad line mid-file: skipped, and said
    assert summary["completed"] == 20 and any("skipped 1 line(s)" in n and "line 2" in n
                                              for n in notes)
    with pytest.raises(ConfigError, match="not a run directory"):
        rebuild.rebuild_summary(tmp_path)


def test_a_temp_file_a_killed_writer_left_is_named_by_report_and_never_read(tmp_path):
    """A writer killed while it put requests.jsonl in arrival order (4374725's per-writer temp)
    leaves `.requests.jsonl.XXXXXXXX`: report reads only requests.jsonl, and names the leftover
    (it was silent about a hidden file that holds a partial copy of the records)."""
    session = open_session(sim_config(n=20))
    run_dir = run_workload(session, session.config.workload, out_dir=tmp_path, label="t").run_dir
    (run_dir / "summary.json").unlink()  # as a killed run leaves it
    before = (run_dir / "requests.jsonl").read_bytes()
    kill = ("import os, signal, sys\nfrom pathlib import Path\n"
            "from batchsim.server.results import run_files\n"
            "def half(f):\n    f.write(Path(sys.argv[1]).read_bytes()[:300]); f.flush()\n"
            "    os.kill(os.getpid(), signal.SIGKILL)\n"
            "run_files.write_atomically(Path(sys.argv[1]), half)\n")
    proc = subprocess.run([sys.executable, "-c", kill, str(run_dir / "requests.jsonl")],
                          check=False)
    assert proc.returncode == -9 and (run_dir / "requests.jsonl").read_bytes() == before
    (left,) = run_files.leftover_temps(run_dir)
    assert left.startswith(".requests.jsonl.")
    assert len(left) == len(".requests.jsonl.") + 2 * run_files.TEMP_RANDOM_BYTES == 24
    summary, notes = rebuild.rebuild_summary(run_dir)
    assert summary["completed"] == 20 and not any("torn" in n or "skipped" in n for n in notes)
    assert any(n.startswith(f"{left}: ") and "not records" in n for n in notes)
    assert run_files.leftover_temps(run_dir) == [left]  # not deleted: it may be a live writer's


def test_an_unwritable_out_fails_in_one_line_before_any_compute(tmp_path, monkeypatch, capsys):
    from batchsim.scripts.cli import main

    home = tmp_path / "home"
    monkeypatch.setenv("BATCHSIM_HOME", str(home))
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    for extra in ([], ["--target", "http://127.0.0.1:9/v1"]):
        assert main(["run", "--model", "smollm2-135m", "--num-prompts", "1", "--no-progress",
                     "--out", str(blocker / "runs"), *extra]) == 2
        err = capsys.readouterr().err
        assert "output directory" in err and "Traceback" not in err
        assert len(err.strip().splitlines()) == 1
    assert not (home / "models").exists()  # the model was never built


def test_sim_without_a_profile_takes_the_one_calibrated_on_this_machine(tmp_path, monkeypatch):
    from batchsim.server.perf import devices, profile_match

    monkeypatch.setenv("BATCHSIM_HOME", str(tmp_path))
    monkeypatch.setattr(profile_match, "here", lambda: "Test CPU, TestBLAS 1.0")
    with pytest.raises(ConfigError) as exc:
        devices.resolve_profile(None)
    message = str(exc.value)
    assert "--device-profile" in message and "linux-x86_64-openblas-2core" in message
    assert "Test CPU, TestBLAS 1.0" in message and "\n" not in message

    profile = yaml.safe_load(SHIPPED.read_text())
    profile["calibration"]["device"] = "Test CPU, TestBLAS 1.0"
    (tmp_path / "devices").mkdir()
    (tmp_path / "devices" / "here.yaml").write_text(yaml.safe_dump(profile))
    assert devices.profile_for_this_machine() == "here"
    session = open_session(RunConfig(model="tiny", executor="sim"))
    assert session.executor.caps.virtual_time and session.dtype == "float32"  # the profile's
    (tmp_path / "devices" / "local.yaml").write_text(yaml.safe_dump(profile))
    assert devices.profile_for_this_machine() == "local"  # `batchsim calibrate`'s own comes first


def test_a_trace_replays_whole_unless_num_prompts_says_otherwise():
    from batchsim.scripts.cli import build_parser
    from batchsim.scripts.run_args import config_from_args

    parser = build_parser()
    trace = "mooncake_conversation_slice.jsonl"
    rows = sum(1 for line in (Path(run_files.__file__).parents[2] / "configs" / "traces" / trace)
               .read_text().splitlines() if line.strip())
    whole = config_from_args(parser.parse_args(["run", "--trace", trace])).workload
    assert whole.num_prompts == rows > RunConfig().workload.num_prompts
    assert whole.name == "mooncake_conversation_slice"  # the run is named by its trace
    chosen = ["run", "--workload", "chat-sessions", "--trace", trace]
    assert config_from_args(parser.parse_args(chosen)).workload.name == "chat-sessions"
    part = config_from_args(parser.parse_args(["run", "--trace", trace, "--num-prompts", "7"]))
    assert part.workload.num_prompts == 7
    named = config_from_args(parser.parse_args(["run", "--workload", "azure-conv"]))
    assert named.workload.num_prompts == 200  # a workload's own count stands


def test_a_later_build_sweeps_the_temporary_dirs_of_killed_builds(batchsim_home, tiny):
    from batchsim.server.models.build import cache_root
    from batchsim.server.models.loader import resolve

    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()  # a pid with no process behind it
    dead = cache_root() / f".tiny-float32.build-{gone.pid}-abc_12"
    mine = cache_root() / f".tiny-float32.build-{os.getpid()}-xyz_34"  # a build in progress
    for path in (dead, mine):
        (path / "weights").mkdir(parents=True)
    resolve("tiny", "float32")  # any build, even of a model already built
    assert not dead.exists() and mine.exists()
    (mine / "weights").rmdir()
    mine.rmdir()


def test_two_real_runs_on_one_executor_each_start_clean(tmp_path):
    """`validate` runs its cases one after another on one real executor, each run on a new engine
    thread: the second must not meet arrays queued on the first thread's ended MLX streams (a step
    run ahead) nor the first run's cached prompt blocks (the account would not match)."""
    spec = WorkloadSpec(name="shared", num_prompts=4, request_rate=200.0, seed=3,
                        input_len=LengthSpec("fixed", value=40),
                        output_len=LengthSpec("fixed", value=8))
    session = open_session(RunConfig(model="tiny", workload=spec))
    for label in ("first", "second"):
        summary = run_workload(session, spec, out_dir=tmp_path, label=label).summary
        assert summary["completed"] == 4 and summary["kv_account_mismatches"] == 0
    assert session.executor.kv_bytes() == 0  # the run ended: nothing held for the next one


def test_a_run_whose_executor_fails_keeps_its_records_and_a_summary_that_says_why(tmp_path):
    """A failed run left its streamed records but no summary.json (a failed rank 0 of `run
    --ranks` goes this way): now the summary of what ran, marked interrupted with the error."""
    session = _failing_at_plan_40()
    with pytest.raises(RuntimeError, match="device lost"):
        run_workload(session, session.config.workload, out_dir=tmp_path, label="t")
    (run_dir,) = tmp_path.iterdir()
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["interrupted"] is True and summary["interrupt_reason"] == "failed: device lost"
    requests = [json.loads(x) for x in (run_dir / "requests.jsonl").read_text().splitlines()]
    assert summary["num_plans"] == 39 == len((run_dir / "steps.jsonl").read_text().splitlines())
    assert 0 < summary["completed"] == [r["status"] for r in requests].count("finished") < 60
    assert len(requests) == summary["completed"] + summary["failed"]


def _failing_at_plan_40():
    """A sim session whose executor raises RuntimeError('device lost') at its 40th plan."""
    session = open_session(sim_config())
    execute, calls = session.executor.execute, []

    def failing(plan, max_elapsed_s=float("inf")):
        calls.append(plan)
        if len(calls) == 40:
            raise RuntimeError("device lost")
        return execute(plan, max_elapsed_s)

    session.executor.execute = failing
    return session


def test_a_failed_run_whose_summary_fails_too_still_keeps_its_records(tmp_path, monkeypatch):
    """The device gone, the summary of the failed run fails as well (its peak memory cannot be
    read): the buffered records were lost with it (0 lines); now they are written as they stand."""
    from batchsim.server.engine import runner

    def no_device(session):
        raise RuntimeError("device gone")

    monkeypatch.setattr(runner, "_peak_memory", no_device)
    session = _failing_at_plan_40()
    with pytest.raises(RuntimeError, match="device lost"):
        run_workload(session, session.config.workload, out_dir=tmp_path, label="t")
    (run_dir,) = tmp_path.iterdir()
    assert not (run_dir / "summary.json").exists()
    assert len((run_dir / "steps.jsonl").read_text().splitlines()) == 39
    requests = [json.loads(x) for x in (run_dir / "requests.jsonl").read_text().splitlines()]
    assert 0 < [r["status"] for r in requests].count("finished") < 60


def test_a_stream_closed_by_an_abandoned_run_ignores_a_late_flush(tmp_path):
    """A rank's watchdog abandons the run from its own thread (records closed, summary written)
    while the run's loop may still flush: that flush raised ValueError on the closed files (or
    wrote the same steps twice, racing); now it writes nothing, under one lock."""
    stream = run_files.RecordStream(tmp_path)
    stream.add_step(step_record(0, 0.0, running=1, waiting=0))
    stream.close_unfinished()
    stream.add_step(step_record(1, 1.0, running=1, waiting=0))
    stream.flush()  # the loop's flusher, after the abandon
    lines = (tmp_path / "steps.jsonl").read_text().splitlines()
    assert [json.loads(x)["step_index"] for x in lines] == [0]


def test_a_signal_during_a_flush_waits_for_it_and_keeps_every_record_once(tmp_path):
    """A rank's SIGTERM handler keeps the records (a flush, then the files closed) and exits:
    arriving between the loop's write of its steps and their clear(), it wrote those steps twice,
    and skipping its flush instead lost the buffered requests. It now waits for the flush under
    way (run_files.when_not_flushing): every step and request is written once."""
    import signal

    stream = run_files.RecordStream(tmp_path)
    write = stream._write

    class Exited(Exception):
        """os._exit in the handler: the interrupted flush never resumes."""

    def keep() -> None:  # what a rank's SIGTERM handler does: keep the records, exit
        stream.close_unfinished()
        raise Exited

    def handler(*_):  # as rank.py installs it
        run_files.when_not_flushing(keep) or keep()

    def write_then_signal(name, lines):
        stream._write = write  # one signal
        written = write(name, lines)
        os.kill(os.getpid(), signal.SIGTERM)  # its handler runs here, before the buffer's clear()
        return written

    stream._write = write_then_signal
    stream.add_step(step_record(0, 0.0, running=1, waiting=0))
    stream.add_request(request_record(7, 0.0, 0.5))
    previous = signal.signal(signal.SIGTERM, handler)
    try:
        with pytest.raises(Exited):
            stream.flush()
    finally:
        signal.signal(signal.SIGTERM, previous)
    lines = (tmp_path / "steps.jsonl").read_text().splitlines()
    assert [json.loads(x)["step_index"] for x in lines] == [0]
    requests = (tmp_path / "requests.jsonl").read_text().splitlines()
    assert [json.loads(x)["request_id"] for x in requests] == [7]


def test_two_streams_closing_one_run_dir_each_write_their_own_whole_file(tmp_path, monkeypatch):
    """close() put requests.jsonl in arrival order through a fixed `.requests.jsonl.tmp`: a second
    writer closing the same run dir mid-write truncated and renamed the first's temp file, so the
    first's later lines landed inside the second's finished file and its rename failed. Each
    writer now has its own temp (run_files.write_atomically): the last rename wins, whole."""
    monkeypatch.setattr(run_files, "WRITE_CHUNK_BYTES", 1)  # a write per line: room to interleave
    first, second = run_files.RecordStream(tmp_path), run_files.RecordStream(tmp_path)
    first_rows = [request_record(i, 0.0, 0.5) for i in range(6)]
    second_rows = [request_record(100 + i, 0.0, 0.25) for i in range(3)]
    encode = run_files.dumps
    calls = []

    def dumps_then_second_closes(row):  # the second writer runs while the first is mid-file
        calls.append(row)
        if len(calls) == 3:
            second.close(second_rows)
        return encode(row)

    monkeypatch.setattr(run_files, "dumps", dumps_then_second_closes)
    first.close(first_rows)
    assert first.error is None and second.error is None
    text = (tmp_path / "requests.jsonl").read_text()
    assert text == "".join(encode(r.to_json()) + "\n" for r in first_rows)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["requests.jsonl", "steps.jsonl"]
