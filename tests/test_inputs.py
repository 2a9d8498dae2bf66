"""Bad and extreme input as a user types it (issue 37's adversarial pass): every numeric flag
bounded, one plain line and exit 2 for what is refused, the virtual clock finishing on far-future
arrivals, `serve` and `run` sharing flags and checks, tables that fit the terminal, and exit codes
that say a run served nothing or was interrupted. `report` on corrupted run directories:
test_report_damage.py; `run --target` against failing servers: test_run_target_inputs.py."""

from __future__ import annotations

import argparse
import asyncio
import json
from pathlib import Path

import pytest

from tests.cli_calls import SIM, _batchsim, _main, _one_line, last_json

NOT_NUMBERS = {"str", "str_list", "Path", "length"}  # `length` has its own test below


def _numeric_flags() -> list[tuple[str, argparse.Action]]:
    from batchsim.scripts.cli import build_parser

    sub = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    return [(name, a) for name, p in sub.choices.items() for a in p._actions
            if a.type is not None and not a.choices
            and getattr(a.type, "__name__", "") not in NOT_NUMBERS]


def test_every_numeric_flag_refuses_nan_inf_negatives_and_overflow_in_one_line(capsys):
    from batchsim.scripts.cli import build_parser

    parser, refused_badly = build_parser(), []
    flags = _numeric_flags()
    assert len(flags) >= 60  # every command's: found from the parser, new flags included
    for command, action in flags:
        flag = action.option_strings[0]
        for value in ("nan", "inf", "-inf", "-1", "1e308", str(2**63)):
            if flag == "--request-rate" and value == "inf":
                continue  # 'inf' sends every request at once
            try:
                parser.parse_args([command, flag, value])
                refused_badly.append(f"{command} {flag} {value}: accepted")
            except SystemExit as exc:
                err = capsys.readouterr().err
                if exc.code != 2 or len(err.strip().splitlines()) != 1 or flag not in err:
                    refused_badly.append(f"{command} {flag} {value}: {exc.code} {err!r}")
    assert not refused_badly, refused_badly


@pytest.mark.parametrize("argv, says", [
    (["run", *SIM, "--memory-gb", "1e308"], "--memory-gb: expected a positive finite number <= "),
    (["size", "--memory-gb", "1e308"], "--memory-gb: expected a positive finite number"),
    (["sweep", "--memory-gb", "1e308"], "--memory-gb: expected a positive finite number"),
    (["compare", "--memory-gb", "1e308"], "--memory-gb: expected a positive finite number"),
    (["serve", "--memory-gb", "1e308"], "--memory-gb: expected a positive finite number"),
    (["run", "--percentiles", "nan"], "--percentiles: expected comma-separated numbers in 0..100"),
    (["size", "--seed", "-1"], "--seed: expected an integer >= 0 and <= 4294967295"),
    (["run", "--output-len", "9223372036854775808"], "length 'value' must be <= 2147483647"),
    (["run", "--input-len", "zipf:1.1:1:2147483647"], "zipf spans at most 4194304 lengths"),  # OOM
    (["bench-decode", "--steps", "0"], "--steps: expected a positive integer"),
    (["bench-decode", "--steps", "-1"], "--steps: expected a positive integer"),
    (["run", *SIM, "--num-prompts", "2147483647"], "num_prompts: must be >= 1 and <= 10000000"),
    (["roofline", "--bandwidth-mb", "2147483647"],
     ("--bandwidth-mb: expected a positive integer <= "
                                                   "8192")),  # was an OverflowError in MLX
    (["bench-decode", "--batch", "2147483647"], ("--batch: expected comma-separated integers in "
                                                "1..4096")),  # was numpy's 2 TiB allocation error
])
def test_numbers_at_the_edges_are_one_line_errors(argv, says, capsys, tmp_path):
    rc, _, err = _main([*argv, "--out", str(tmp_path)] if argv[0] != "serve" else argv, capsys)
    assert rc == 2 and says in _one_line(err), err


