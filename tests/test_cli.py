"""The command line as users run it: real processes, the JSON contract on the last stdout line,
clear errors for bad input (signals and run records: test_interrupts.py; --help's defaults:
test_help_defaults.py)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from tests.cli_calls import batchsim, cli_exit_code, last_json

RUN_KEYS = {
    "completed", "request_throughput", "output_throughput", "total_token_throughput",
    "mean_ttft_ms", "median_ttft_ms", "p99_ttft_ms", "mean_tpot_ms", "p99_tpot_ms", "mean_itl_ms",
    "mean_e2el_ms", "mean_batch_size", "max_batch_size", "peak_kv_bytes", "kv_budget_bytes",
    "num_preemptions", "num_rejected", "run_dir", "prompt_tps", "generation_tps", "peak_memory",
}


def test_help_lists_every_command_under_the_question_it_answers(batchsim_home):
    out = batchsim("--help", home=batchsim_home).stdout
    heading, listed = None, {}
    for line in out.splitlines():
        if line.startswith("  ") and not line.startswith("   ") and line.endswith(":"):
            heading = line.strip().rstrip(":")
        elif line.startswith("    ") and line[4:5].isalpha():
            listed[line.split()[0]] = heading
    assert listed == {
        "size": "How many requests fit before the KV cache overruns memory",
        "sweep": "How many requests fit before the KV cache overruns memory",
        "bench-decode": "How much batching speeds up decode",
        "compare": "How much batching speeds up decode",
        "roofline": "How much batching speeds up decode",
        "run": "How a server behaves under realistic traffic",
        "serve": "How a server behaves under realistic traffic",
        "report": "How a server behaves under realistic traffic",
        "calibrate": "How far to trust the simulator",
        "validate": "How far to trust the simulator",
        "fit-macs": "How far to trust the simulator",
        "models": "Models",
    }
    assert "--request-rate" in batchsim("run", "--help", home=batchsim_home).stdout


def test_every_flag_of_every_command_says_what_it_does():
    from batchsim.scripts.cli import build_parser

    sub = next(a for a in build_parser()._actions if a.dest == "command")
    silent = [f"{name} {a.option_strings[0]}" for name, parser in sub.choices.items()
              for a in parser._actions
              if a.option_strings and a.dest != "help" and not (a.help or "").strip()]
    assert silent == []


def test_models_json_contract(batchsim_home):
    doc = last_json(batchsim("models", "--json", home=batchsim_home).stdout)
    names = {m["name"] for m in doc["models"]}
    assert {"tiny", "smollm2-135m", "qwen3-0.6b", "llama-3.2-1b", "llama-3.1-8b"} <= names
    llama = next(m for m in doc["models"] if m["name"] == "llama-3.1-8b")
    assert llama["kv_bytes_per_token"]["float16"] == 2 * 32 * 8 * 128 * 2
    assert llama["weight_bytes"]["float16"] == 2 * llama["params"]
    assert set(llama["weight_bytes"]) >= {"float32", "float16", "bfloat16", "q4", "q8"}


def test_real_run_writes_records_and_the_vllm_summary(batchsim_home, tmp_path):
    proc = batchsim("run", "--model", "tiny", "--num-prompts", "12", "--request-rate", "40",
                    "--input-len", "uniform:8:64", "--output-len", "uniform:4:16",
                    "--out", str(tmp_path), "--no-progress", home=batchsim_home)
    summary = last_json(proc.stdout)
    assert RUN_KEYS <= set(summary)
    assert summary["completed"] == 12 and summary["kv_account_mismatches"] == 0
    assert summary["mean_batch_size"] > 1
    run_dir = Path(summary["run_dir"])
    rows = [json.loads(x) for x in (run_dir / "requests.jsonl").read_text().splitlines()]
    assert len(rows) == 12 and all(r["status"] == "finished" for r in rows)
    assert all(len(r["token_times_s"]) == r["num_output_tokens"] for r in rows)
    steps = [json.loads(x) for x in (run_dir / "steps.jsonl").read_text().splitlines()]
    assert max(s["batch_size"] for s in steps) == summary["max_batch_size"]
    assert (run_dir / "config.yaml").read_text().count("kv_budget_bytes") >= 1
    assert json.loads((run_dir / "summary.json").read_text())["completed"] == 12


def test_real_moe_run_completes_with_exact_kv_bytes(batchsim_home, tmp_path):
    # qwen3_moe on the real executor: every step's measured KV bytes equal the scheduler's.
    proc = batchsim("run", "--model", "tiny-moe", "--num-prompts", "16", "--request-rate", "80",
                    "--input-len", "uniform:8:64", "--output-len", "uniform:4:16",
                    "--out", str(tmp_path), "--no-progress", home=batchsim_home)
    summary = last_json(proc.stdout)
    assert summary["completed"] == 16 and summary["failed"] == 0
    assert summary["kv_account_mismatches"] == 0 and summary["mean_batch_size"] > 1
    assert summary["peak_kv_bytes_measured"] == summary["peak_kv_held_bytes"] > 0


def test_a_config_typo_names_the_file_and_the_key(batchsim_home, tmp_path):
    cfg = tmp_path / "bad.yaml"
    cfg.write_text("model: tiny\nscheduler:\n  max_num_seq: 4\n")
    proc = batchsim("run", str(cfg), "--executor", "fake", home=batchsim_home, check=False)
    assert proc.returncode == 2
    assert "bad.yaml" in proc.stderr
    assert "max_num_seq" in proc.stderr
    assert "max_num_seqs" in proc.stderr
    assert "Traceback" not in proc.stderr


def test_an_unreachable_hub_id_is_a_clear_error(batchsim_home):
    proc = batchsim("run", "--model", "nobody/no-such-model", "--num-prompts", "1",
                    home=batchsim_home, check=False)
    assert proc.returncode == 2
    assert "nobody/no-such-model" in proc.stderr and "Traceback" not in proc.stderr


@pytest.mark.parametrize("command", ["size", "models"])
def test_pure_arithmetic_commands_do_not_load_mlx(command):
    code = (f"import sys, scripts.{'size' if command == 'size' else 'models_cmd'}; "
            "print('mlx.core' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


def test_validate_contract_on_the_tiny_model(batchsim_home, tmp_path):
    """`validate` end to end: two small cases run twice real and once simulated, the issue's JSON
    contract, the median of the real runs as the measurement with their spread as the noise floor,
    the device-speed probe beside every run, and the refusal to validate on a calibration model."""
    import yaml

    devices = Path(__file__).parent.parent / "configs" / "devices"
    shipped = devices / "linux-x86_64-openblas-2core.yaml"
    profile = yaml.safe_load(shipped.read_text())
    # gqa8-probe as the calibration model: tiny counts as unseen, and the speed probe runs on it.
    profile["calibration"]["calibrated_on"] = ["gqa8-probe"]
    profile["calibration"]["device"] = "Some Other CPU, OpenBLAS 0.0"
    profile["calibration"]["speed_probe_ms"] = {
        "gqa8-probe:decode:1x131": 20.0, "gqa8-probe:decode:8x131": 32.0,
        "gqa8-probe:prefill:64x0": 65.0}
    profile_path = tmp_path / "profile.yaml"
    profile_path.write_text(yaml.safe_dump(profile))
    matrix = tmp_path / "matrix.yaml"
    matrix.write_text(yaml.safe_dump({"cases": [
        {"name": "b1", "max_num_seqs": 1, "workload": {
            "num_prompts": 3, "arrival": "poisson", "request_rate": "inf",
            "input_len": "fixed:8", "output_len": "fixed:6", "seed": 1}},
        {"name": "b4", "max_num_seqs": 4, "workload": {
            "num_prompts": 4, "arrival": "poisson", "request_rate": "inf",
            "input_len": "fixed:8", "output_len": "fixed:6", "seed": 2}},
    ]}))
    args = ["validate", "--model", "tiny", "--device-profile", str(profile_path),
            "--matrix", str(matrix), "--out", str(tmp_path / "results"), "--repeats", "2"]
    run = batchsim(*args, home=batchsim_home)
    summary = last_json(run.stdout)
    metrics = {"output_throughput", "mean_ttft_ms", "mean_tpot_ms", "p99_ttft_ms", "p99_tpot_ms"}
    assert metrics <= set(summary["median_abs_err"]) and metrics <= set(summary["max_abs_err"])
    assert metrics <= set(summary["noise_floor"]) and summary["repeats"] == 2
    assert metrics <= set(summary["at_probed_speed"]["median_abs_err"])
    assert [c["case"] for c in summary["cases"]] == ["b1", "b4"]
    for case in summary["cases"]:
        assert len(case["real_runs"]) == 2 and len(case["real_run_dir"]) == 2
        tputs = [r["output_throughput"] for r in case["real_runs"]]
        assert case["measured"]["output_throughput"] == pytest.approx(sum(tputs) / 2)  # median of 2
        dev = case["repeat_abs_dev"]["output_throughput"]
        assert dev == pytest.approx(abs(tputs[0] - tputs[1]) / sum(tputs))  # each half the gap
        assert len(case["device_speed_runs"]) == 2 and case["device_speed"] > 0
        # Re-simulated on the device as probed: with every request at t=0 the whole timeline
        # stretches by 1/speed, so throughput scales by the speed itself.
        adjusted = 1 + case["at_probed_speed"]["output_throughput"]
        assert adjusted * case["measured"]["output_throughput"] == pytest.approx(
            case["predicted"]["output_throughput"] * case["device_speed"], rel=1e-6)
        # The cost model on the real runs' own steps, and on them at the probed speed.
        assert case["at_probed_speed"]["step_time_err"] == pytest.approx(
            (1 + case["step_time_err"]) / case["device_speed"] - 1)
        # What the predicted steps were made of: shares of one total, copies included.
        shares = case["step_parts_share"]
        assert sum(shares.values()) == pytest.approx(1.0) and shares["weights_s"] > 0
        # Same requests, same scheduler: peak batch is decided by policy, not timing.
        assert case["measured"]["max_batch_size"] == case["predicted"]["max_batch_size"]
    assert summary["cases"][1]["measured"]["max_batch_size"] == 4
    step_errs = [abs(c["step_time_err"]) for c in summary["cases"]]
    assert summary["step_time_err"]["median_abs"] == pytest.approx(float(np.median(step_errs)))
    assert Path(summary["png"]).exists()
    assert summary["profile_device"] == "Some Other CPU, OpenBLAS 0.0" != summary["device"]
    assert "was calibrated on Some Other CPU" in run.stderr  # a profile from another machine
    assert (tmp_path / "results" / "validate.jsonl").exists()

    # Scored again from the recorded real runs, nothing run for real: the same medians against the
    # same (deterministic) simulation give the same errors; a case changed since is refused.
    rescored = last_json(batchsim(*args, "--measured-from",
                                  str(tmp_path / "results" / "validate.jsonl"),
                                  home=batchsim_home).stdout)
    assert rescored["cases"] and rescored["repeats"] == 2 and "at_probed_speed" not in rescored
    for before, after in zip(summary["cases"], rescored["cases"]):
        assert after["measured"] == before["measured"] and after["error"] == before["error"]
        assert after["real_runs"] == before["real_runs"] and after["step_time_err"] is None
        assert after["step_parts_share"] is None  # no real steps to split
    assert not list((Path(rescored["run_dir"])).glob("*-real*"))
    matrix.write_text(matrix.read_text().replace("fixed:6", "fixed:7"))
    changed = batchsim(*args, "--measured-from", str(tmp_path / "results" / "validate.jsonl"),
                       home=batchsim_home, check=False)
    assert changed.returncode == 2 and "has changed since" in changed.stderr

    profile["calibration"]["calibrated_on"] = ["tiny"]
    profile_path.write_text(yaml.safe_dump(profile))
    refused = batchsim(*args, home=batchsim_home, check=False)
    assert refused.returncode == 2 and "used to calibrate" in refused.stderr
    bad = batchsim(*args[:-1], "0", home=batchsim_home, check=False)
    assert bad.returncode == 2 and "--repeats: expected a positive integer" in bad.stderr


# -- bad input: exit 2 with one clear line (argparse's or a ConfigError), never a traceback ------
@pytest.mark.parametrize("argv, says", [
    (["run", "--input-len", "-5"], "positive 'value', got -5"),  # was clamped to 1
    (["run", "--input-len", "uniform:-3:10"], "1 <= min <= max"),
    (["run", "--output-len", "normal:100:-5"], "positive 'std'"),  # was numpy's traceback
    (["run", "--memory-gb", "inf"], "positive finite"),  # was an OverflowError traceback
    (["run", "--memory-gb", "nan"], "positive finite"),
    (["run", "--memory-gb", "-1"], "positive finite"),
    (["run", "--memory-gb", "0"], "positive finite"),
    (["size", "--context", "-5"], "positive integer"),  # was a table of nonsense
    (["size", "--context-dist", "uniform:-5:10"], "1 <= min <= max"),
    (["size", "--os-reserve-gb", "-4"], "expected a number >= 0"),
    (["sweep", "--max-batch", "0"], "--max-batch: expected a positive integer"),  # was exit 0
])
def test_bad_flags_are_one_line_errors(argv, says, capsys, tmp_path):
    rc = cli_exit_code([*argv, "--out", str(tmp_path)])
    err = capsys.readouterr().err
    assert rc == 2 and says in err.strip().splitlines()[-1] and "Traceback" not in err


@pytest.mark.parametrize("name, text, says", [
    ("dir", None, "is a directory"),  # was an IsADirectoryError traceback
    ("inf.yaml", "model: tiny\nmemory_gb: .inf\n", "memory_gb must be > 0 and finite"),
    # A bare workload YAML with a typo: the error named 'num_prompts' (a run-config key check).
    ("w.yaml", "num_prompts: 4\nzzz: 3\n", "unknown key 'zzz'; allowed keys: arrival"),
])
def test_bad_config_files_are_one_line_errors(name, text, says, capsys, tmp_path):
    path = tmp_path / name
    path.mkdir() if text is None else path.write_text(text)
    rc = cli_exit_code(["run", str(path), "--executor", "fake", "--out", str(tmp_path)])
    err = capsys.readouterr().err
    assert rc == 2 and "Traceback" not in err
    assert str(path) in err and says in err, err


def test_run_target_where_every_request_fails_exits_1(batchsim_home, tmp_path):
    import socket

    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = batchsim("run", "--model", "tiny", "--target", f"http://127.0.0.1:{port}/v1",
                    "--num-prompts", "2", "--out", str(tmp_path), "--no-progress",
                    home=batchsim_home, check=False)
    assert proc.returncode == 1 and "Traceback" not in proc.stderr
    summary = last_json(proc.stdout)  # the summary still closes stdout, keys unchanged
    assert summary["completed"] == 0 and summary["failed"] == 2
    assert "all 2 requests" in proc.stderr.strip().splitlines()[-1]
    assert "(HTTP 2 x connection refused)" in proc.stderr  # was "{'connection refused': 2}"
    assert summary["http_statuses"] == {"connection refused": 2}  # was {'None': 2}


def test_json_leaves_stdout_one_json_line_for_any_command(capsys, tmp_path):
    from batchsim.scripts.cli import main

    argv = ["size", "--model", "llama-3.1-8b", "--quantize", "4", "--mac", "M2 Max",
            "--out", str(tmp_path)]
    assert main(argv) == 0
    assert len(capsys.readouterr().out.splitlines()) > 1  # tables, then the JSON
    assert main([*argv, "--json"]) == 0
    captured = capsys.readouterr()
    lines = captured.out.splitlines()
    assert len(lines) == 1 and "Batch limits per Mac" in captured.err
    rows = json.loads(lines[0])["rows"]
    assert rows and all({"decode_tok_s_b1", "max_batch", "profile"} <= set(r) for r in rows)
    assert main(argv) == 0  # and the next command prints its tables on stdout again
    assert len(capsys.readouterr().out.splitlines()) > 1


def test_bench_decode_pairs_each_window_with_the_one_beside_it():
    # The machine halves its speed for two repetitions and one executor window is slow: the
    # executor is 10% ahead in four pairs of windows out of five, which the paired ratio reports
    # and the ratio of the two medians (0.6) does not.
    from statistics import median

    from batchsim.scripts.bench_decode import _add_ratios

    mlx, ex = [100.0, 100.0, 50.0, 50.0, 100.0], [110.0, 110.0, 55.0, 55.0, 60.0]
    rows = [{"batch": 8, "mode": m, "decode_tok_s": median(v), "samples_tok_s": v}
            for m, v in (("mlx_lm", mlx), ("executor", ex))]
    _add_ratios(rows)
    assert rows[1]["vs_mlx_lm"] == pytest.approx(0.6)
    assert rows[1]["vs_mlx_lm_paired"] == pytest.approx(1.1)
    assert rows[1]["vs_bare"] is None and rows[1]["vs_bare_paired"] is None


def test_bench_decode_executor_decodes_the_batch_at_one_position(tiny):
    # The bare loop and BatchGenerator prefill the whole batch at once; the executor's batch must
    # too, or its rows would sit at several positions (masked, scattered) and the modes would not
    # decode the same state. 600-token prompts: two prefill chunks per request, taken together.
    from batchsim.server.measure.decode_bench import Executor

    ref, model, _ = tiny
    bench = Executor(model, 6, 600, ref.spec.vocab_size, ref.spec.kv_bytes_per_token("float32"))
    assert len(bench.ex.pool) == 6 and len(set(bench.ex.pool.lengths)) == 1


def test_a_narrow_table_folds_its_names_instead_of_cutting_them():
    import io

    from batchsim.scripts.common import table
    from rich.console import Console

    buf = io.StringIO()
    Console(file=buf, width=24).print(table("t", ["batch", "executor/mlx_lm_paired"], [[1, 1.5]]))
    text = buf.getvalue()
    assert "…" not in text and "executor/mlx" in text and "_lm_paired" in text  # folded


def test_validate_without_a_profile_picks_as_run_does(monkeypatch):
    """`batchsim validate` on a fresh checkout said "device profile 'local' not found" where
    `run --executor sim` picks the shipped profile calibrated on a machine like this one."""
    from batchsim.scripts import cli, validate

    seen = []
    monkeypatch.setattr(validate, "profile_for_this_machine", lambda: "shipped-like-this")
    monkeypatch.setattr(validate, "_open", lambda args, _: seen.append(args.device_profile)
                        or "stop here")
    for given in ([], ["--device-profile", "M2 Max"]):
        validate.run(cli.build_parser().parse_args(["validate", "--cases", "b1-poisson", *given]))
    assert seen == ["shipped-like-this", "M2 Max"]
