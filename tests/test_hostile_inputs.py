"""A fresh adversarial pass (issue 37 item 4, h8): files and settings a careless or hostile user
hands batchsim, each refused in one plain line (exit 2) instead of a traceback, a hang or a run
that silently ignores what the user wrote."""

from __future__ import annotations

import pytest

from tests.test_inputs import SIM, _main, _one_line


def _alias_bomb(levels: int = 12) -> str:
    """Aliases of aliases: 12 lines of YAML that expand to 10**12 values."""
    lines = ["a0: &a0 [x, x, x, x, x, x, x, x, x, x]"]
    lines += [f"a{i}: &a{i} [{', '.join([f'*a{i - 1}'] * 10)}]" for i in range(1, levels)]
    return "\n".join(lines) + f"\nworkload:\n  num_prompts: 3\n  input_len: *a{levels - 1}\n"


@pytest.mark.timeout(60)
@pytest.mark.parametrize("text, says", [
    (_alias_bomb(), "its aliases expand to more than 1,000,000 values"),  # hung in the checks
    ("num_prompts: " + "[" * 100_000 + "]" * 100_000 + "\n",
     "not valid YAML: nested too deeply to read"),  # a RecursionError traceback
])
def test_yaml_alias_bombs_and_deep_nesting_are_one_line(capsys, tmp_path, text, says):
    path = tmp_path / "hostile.yaml"
    path.write_text(text)
    rc, _, err = _main(["run", *SIM, str(path), "--out", str(tmp_path)], capsys)
    assert rc == 2 and says in _one_line(err), err


def test_yaml_aliases_within_reason_still_load(tmp_path):
    from batchsim.configs import load_yaml

    path = tmp_path / "anchors.yaml"
    path.write_text("base: &b {dist: uniform, min: 8, max: 16}\ninput_len: *b\noutput_len: *b\n")
    data = load_yaml(path)
    assert data["input_len"] == data["output_len"] == {"dist": "uniform", "min": 8, "max": 16}