@pytest.mark.parametrize("line, says", [
    ("memory_gb: 1.0e+308", "memory_gb must be > 0 and finite, at most 1048576 GiB"),  # Overflow
    ("percentiles: [150]", "percentiles must be numbers in 0..100"),  # numpy's, after the run
])
def test_a_config_with_numbers_out_of_range_is_one_line(capsys, tmp_path, line, says):
    cfg = tmp_path / "c.yaml"
    cfg.write_text(f"model: llama-3.1-8b\nexecutor: sim\n{line}\n")
    rc, _, err = _main(["run", str(cfg), "--out", str(tmp_path)], capsys)
    assert rc == 2 and says in _one_line(err)


def test_the_virtual_clock_jumps_to_a_timer_a_day_or_more_away():
    from batchsim.server.engine import clock

    async def far() -> float:
        await asyncio.sleep(1e9)  # asyncio waits at most a day per turn: 11,574 turns before
        return asyncio.get_running_loop().time()

    loop = clock.VirtualTimeLoop()
    try:
        assert loop.run_until_complete(far()) == 1e9 and loop._virtual._turns < 10
    finally:
        loop.close()


def test_far_future_arrivals_and_an_overflowing_rate_are_refused(tmp_path):
    """Arrivals past MAX_CLOCK_S (1e9 s) ran, and `report` then read their records as damage
    (completed 3 -> 1 for --request-rate 1e-12); before that they never finished."""
    trace = tmp_path / "far.jsonl"  # Mooncake rows, timestamps in ms: the second at 1e30 s
    trace.write_text('{"timestamp": 0, "input_length": 100, "output_length": 8}\n'
                     '{"timestamp": 1e33, "input_length": 100, "output_length": 8}\n')
    workload = tmp_path / "slow.yaml"
    workload.write_text("num_prompts: 3\nrequest_rate: 1.0e-300\n")
    rate, scale = "a larger rate or fewer prompts", "a smaller time scale or fewer prompts"
    for extra, says, use in (
            (["--request-rate", "1e-12", "--num-prompts", "3"], "request_rate 1e-12", rate),
            (["--trace", str(trace)], "trace.time_scale 1", scale),
            ([str(workload)], "request_rate 1e-300", rate)):
        proc = _batchsim("run", *SIM, *extra, "--out", str(tmp_path), "--json")
        assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr[-2000:]
        line = proc.stderr.splitlines()[-1]  # the advice fits the setting (a rate has no scale)
        assert f"{says}: the last request arrives at" in line and "(32 years)" in line, line
        assert f"; use {use} (--num-prompts)" in line, line
    workload.write_text("num_prompts: 3\nrequest_rate: 2.5e-9\n")  # the last at 8e8 s: runs
    proc = _batchsim("run", *SIM, str(workload), "--out", str(tmp_path), "--json")
    assert last_json(proc.stdout)["completed"] == 3, proc.stderr[-2000:]
    proc = _batchsim("run", *SIM, "--request-rate", "1e-308", "--out", str(tmp_path))
    assert proc.returncode == 2 and "Traceback" not in proc.stderr and "Warning" not in proc.stderr
    assert "request_rate 1e-308: the last arrivals fall beyond" in proc.stderr.splitlines()[-1]


def test_a_run_whose_last_arrival_is_at_the_limit_reports_unchanged(tmp_path):
    """The last arrival exactly at MAX_ARRIVAL_S (1e9 s) is accepted, and its service ends past
    it: `report` read that record as damage (completed 2 -> 1) and overwrote the run's correct
    summary.json. A Mooncake trace at 0 / 1e12 ms is the same case."""
    trace = tmp_path / "edge.jsonl"
    trace.write_text('{"timestamp": 0, "input_length": 100, "output_length": 8}\n'
                     '{"timestamp": 1e12, "input_length": 100, "output_length": 8}\n')
    for n, extra in enumerate((["--request-rate", "1e-9", "--num-prompts", "2"],
                               ["--trace", str(trace)])):
        out = tmp_path / f"runs{n}"
        proc = _batchsim("run", *SIM, *extra, "--out", str(out), "--json")
        assert proc.returncode == 0, proc.stderr[-2000:]
        ran = last_json(proc.stdout)
        assert ran["completed"] == 2 and ran["duration"] > 1e9
        (run_dir,) = out.iterdir()
        written = (run_dir / "summary.json").read_text()
        proc = _batchsim("report", str(run_dir), "--json")
        assert proc.returncode == 0 and "skipped" not in proc.stderr, proc.stderr[-2000:]
        assert last_json(proc.stdout)["completed"] == 2
        assert (run_dir / "summary.json").read_text() == written


