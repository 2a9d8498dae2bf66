"""A fresh adversarial pass (issue 37 item 4, h8): files and settings a careless or hostile user
hands batchsim, each refused in one plain line (exit 2) instead of a traceback, a hang or a run
that silently ignores what the user wrote."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from tests.cli_calls import SIM, _main, _one_line, last_json


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


def test_the_config_of_a_run_stopped_before_its_model_loaded_runs_again(capsys, tmp_path):
    """Such a run writes config.yaml without `resolved:` and `env:`; it was read as a run config
    with an unknown key 'config'."""

    from batchsim.server.engine.run_config import RunConfig, with_run_overrides
    from batchsim.server.engine.run_dir import write_config

    cfg = with_run_overrides(RunConfig(), {"num_prompts": 3}, executor="sim",
                             device_profile="M2 Ultra")
    write_config(tmp_path, cfg, cfg.workload, None)
    rc, out, err = _main(["run", str(tmp_path / "config.yaml"), "--no-progress", "--no-timeline",
                          "--out", str(tmp_path / "b"), "--json"], capsys)
    assert rc == 0, err
    assert last_json(out)["completed"] == 3


@pytest.mark.parametrize("name, text", [
    ("excel.csv", ("TIMESTAMP,ContextTokens,GeneratedTokens\n2023-11-16 18:15:46.68,374,44\n"
                  "2023-11-16 18:15:50.99,396,109\n")),
    ("notepad.jsonl", ('{"timestamp": 0, "input_length": 64, "output_length": 8}\n'
                      '{"timestamp": 500, "input_length": 32, "output_length": 8}\n')),
])
def test_a_trace_saved_with_a_byte_order_mark_replays(capsys, tmp_path, name, text):
    """Excel and Notepad save UTF-8 with a BOM: the CSV was refused for a missing TIMESTAMP column
    ("found: \\ufeffTIMESTAMP"), the JSONL for an "Unexpected UTF-8 BOM" on line 1."""

    trace = tmp_path / name
    trace.write_text(text, encoding="utf-8-sig")
    rc, out, err = _main(["run", *SIM, "--trace", str(trace), "--no-timeline", "--out",
                          str(tmp_path), "--json"], capsys)
    assert rc == 0, err
    assert last_json(out)["completed"] == 2


@pytest.mark.parametrize("text, says", [
    ("[" * 100_000 + "]" * 100_000, "cannot read"),  # a RecursionError traceback
    ('{"spec_decode_per_position_acceptance_rates": [0.5], "total_output_tokens": "x"}',
     "total_output_tokens must be a count, got x"),  # "unsupported operand type(s) for -"
    ('{"spec_decode_per_position_acceptance_rates": "abc"}',
     "spec_decode_per_position_acceptance_rates must be a list of numbers"),  # "... float: 'a'"
    ('{"spec_decode_per_position_acceptance_rates": [true]}',
     "must be a list of numbers, got [True]"),  # read as a rate of 1
    (('{"spec_decode_per_position_acceptance_rates": [0.5], "total_output_tokens": NaN, '
     '"spec_decode_num_drafts": 1}'), "total_output_tokens must be a count, got nan"),  # share 1
])
def test_acceptance_from_a_damaged_summary_is_one_line_naming_the_key(tmp_path, text, says):
    from batchsim.configs import ConfigError
    from batchsim.server.perf.spec_acceptance import from_run

    (tmp_path / "summary.json").write_text(text)
    with pytest.raises(ConfigError, match=r"^--acceptance-from .*") as err:
        from_run(tmp_path)
    assert says in str(err.value) and "\n" not in str(err.value)


@pytest.mark.parametrize("argv, says", [
    (["build", "smollm2-135m-instruct", "--out", "DIR"],
     "models build does not use --out (it is for models import)"),  # built into the cache, rc 0
    (["build", "smollm2-135m-instruct", "--form", "quantized"], "does not use --form"),
    (["import", "x.gguf", "--quantize", "4"], "models import does not use --quantize"),
    (["list", "llama-3.1-8b"], "models list does not use NAME"),
])
def test_models_refuses_a_flag_its_action_would_ignore(capsys, tmp_path, argv, says):
    argv = [str(tmp_path / "m") if a == "DIR" else a for a in argv]
    rc, _, err = _main(["models", *argv], capsys)
    assert rc == 2 and says in _one_line(err), err
    assert not (tmp_path / "m").exists()


LONG = "a" * 5000


@pytest.mark.parametrize("argv", [
    ["run", *SIM, "--workload", LONG], ["run", *SIM, "--engine", LONG],
    ["run", "--executor", "sim", "--device-profile", LONG], ["run", *SIM, "--trace", LONG],
    ["size", "--model", LONG], ["models", "import", LONG + ".gguf"], ["report", LONG],
])
def test_a_name_too_long_for_a_file_name_is_bad_input(capsys, tmp_path, argv):
    """Every lookup builds a path from the name: ENAMETOOLONG was exit 1 (a failure of the
    machine) with the 5,000 characters echoed."""
    rc, _, err = _main([*argv, "--out", str(tmp_path)] if argv[0] == "run" else argv, capsys)
    line = _one_line(err)
    assert rc == 2 and "too long" in line and len(line) < 300, err


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


@pytest.mark.parametrize("extra, says", [
    (["--spec-method", "draft", "--spec-tokens", "3", "--draft-model", "smollm2-135m-instruct"],
     "decides --spec-method, --draft-model, --spec-tokens itself"),
    (["--kv-bits", "4"], "decides --kv-bits itself"),
    (["--max-num-seqs", "1", "--memory-gb", "1"], "decides --memory-gb, --max-num-seqs itself"),
    (["--executor", "sim", "--device-profile", "M2 Ultra"], "decides --executor, --device-profile"),
])
def test_run_against_a_target_refuses_what_only_the_in_process_engine_reads(capsys, tmp_path,
                                                                           extra, says):
    """Each ran against the server as it was and recorded a run that looked like what was asked."""
    rc, _, err = _main(["run", "--target", "http://127.0.0.1:9/v1", *extra, "--out",
                        str(tmp_path)], capsys)
    assert rc == 2 and says in _one_line(err), err
    assert not list(tmp_path.iterdir())


def test_an_api_key_with_a_line_break_is_one_line_before_the_run(capsys, tmp_path, monkeypatch):
    """aiohttp refused the header with a 'header injection' ValueError traceback."""
    monkeypatch.setenv("OPENAI_API_KEY", "sk-abc\r")
    rc, _, err = _main(["run", "--target", "http://127.0.0.1:9/v1", "--out", str(tmp_path)],
                       capsys)
    assert rc == 2 and "OPENAI_API_KEY holds a control character" in _one_line(err), err


@pytest.mark.timeout(120)
@pytest.mark.parametrize("change, says", [
    ({"bandwidth_gbs": float("nan")}, "bandwidth_gbs must be finite and > 0, got nan"),  # hung
    ({"peak_tflops": {"float32": -5.0}}, "peak_tflops.float32 must be finite and > 0, got -5"),
    ({"forward_overhead_s": -1.0}, "forward_overhead_s must be finite and >= 0, got -1"),
    ({"bandwidth_efficiency": 0.0}, "bandwidth_efficiency must be finite and > 0, got 0"),
])
def test_a_device_profile_with_a_rate_that_cannot_price_a_step_is_one_line(capsys, tmp_path,
                                                                          change, says):
    """A hand-edited profile YAML: NaN bandwidth hung the simulated run (SIGTERM could not stop
    it), a negative peak was "step 0: ends at -0.006 before it starts" as a traceback, and a
    negative overhead ran and reported faster steps than the roofline allows."""
    import yaml

    profile = tmp_path / "mine.yaml"
    profile.write_text(yaml.safe_dump({"name": "mine", "bandwidth_gbs": 100.0,
                                       "peak_tflops": {"float32": 1.0}, **change}))
    rc, _, err = _main(["run", "--executor", "sim", "--device-profile", str(profile),
                        "--num-prompts", "2", "--out", str(tmp_path / "runs")], capsys)
    assert rc == 2 and says in _one_line(err), err


def test_a_lognormal_length_with_a_huge_std_is_one_line(capsys, tmp_path):
    """`input_len: {dist: lognormal, mean: 100, std: 1e300}` in a workload YAML was an
    OverflowError traceback while sampling."""
    workload = tmp_path / "wide.yaml"
    workload.write_text("num_prompts: 4\ninput_len: {dist: lognormal, mean: 100, std: 1e300}\n")
    rc, _, err = _main(["run", *SIM, str(workload), "--out", str(tmp_path)], capsys)
    assert rc == 2 and "length 'std' must be <= 2147483647, got 1e+300" in _one_line(err), err


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


def test_models_import_of_a_device_says_what_it_is(capsys, tmp_path):
    """/dev/zero, a pipe or a directory given to `models import` was 'no such file'."""
    for given, kind in (("/dev/zero", "a character device"), (str(tmp_path), "a directory")):
        rc, _, err = _main(["models", "import", given], capsys)
        assert rc == 2 and _one_line(err).endswith(f"{given}: is {kind}, not a GGUF file"), err
