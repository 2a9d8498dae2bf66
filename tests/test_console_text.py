"""Paths, names and notes the commands print are text, not rich markup: a run directory under
`--out 'runs[/x]'` was a MarkupError traceback after the run (exit 1, no JSON line), and one
under `runs[old]` was printed as `runs/...`, a path that is not there."""

from __future__ import annotations

import re
import shutil
from pathlib import Path

import pytest

from tests.cli_calls import SIM, _main, last_json


def _unwrapped(text: str) -> str:
    return "".join(text.split())  # rich wraps a long path at the console's width


@pytest.mark.parametrize("name", ["runs[/x]", "runs[old]"])
def test_a_run_directory_with_brackets_is_printed_as_it_is(capsys, tmp_path, name):
    rc, out, err = _main(["run", *SIM, "--num-prompts", "2", "--out", str(tmp_path / name)],
                         capsys)
    assert rc == 0 and "Traceback" not in err, err
    run_dir = last_json(out)["run_dir"]
    assert f"rundirectory:{run_dir}" in _unwrapped(out), out
    assert Path(run_dir).parent == tmp_path / name and (Path(run_dir) / "summary.json").is_file()


def _a_run(capsys, tmp_path) -> Path:
    rc, out, err = _main(["run", *SIM, "--num-prompts", "2", "--out", str(tmp_path / "a")], capsys)
    assert rc == 0, err
    return Path(last_json(out)["run_dir"])


def test_report_notes_and_paths_with_brackets_are_printed_as_they_are(capsys, tmp_path):
    run_dir = Path(shutil.copytree(_a_run(capsys, tmp_path), tmp_path / "b[/x]" / "run[old]"))
    (run_dir / "config.yaml").write_text("'[/red]': 1\n'[/red]': 2\n")  # its note names the key
    rc, out, err = _main(["report", str(run_dir)], capsys)
    assert rc == 0 and "Traceback" not in err, err
    assert "key '[/red]' is given twice" in err, err
    assert f"summaryrebuilt:{run_dir / 'summary.json'}" in _unwrapped(out), out


def test_a_config_note_is_one_line(capsys, tmp_path):
    """The loader's message was cut at 80 characters with its line breaks in it."""
    from batchsim.server.results.rebuild import rebuild_summary

    run_dir = _a_run(capsys, tmp_path)
    (run_dir / "config.yaml").write_text("a: 1\na: 2\n")
    _, notes = rebuild_summary(run_dir)
    note = next(n for n in notes if n.startswith("config.yaml"))
    assert "is given twice" in note and "\n" not in note and "  " not in note, note


def test_serve_prints_a_served_model_name_with_brackets_as_it_is(batchsim_home):
    """`serve --served-model-name '[/x] m'` was a MarkupError traceback before it listened."""
    from tests.serve_process import ServerProcess

    srv = ServerProcess(batchsim_home, "--served-model-name", "[/x] m")
    assert srv.client.get("/v1/models").json()["data"][0]["id"] == "[/x] m"
    assert srv.stop() == 0
    assert "as '[/x] m'" in "".join(srv.stderr), srv.stderr


@pytest.mark.parametrize("command", [["compare", *SIM[:-1]],  # compare shows no progress
                                     ["sweep", "--batches", "1,2", *SIM]])
def test_compare_and_sweep_print_a_workload_name_with_brackets_as_it_is(capsys, tmp_path,
                                                                         command):
    """A workload named `w[/x]` (user text) was a MarkupError traceback (exit 1, no JSON) in
    compare's 'workload ...' line after both runs, and in sweep's announce line."""
    workload = tmp_path / "w.yaml"
    workload.write_text('name: "w[/x]"\nnum_prompts: 2\nrequest_rate: 1000\n'
                        "input_len: 32\noutput_len: 4\n")
    rc, out, err = _main([*command, "--workload", str(workload), "--no-timeline",
                          "--out", str(tmp_path / "runs")], capsys)
    assert rc == 0 and "Traceback" not in err, err
    assert "w[/x]" in out + err and last_json(out)


def test_no_command_prints_rich_markup():
    """Every console prints text as it is (scripts/common.py: markup off), so a style written as
    markup would print as its tags: styles go in style=, never in the text."""
    tag = re.compile(r"\[/?(bold|dim|italic|red|yellow|green|blue|cyan|magenta)\b[^\]]*\]")
    scripts = Path(__file__).resolve().parents[1] / "scripts"
    found = [f"{p.name}:{i}" for p in sorted(scripts.glob("*.py"))
             for i, line in enumerate(p.read_text().splitlines(), 1) if tag.search(line)]
    assert not found, found