@pytest.mark.parametrize("content", [b"{garbage", b"[1, 2]", b"\xff\xfe",
                                     b"[" * 5000 + b"]" * 5000])
def test_a_model_directory_with_a_broken_config_is_one_line(tmp_path, capsys, content):
    # Were JSONDecodeError, AttributeError, UnicodeDecodeError and RecursionError tracebacks
    # (as --model and as --draft-model: both read config.json the same way).
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_bytes(content)
    rc, _, err = _main(["run", "--executor", "sim", "--device-profile", "M2", "--model",
                        str(model), "--out", str(tmp_path / "runs")], capsys)
    assert rc == 2 and "not a model config" in _one_line(err), err


@pytest.mark.parametrize("quantization", [4, [4], "x", {"bits": "x"}])
def test_a_model_config_with_a_broken_quantization_is_one_line(tmp_path, capsys, quantization):
    # Each was an AttributeError/TypeError traceback from the loader (rc 1).
    from batchsim.server.models.spec import zoo_spec
    model = tmp_path / "model"
    model.mkdir()
    config = {**zoo_spec("tiny").config, "quantization": quantization}
    (model / "config.json").write_text(json.dumps(config))
    rc, _, err = _main(["run", "--executor", "sim", "--device-profile", "M2", "--model",
                        str(model), "--out", str(tmp_path / "runs")], capsys)
    assert rc == 2 and "'quantization' is not an object" in _one_line(err), err

# -- serve and run: one set of flags and checks ----------------------------------------------
def test_serve_offers_only_what_it_accepts_and_checks_what_run_checks(capsys, tmp_path):
    from batchsim.scripts.cli import build_parser

    sub = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    serve_flags = {f for a in sub.choices["serve"]._actions for f in a.option_strings}
    assert not serve_flags & {"--executor", "--device-profile"}
    rc, _, err = _main(["serve", "--executor", "sim"], capsys)
    assert rc == 2 and "unrecognized arguments: --executor sim" in _one_line(err)
    for value in ("0", "-1"):
        rc, _, err = _main(["serve", "--prefill-step-size", value], capsys)
        assert rc == 2 and "--prefill-step-size: expected a positive integer" in _one_line(err)
    says = "prefill_step_size must be a positive multiple of 256"
    rc, _, err = _main(["serve", "--prefill-step-size", "100"], capsys)  # was accepted silently
    assert rc == 2 and says in _one_line(err)
    rc, _, err = _main(["run", *SIM, "--prefill-step-size", "100", "--out", str(tmp_path)], capsys)
    assert rc == 2 and says in _one_line(err)


# -- frictions -------------------------------------------------------------------------------
@pytest.mark.parametrize("columns", [80, 160])
def test_models_fits_the_terminal_and_never_cuts_a_name(columns):
    from batchsim.server.models.spec import zoo_names

    proc = _batchsim("models", env={"COLUMNS": str(columns)})
    assert proc.returncode == 0, proc.stderr
    table = proc.stdout.splitlines()[:-1]
    assert max(len(line) for line in table) <= columns
    for name in zoo_names():
        assert any(f"│ {name} " in line for line in table), name


