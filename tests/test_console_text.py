"""Paths, names and notes the commands print are text, not rich markup: a run directory under
`--out 'runs[/x]'` was a MarkupError traceback after the run (exit 1, no JSON line), and one
under `runs[old]` was printed as `runs/...`, a path that is not there."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from tests.test_inputs import SIM, _main


def _unwrapped(text: str) -> str:
    return "".join(text.split())  # rich wraps a long path at the console's width


@pytest.mark.parametrize("name", ["runs[/x]", "runs[old]"])
def test_a_run_directory_with_brackets_is_printed_as_it_is(capsys, tmp_path, name):
    rc, out, err = _main(["run", *SIM, "--num-prompts", "2", "--out", str(tmp_path / name)],
                         capsys)
    assert rc == 0 and "Traceback" not in err, err
    run_dir = json.loads(out.splitlines()[-1])["run_dir"]
    assert f"rundirectory:{run_dir}" in _unwrapped(out), out
    assert Path(run_dir).parent == tmp_path / name and (Path(run_dir) / "summary.json").is_file()


def _a_run(capsys, tmp_path) -> Path:
    rc, out, err = _main(["run", *SIM, "--num-prompts", "2", "--out", str(tmp_path / "a")], capsys)
    assert rc == 0, err
    return Path(json.loads(out.splitlines()[-1])["run_dir"])


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
