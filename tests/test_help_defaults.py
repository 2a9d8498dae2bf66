"""Every `[default: X]` a command's --help shows is the value it uses when the flag is left out
(the config dataclasses are their one source), and a YAML config then flags (moved from
test_cli.py)."""

from __future__ import annotations

# Flag defaults: the config dataclasses are their one source. Every `[default: X]` a command's
# --help shows must be the value that command really uses when the flag is left out.

def _parser(command: str):
    from batchsim.scripts.cli import build_parser

    sub = next(a for a in build_parser()._actions if a.dest == "command")
    return sub.choices[command]


def _shown_defaults(parser) -> dict[str, str]:
    """dest -> X of the `[default: X]` in that flag's rendered help."""
    formatter = parser._get_formatter()
    shown = {}
    for action in parser._actions:
        text = " ".join(formatter._expand_help(action).split()) if action.help is not None else ""
        if "[default: " in text:
            shown[action.dest] = text.rsplit("[default: ", 1)[1].rstrip("]")
    return shown


def _fields(obj) -> dict:
    import dataclasses

    return {f.name: getattr(obj, f.name) for f in dataclasses.fields(obj)}


def _check_shown(parser, used: dict, required: set[str]) -> None:
    """Each shown default equals the value used (from `used`, else the parser's own default); a
    flag with a parser default (not unset) has that very value."""
    from batchsim.scripts.common import show_default

    shown = _shown_defaults(parser)
    assert required <= set(shown), sorted(required - set(shown))
    defaults = {a.dest: a.default for a in parser._actions}
    for dest, text in shown.items():
        value = used[dest] if dest in used else defaults[dest]
        assert text == show_default(value), dest
        if dest in used and defaults[dest] is not None:
            assert defaults[dest] == used[dest], dest


def _run_values(cfg) -> dict:
    from batchsim.workloads.spec import TraceSpec

    return {**_fields(TraceSpec(path="t.csv")), **_fields(cfg.workload), **_fields(cfg.scheduler),
            **_fields(cfg), "workload": cfg.workload.name}


def test_run_and_serve_help_show_the_config_defaults():
    from batchsim.scheduler.config import SchedulerConfig, SchedulerSettings
    from batchsim.scripts import run_cmd, serve_cmd
    from batchsim.server.engine.run_config import RunConfig
    from batchsim.server.http.options import ServeOptions

    limits = SchedulerSettings()
    full = SchedulerConfig(kv_budget_bytes=1, kv_bytes_per_token=1, max_model_len=1)
    assert {k: getattr(full, k) for k in _fields(limits)} == _fields(limits)
    run = _parser("run")
    cfg = run_cmd.config_from_args(run.parse_args([]))
    assert cfg == RunConfig() and cfg.scheduler == limits  # no flags: exactly the dataclasses
    _check_shown(run, _run_values(cfg), {"model", "dtype", "executor", "max_num_seqs", "policy",
                                         "max_num_batched_tokens", "prefill_step_size",
                                         "num_prompts", "input_len", "seed", "time_scale",
                                         "ignore_eos", "percentiles", "workload"})
    assert _shown_defaults(run)["max_num_seqs"] == str(limits.max_num_seqs) == "32"
    serve = _parser("serve")
    args = serve.parse_args([])
    assert serve_cmd._config(args) == RunConfig()
    options = _fields(ServeOptions(served_model_name="--model"))  # its help: [default: --model]
    _check_shown(serve, {**_fields(cfg.scheduler), **_fields(cfg), **options},
                 {"max_num_seqs", "max_queue", "max_body_bytes", "drain_timeout_s", "port"})


def test_compare_sweep_and_bench_help_show_the_config_defaults():
    from batchsim.scripts import compare
    from batchsim.server.engine.run_config import RunConfig
    from batchsim.server.perf.devices import LOCAL_NAME

    parser = _parser("compare")
    batch1, batched = compare.configs_from_args(parser.parse_args([]))
    assert batched.workload == compare.default_workload() and batched.workload.num_prompts == 20
    assert batch1.scheduler.max_num_seqs == 1
    _check_shown(parser, {**_run_values(batched), "batch": batched.scheduler.max_num_seqs},
                 {"batch", "num_prompts", "output_len", "request_rate", "workload"})
    run_defaults = _fields(RunConfig())
    from batchsim.scripts.sweep_workload import PROMPT_LEN  # the workload flags: as in run

    workload = {k: v for k, v in _run_values(RunConfig()).items()
                if k not in _fields(RunConfig().scheduler)}
    _check_shown(_parser("sweep"), {**workload, "prompt_len": PROMPT_LEN},
                 {"seed", "model", "prompt_len", "num_prompts"})
    from batchsim.scheduler.config import SchedulerSettings  # its speculative decoding flags

    _check_shown(_parser("bench-decode"), {**run_defaults, **_fields(SchedulerSettings())},
                 {"model", "dtype", "spec_tokens"})
    for command, dest in (("calibrate", "name"), ("validate", "device_profile")):
        parser = _parser(command)
        _check_shown(parser, {"dtype": RunConfig().dtype}, {"dtype"})
        # validate's unset profile is picked as run picks one, 'local' first (its help says so)
        assert parser.get_default(dest) == (None if command == "validate" else LOCAL_NAME)
        assert repr(LOCAL_NAME) in parser._option_string_actions[f"--{dest.replace('_', '-')}"
                                                                 ].help or command == "calibrate"


def test_a_yaml_config_then_flags(tmp_path):
    """Flags override the YAML; what no flag sets keeps the YAML's value, else the default."""
    from batchsim.scheduler.config import SchedulerSettings
    from batchsim.scripts import run_cmd

    path = tmp_path / "cfg.yaml"
    path.write_text("model: tiny\nscheduler: {max_num_seqs: 4, policy: prefill-first}\n"
                    "percentiles: [50, 99]\nworkload: {num_prompts: 7, request_rate: 2.0}\n")
    parser = _parser("run")
    cfg = run_cmd.config_from_args(parser.parse_args([str(path), "--max-num-seqs", "8",
                                                      "--seed", "3", "--no-ignore-eos"]))
    assert cfg.scheduler == SchedulerSettings(max_num_seqs=8, policy="prefill-first")
    assert (cfg.model, cfg.percentiles, cfg.ignore_eos) == ("tiny", (50.0, 99.0), False)
    w = cfg.workload
    assert (w.num_prompts, w.request_rate, w.seed, w.name) == (7, 2.0, 3, "cfg")
    again = run_cmd.config_from_args(parser.parse_args([str(path), "--percentiles", "90",
                                                        "--policy", "decode-first"]))
    assert again.percentiles == (90.0,) and again.scheduler.policy == "decode-first"
    assert again.scheduler.max_num_seqs == 4 and again.ignore_eos is True