@pytest.mark.parametrize("width", [60, 80, 160])
def test_every_table_keeps_its_cells_whole_and_names_the_columns_left_out(width):
    """size, sweep and fit-macs cut numbers and ids at 80 columns (`10.…`, `vllmm…`): a table
    now leaves out the columns that do not fit, named in its caption."""
    import re

    from batchsim.scripts.common import table
    from rich.console import Console

    columns = ["chip", "usable GiB dflt/raised", "weights GiB", "max batch padded/paged",
               "tok/s b1", "tok/s @max", "id"]
    values = ["M3 Ultra", "170.67 / 192.00", "4.21", "1,234 / 5,678", "12.35", "1,234",
              "vllmmlx-m4max-llama-3.2-1b-q4-b1"]
    console = Console(width=width, record=True)
    console.print(table("title", columns, [values] * 3, width=width))
    text = console.export_text()
    assert max(map(len, text.splitlines())) <= width and "…" not in text, text
    said = re.search(r"left out at \d+ columns: (.*) \(a wider", " ".join(text.split()))
    left = said.group(1).split(", ") if said else []
    assert left == columns[len(columns) - len(left):] and (width == 160) == (not left), text
    assert all(v in text for v in values[: len(values) - len(left)]), text


def test_size_at_80_columns_keeps_its_answer_columns(capsys, tmp_path, monkeypatch):
    """At 80 columns `size` left out its tok/s columns (the answer) and kept weights and KV
    sizes: the columns a user asked size for are seated first."""
    from batchsim.scripts.common import out

    monkeypatch.setattr(type(out), "width", property(lambda self: 80))  # an 80-column terminal
    rc, text, _ = _main(["size", "--model", "llama-3.1-8b", "--quantize", "4", "--mac", "M4 Max",
                         "--out", str(tmp_path)], capsys)
    head = " ".join(text.split("left out at")[0].split())
    assert rc == 0 and "left out at 80 columns" in text, text
    assert all(c in head for c in ("tok/s", "b1", "@max", "fits", "padded/paged")), text


def test_a_run_that_served_nothing_exits_3_with_the_reason(capsys, tmp_path):
    rc, out, err = _main(["run", *SIM, "--memory-gb", "4.5", "--input-len", "8000",
                          "--num-prompts", "3", "--out", str(tmp_path)], capsys)
    assert rc == 3 and last_json(out)["completed"] == 0
    line = _one_line(err)
    assert "served nothing: 3 of 3 requests rejected" in line and "exceeds the KV budget" in line


def test_errors_are_plain_single_lines_even_long_and_with_colons(capsys, tmp_path):
    deep = tmp_path / ("d" * 150)
    deep.mkdir()
    cfg = deep / "w.yaml"
    cfg.write_text("num_prompts: 4\ninput_len: 'lognormal:-1:100:4096'\n")
    rc, _, err = _main(["run", str(cfg), "--executor", "fake", "--out", str(tmp_path)], capsys)
    assert rc == 2 and len(err.strip().splitlines()) == 1, err
    assert str(cfg) in err and "lognormal:-1:100:4096" in err  # not wrapped, no emoji


def test_names_with_colons_stay_text_in_the_tables_and_notes(capsys, tmp_path):
    workload = tmp_path / "a:-1:b.yaml"
    workload.write_text("num_prompts: 2\nrequest_rate: 10.0\n")
    rc, out, err = _main(["run", str(workload), *SIM, "--out", str(tmp_path)], capsys)
    assert rc == 0 and "workload a:-1:b" in err and "\N{THUMBS DOWN SIGN}" not in out + err


def test_exit_codes_are_documented_in_help(capsys):
    rc, out, _ = _main(["run", "--help"], capsys)
    assert rc == 0 and "3 a run that served no request" in " ".join(out.split())
    assert "130 interrupted" in " ".join(out.split()) and "OPENAI_API_KEY" in out


