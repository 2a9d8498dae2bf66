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


def test_report_notes_and_paths_with_brackets_are_printed_as_they_are(capsys, tmp_path):
    rc, out, _ = _main(["run", *SIM, "--num-prompts", "2", "--out", str(tmp_path / "a")], capsys)
    run_dir = tmp_path / "b[/x]" / "run[old]"
    shutil.copytree(json.loads(out.splitlines()[-1])["run_dir"], run_dir)
    (run_dir / "config.yaml").write_text("'[/red]': 1\n'[/red]': 2\n")  # its note names the key
    rc, out, err = _main(["report", str(run_dir)], capsys)
    assert rc == 0 and "Traceback" not in err, err
    note = next(line for line in err.splitlines() if "config.yaml" in line)  # one line, whole
    assert "key '[/red]' is given twice" in note and note.endswith("fields left out"), err
    assert f"summaryrebuilt:{run_dir / 'summary.json'}" in _unwrapped(out), out
