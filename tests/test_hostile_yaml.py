"""Hostile YAML (issue 37 item 4, h8; split out of test_hostile_inputs.py): alias bombs, deep
nesting, keys given twice, devices and pipes given as files; each refused in one plain line
(exit 2) by every YAML build, and the YAML within reason still read."""

from __future__ import annotations

import os

import pytest

from tests.cli_calls import SIM, _main, _one_line


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
    *[("num_prompts: " + "[" * n + "]" * n + "\n", "nested too deeply to read (more than 100")
      for n in (101, 600, 990)],  # libyaml read them: a 2-10 KB line, the whole value's repr
])
def test_yaml_alias_bombs_and_deep_nesting_are_one_line(capsys, tmp_path, text, says):
    path = tmp_path / "hostile.yaml"
    path.write_text(text)
    rc, _, err = _main(["run", *SIM, str(path), "--out", str(tmp_path)], capsys)
    assert rc == 2 and says in _one_line(err) and len(err) < 300, err


@pytest.mark.timeout(60)
@pytest.mark.parametrize("build", ["libyaml", "pure"])
@pytest.mark.parametrize("text, says", [
    ("[" * 100_000 + "]" * 100_000, "nested too deeply to read (more than 100 levels)"),
    ("[" * 600 + "]" * 600, "nested too deeply to read (more than 100 levels)"),
    ("[" * 101 + "]" * 101, "nested too deeply to read (more than 100 levels)"),
    ("num_prompts:\t5\n", "found character '\\t' that cannot start any token"),  # libyaml read 5
    ("a: 1\nb: *x\n", "found undefined alias 'x'"),  # libyaml: no name, no line shown
    ('name: "\\ud800"\n', "escape"),  # pure read it: a UnicodeEncodeError when written
    ("num_prompts: 5\nseed: 1\nnum_prompts: 50\n",  # both builds read 50, silently
     "key 'num_prompts' is given twice (first on line 1)"),
    ("input_len: {dist: uniform, min: 8, min: 9}\n", "key 'min' is given twice"),
    # Keys written differently that read as one: the last value was kept, silently.
    ("4: 1.0\n0x4: 2.0\n", "key '0x4' is given twice (first on line 1)"),
    ("a: {true: 1, yes: 2}\n", "key 'yes' is given twice"),
    ("~: 1\nnull: 2\n", "key 'null' is given twice"),
    ("1.0: a\n1.00: b\n", "key '1.00' is given twice"),
    # Through an alias (the anchor's node, its mark): last-wins in both builds, and the line named
    # was the anchor's (a value's).
    ("&x k : 1\n*x : 2\n", "key 'k' is given twice (first on line 1)"),
    ("b: &x k\n*x : 1\n*x : 2\n", "key 'k' is given twice (first on line 2)"),
    ("b: &x k\n*x : 1\nk: 2\n", "key 'k' is given twice (first on line 2)"),
    ("b: &x k\nc: &y 3\n*x : *y\nk: 2\n", "key 'k' is given twice (first as key 3 of its"),
])
def test_every_yaml_build_refuses_the_same_files_in_pyyaml_words(monkeypatch, tmp_path, build,
                                                                  text, says):
    import yaml
    from batchsim import configs

    if build == "pure":
        monkeypatch.setattr(configs, "_Loader", configs._PureLoader)
    elif not yaml.__with_libyaml__:
        pytest.skip("PyYAML built without libyaml")
    path = tmp_path / "hostile.yaml"
    path.write_text(text)
    with pytest.raises(configs.ConfigError) as err:
        configs.load_yaml(path)
    assert says in str(err.value) and len(str(err.value)) < 300, str(err.value)


def test_a_yaml_file_nested_100_deep_still_loads(tmp_path):
    from batchsim.configs import load_yaml

    path = tmp_path / "deep.yaml"
    path.write_text("a: " + "[" * 99 + "]" * 99 + "\n")
    assert load_yaml(path)["a"] == eval("[" * 99 + "]" * 99)


def test_yaml_aliases_within_reason_still_load(tmp_path):
    from batchsim.configs import load_yaml

    path = tmp_path / "anchors.yaml"
    path.write_text("base: &b {dist: uniform, min: 8, max: 16}\ninput_len: *b\noutput_len: *b\n")
    data = load_yaml(path)
    assert data["input_len"] == data["output_len"] == {"dist": "uniform", "min": 8, "max": 16}
    # a merge's keys may be given again on purpose (a key twice is refused: the test above)
    path.write_text("a: &a {min: 1, max: 2}\nb: &b {<<: *a, min: 3}\nc: {<<: *b, max: 4}\n")
    assert load_yaml(path) == {"a": {"min": 1, "max": 2}, "b": {"min": 3, "max": 2},
                               "c": {"min": 3, "max": 4}}


def test_shipped_yaml_reads_with_libyaml_to_the_pure_python_values():
    """load_yaml parses with libyaml (8x faster: every `batchsim run` reads macs.yaml), to the
    values PyYAML's pure-Python SafeLoader with the same 1e-3 rule gives, for every shipped file
    and for a deep nesting (libyaml's own limit: the same one line)."""
    import yaml
    from batchsim.configs import CONFIG_DIR, _Loader, _PureLoader, load_yaml

    if not yaml.__with_libyaml__:
        pytest.skip("PyYAML built without libyaml")
    assert issubclass(_Loader, yaml.CSafeLoader) and not issubclass(_PureLoader, yaml.CSafeLoader)
    assert yaml.load("r: 1e-3", Loader=_PureLoader) == {"r": 0.001}
    files = sorted(CONFIG_DIR.rglob("*.yaml"))
    assert len(files) > 20
    for path in files:
        pure = yaml.load(path.read_text(), Loader=_PureLoader)
        assert repr(load_yaml(path)) == repr(pure or {}), path


@pytest.mark.timeout(60)
@pytest.mark.parametrize("argv", [["run", "/dev/null", *SIM],
                                  ["run", *SIM, "--workload", "/dev/null"]])
def test_a_device_given_as_a_yaml_file_is_one_line(capsys, tmp_path, argv):
    """/dev/zero as the run's config or workload filled the memory (a MemoryError traceback
    under a memory limit); /dev/null was read as an empty file (the default workload ran)."""
    rc, _, err = _main([*argv, "--num-prompts", "3", "--out", str(tmp_path)], capsys)
    assert rc == 2 and _one_line(err).endswith(
        "/dev/null: is a character device, not a YAML file"), err
    assert not list(tmp_path.iterdir())


def test_a_yaml_file_from_a_pipe_still_loads(tmp_path):
    """`batchsim run <(make-config)`: process substitution hands a pipe, which is read."""
    import threading

    from batchsim.configs import load_yaml

    fifo = tmp_path / "config"
    os.mkfifo(fifo)
    writer = threading.Thread(target=lambda: fifo.write_text("workload:\n  num_prompts: 3\n"))
    writer.start()
    assert load_yaml(fifo) == {"workload": {"num_prompts": 3}}
    writer.join()
