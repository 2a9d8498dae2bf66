"""Fixes of reviewer r1's findings on the robustness commits of h7 and h8 (issue 37 item 4): each
test fails without its fix."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import yaml

from tests.cli_calls import SIM, _main, _one_line, last_json
from tests.sim_records import copy_run, finished_sim_run


@pytest.fixture(scope="module")
def finished_run(tmp_path_factory) -> Path:
    return finished_sim_run(tmp_path_factory.mktemp("runs"))


def _run_dir_config(capsys, out: Path) -> tuple[Path, dict]:
    rc, stdout, err = _main(["run", *SIM, "--num-prompts", "3", "--no-timeline", "--out",
                             str(out), "--json"], capsys)
    assert rc == 0, err
    path = Path(last_json(stdout)["run_dir"]) / "config.yaml"
    return path, yaml.safe_load(path.read_text())


def test_an_edit_of_a_run_directorys_config_workload_runs(capsys, tmp_path):
    """`config: workload:` is what a rerun runs: its edit was refused for differing from a
    second, top-level copy, and the refusal said to edit it where it had been edited."""
    _, data = _run_dir_config(capsys, tmp_path / "a")
    assert "workload" not in data  # one copy
    data["config"]["workload"]["num_prompts"] = 7
    edited = tmp_path / "edited.yaml"
    edited.write_text(yaml.safe_dump(data, sort_keys=False))
    rc, out, err = _main(["run", str(edited), "--no-timeline", "--out", str(tmp_path / "b"),
                          "--json"], capsys)
    assert rc == 0, err
    assert last_json(out)["completed"] == 7


def test_an_older_run_directory_with_two_differing_workloads_is_one_line(capsys, tmp_path):
    """Older directories also kept the workload that ran at the top level: equal copies run, and
    differing ones (either edited, or a sweep's point) name the copy to keep."""
    _, data = _run_dir_config(capsys, tmp_path / "a")
    old = {"config": data["config"], "workload": dict(data["config"]["workload"]), **data}
    path = tmp_path / "old.yaml"
    path.write_text(yaml.safe_dump(old, sort_keys=False))
    rc, out, err = _main(["run", str(path), "--no-timeline", "--out", str(tmp_path / "b"),
                          "--json"], capsys)
    assert rc == 0 and last_json(out)["completed"] == 3, err
    old["workload"]["num_prompts"] = 7
    path.write_text(yaml.safe_dump(old, sort_keys=False))
    rc, _, err = _main(["run", str(path), "--out", str(tmp_path / "c")], capsys)
    line = _one_line(err)
    assert rc == 2 and "put the one to run under `config: workload:`" in line, err
    assert ": holds two different workloads (an older layout): the top-level" in line, err


@pytest.mark.timeout(120)
def test_report_reads_config_yaml_through_the_one_loader(finished_run, tmp_path,
                                                          capsys):
    """An alias bomb in config.yaml: yaml.safe_load took it, and the summary's env (or the
    note's str(data)) expanded it all; the project's loader refuses it in one note."""
    run_dir = copy_run(finished_run, tmp_path)
    lines = ["a0: &a0 [x, x, x, x, x, x, x, x, x, x]"]
    lines += [f"a{i}: &a{i} [{', '.join([f'*a{i - 1}'] * 10)}]" for i in range(1, 7)]
    (run_dir / "config.yaml").write_text("\n".join(lines) + "\nenv: *a6\n")
    (run_dir / "summary.json").unlink()  # the summary's fields come from config.yaml
    rc, out, err = _main(["report", str(run_dir), "--json"], capsys)
    assert rc == 0 and "Traceback" not in err, err
    assert "config.yaml: not a run's config (its aliases expand to more than" in err, err
    assert last_json(out)["env"] is None


def test_a_name_too_long_without_a_file_name_says_no_length():
    """ENAMETOOLONG with no filename said "(0 characters: ...)"."""
    import errno

    from batchsim.scripts.cli import _too_long

    said = _too_long(OSError(errno.ENAMETOOLONG, "File name too long"))
    assert "0 characters" not in said and "too long" in said
    said = _too_long(OSError(errno.ENAMETOOLONG, "File name too long", "x" * 300))
    assert "(300 characters: " in said


@pytest.mark.parametrize("head, at", [(b"\xef\xbb\xbf", 3 + 51), (b"", 51), (b"", 20_051)])
def test_a_trace_thats_not_utf8_names_the_bad_bytes_file_offset(tmp_path, head, at):
    """The offset was the reader's: counted after a byte order mark (3 short) and from the start
    of its 8 KiB chunk."""
    from batchsim.configs import ConfigError
    from batchsim.workloads.traces import read_trace

    rows = "TIMESTAMP,ContextTokens,GeneratedTokens\n" + "2023-11-16 18:15:46.68,374,44\n" * 700
    data = bytearray(head + rows.encode())
    data[at] = 0xFF
    path = tmp_path / "t.csv"
    path.write_bytes(bytes(data))
    with pytest.raises(ConfigError, match=rf"not UTF-8 text \(byte {at}: invalid start byte\)"):
        read_trace(path)


def test_default_batches_cover_each_limit():
    from batchsim.server.perf import sweep_limits

    assert sweep_limits.default_batches(28, 64, 6) == [1, 2, 4, 5, 6, 7, 8, 16, 27, 28, 29, 30,
                                                        32]
    assert sweep_limits.default_batches(6, 64, 28) == sweep_limits.default_batches(28, 64, 6)


def test_a_draft_sweeps_default_batches_reach_its_speculative_limit(tmp_path, capsys):
    """--limit-batch L with --draft-model is the speculative points' limit, but the default
    batches came from plain batching's (1, 2, 4, 8, 16, 27-32 for L = 6): every speculative
    point from 8 overran, none ran at 5-7. sweep.jsonl names whose limit L is."""
    from tests.cli_calls import cli_summary, draft_sweep_argv

    argv = draft_sweep_argv(tmp_path, "--output-len", "16", "--max-batch", "8", "--spec-tokens",
                            "2")
    res = cli_summary(capsys, argv)
    assert [r["batch"] for r in res["rows"]] == [1, 2, 4, 5, 6, 7, 8]
    (row, *_) = map(json.loads, (tmp_path / "sweep.jsonl").read_text().splitlines())
    assert row["limit_batch"] == row["spec_analytic_max_batch"] == 6
    assert row["limit_batch_points"] == "speculative" and row["analytic_overrun_batch"] > 8


def test_the_sweep_and_the_timeline_count_admissions_alike():
    """The sweep's memory waits and the timeline's overrun counted a step's admissions each
    their own way: a first_scheduled_s that is no step's start was admitted by the next step in
    the timeline, by none in the sweep. One count now, of exact step starts."""
    from batchsim.server.perf import sweep_limits
    from batchsim.server.results import timeline
    from batchsim.server.results.records import RequestRecord

    from tests.sim_records import sweep_step

    steps = [sweep_step(0, 0, 384, 2, 2), sweep_step(1, 0, 384, 2, 2), sweep_step(2, 2, 0, 2, 2)]
    requests = [RequestRecord(i, "unfinished", 0.0, t, (), None, 1000, 0)
                for i, t in enumerate([0.0, 0.0, 0.05, None])]
    assert sweep_limits.admitted_per_step is timeline.admitted_per_step
    assert list(timeline.admitted_per_step(steps, requests)) == [2, 0, 0]


def test_steps_record_admissions_a_preempted_requests_return_included():
    """Admissions were counted from first_scheduled_s, which a preemption does not reset: the
    step that took a preempted request back admitted nobody, and read as a memory wait."""
    from batchsim.server.engine.runner import run_workload
    from batchsim.server.engine.session import open_session
    from batchsim.server.results import timeline

    from tests.sim_records import sim_config

    session = open_session(dataclasses.replace(sim_config(n=40), memory_gb=0.75))
    outcome = run_workload(session, session.config.workload, out_dir=None, label="t")
    steps, summary = outcome.steps, outcome.summary
    assert summary["num_preemptions"] > 0 and summary["completed"] == 40
    assert sum(s.num_admitted for s in steps) == 40 + summary["num_preemptions"]
    admitted = timeline.admitted_per_step(steps, outcome.requests)
    assert list(admitted) == [s.num_admitted for s in steps]
    old = [dataclasses.replace(s, num_admitted=None) for s in steps]  # records before the field
    assert sum(timeline.admitted_per_step(old, outcome.requests)) == 40
