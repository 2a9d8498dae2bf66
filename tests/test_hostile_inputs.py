"""A fresh adversarial pass (issue 37 item 4, h8): files and settings a careless or hostile user
hands batchsim, each refused in one plain line (exit 2) instead of a traceback, a hang or a run
that silently ignores what the user wrote. YAML files: test_hostile_yaml.py; stdout and a run
directory's files: test_hostile_outputs.py."""

from __future__ import annotations

import pytest

from tests.cli_calls import SIM, _main, _one_line, last_json


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


def test_models_import_of_a_device_says_what_it_is(capsys, tmp_path):
    """/dev/zero, a pipe or a directory given to `models import` was 'no such file'."""
    for given, kind in (("/dev/zero", "a character device"), (str(tmp_path), "a directory")):
        rc, _, err = _main(["models", "import", given], capsys)
        assert rc == 2 and _one_line(err).endswith(f"{given}: is {kind}, not a GGUF file"), err