def test_ramp_from_the_command_line_and_chat_refuses_ignore_eos(capsys, tmp_path):
    from batchsim.scripts import run_cmd
    from batchsim.scripts.cli import build_parser

    args = build_parser().parse_args(["run", "--request-rate", "1", "--ramp-end-rate", "8"])
    w = run_cmd.config_from_args(args).workload
    assert (w.arrival, w.request_rate, w.ramp_end_rate) == ("ramp", 1.0, 8.0)
    rc, out, err = _main(["run", *SIM, "--request-rate", "1", "--ramp-end-rate", "8",
                          "--num-prompts", "6", "--out", str(tmp_path), "--json"], capsys)
    assert rc == 0 and last_json(out)["completed"] == 6, err
    rc, _, err = _main(["run", "--workload", "chat", "--ignore-eos", "--executor", "fake",
                        "--out", str(tmp_path)], capsys)
    assert rc == 2 and "--ignore-eos: the chat workload honours EOS" in _one_line(err)


def test_a_run_directory_config_runs_again(capsys, tmp_path):
    rc, out, err = _main(["run", *SIM, "--num-prompts", "5", "--seed", "4", "--out",
                          str(tmp_path / "a"), "--json"], capsys)
    assert rc == 0, err
    first = last_json(out)
    rc, out, err = _main(["run", str(Path(first["run_dir"]) / "config.yaml"), "--no-progress",
                          "--out", str(tmp_path / "b"), "--json"], capsys)
    assert rc == 0, err
    again = last_json(out)
    assert again["total_output_tokens"] == first["total_output_tokens"]
    assert again["mean_ttft_ms"] == first["mean_ttft_ms"] and again["workload"] == first["workload"]


def test_a_run_directory_is_one_name_under_out_whatever_the_label(tmp_path):
    """`run --model /abs/dir` labelled its run `/abs/dir-default-mlx`: the run directory was
    nested under out/TIMESTAMP-/abs/...; a long unicode name failed with ENAMETOOLONG."""
    from batchsim.server.results.jsonio import new_run_dir

    for label in ("/tmp/models/x-default-mlx", "..\\..\\x\x00\n", "模型" * 200):
        run_dir = new_run_dir(tmp_path / "out", label)
        assert run_dir.parent == tmp_path / "out" and run_dir.is_dir(), run_dir
    assert "模型" in run_dir.name and len(run_dir.name.encode()) <= 255


@pytest.mark.parametrize("argv, says", [
    (["--api-key", ""], "--api-key: must be non-empty printable text"),  # an unset $KEY
    (["--api-key", "k\nx"], "--api-key: must be non-empty printable text"),
    (["--served-model-name", " "], "--served-model-name: must be non-empty printable text"),
])
def test_serve_refuses_an_empty_key_or_name_before_loading_the_model(capsys, argv, says):
    """Both started a server (after loading the model) that no client could use."""
    rc, _, err = _main(["serve", *argv], capsys)
    line = _one_line(err)
    assert rc == 2 and says in line and "k\nx" not in err, err


@pytest.mark.parametrize("command", [["size"], ["sweep", *SIM[:-1]], ["compare", *SIM[:-1]]])
def test_an_output_directory_that_is_a_file_is_refused_before_the_work(capsys, tmp_path, command):
    """Each ran its whole workload, then failed with '[Errno 17] File exists', exit 1."""
    not_a_dir = tmp_path / "results"
    not_a_dir.write_text("")
    rc, out, err = _main([*command, "--out", str(not_a_dir)], capsys)
    assert rc == 2 and f"output directory {not_a_dir}: not a directory" in _one_line(err), err
    assert not out  # no table: nothing ran


def test_size_refuses_a_name_no_hub_repo_can_have_without_asking_the_hub(monkeypatch):
    """`size --model nope` asked the hub for nope/config.json (5 retries, their log lines on
    stderr, then a wrapped error) where `run --model nope` says in one line what a model can be."""
    import huggingface_hub
    from batchsim.server.models import loader

    def asked(*args, **kwargs):
        raise AssertionError("the hub was asked")

    monkeypatch.setattr(huggingface_hub, "hf_hub_download", asked)
    for name in ("nope", "./nope", "a/b/c"):
        with pytest.raises(loader.ModelNotFoundError, match="a hub id \\(owner/name\\)"):
            loader.spec_for(name)
