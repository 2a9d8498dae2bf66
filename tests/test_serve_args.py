"""`batchsim serve`'s flags as `run` takes them: --kv-bits stores quantized KV as a real run does,
and the KV budget it prints is the text `run`'s header gives for the same session."""

from __future__ import annotations

import argparse
import dataclasses
import io

import pytest
from batchsim.configs import ConfigError
from batchsim.scripts import run_view, serve_cmd
from batchsim.server.engine.runner import run_workload
from batchsim.server.engine.session import open_session
from batchsim.server.models.spec import zoo_spec
from batchsim.workloads.lengths import parse_length
from batchsim.workloads.spec import WorkloadSpec
from rich.console import Console

from tests.sim_records import sim_config


def _serve_args(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    serve_cmd.add_parser(parser)
    return parser.parse_args(argv)


def test_serve_kv_bits_stores_quantized_kv(batchsim_home):
    cfg = serve_cmd._config(_serve_args("--model", "smollm2-135m", "--kv-bits", "8",
                                        "--max-num-seqs", "4"))
    assert cfg.kv_bits == 8 and cfg.executor == "mlx"
    session = open_session(cfg)
    spec = zoo_spec("smollm2-135m")
    assert session.executor.kv_bits == 8
    assert session.kv_bytes_per_token == spec.kv_bytes_per_token(session.dtype, 8) \
        < spec.kv_bytes_per_token(session.dtype)
    assert ", KV 8-bit)" in serve_cmd.opened_line(session, "smollm2-135m", 1)
    work = WorkloadSpec(name="kv8", num_prompts=4, request_rate=float("inf"),
                        input_len=parse_length("uniform:20:60"),
                        output_len=parse_length("uniform:3:6"), seed=3)
    steps = run_workload(session, work, out_dir=None, label="kv8").steps
    # What the executor's caches hold is the 8-bit account, byte for byte, on every step.
    assert max(st.kv_bytes for st in steps) > 0
    assert all(st.kv_bytes_measured == st.kv_bytes for st in steps)


def test_serve_kv_bits_has_run_checks():
    with pytest.raises(SystemExit):  # argparse: not a width MLX quantizes
        _serve_args("--kv-bits", "3")
    assert _serve_args().kv_bits is None
    with pytest.raises(ConfigError, match="multiple of 64"):  # tiny's 16-wide heads
        open_session(serve_cmd._config(_serve_args("--model", "tiny", "--kv-bits", "4")))


def test_serve_and_run_print_one_kv_budget(monkeypatch):
    buf = io.StringIO()
    monkeypatch.setattr(run_view, "err", Console(file=buf, width=400, color_system=None))
    session = open_session(dataclasses.replace(sim_config(n=2), memory_gb=12.0))
    run_view.ConsoleView(progress=False).opened(session)
    run_budget = buf.getvalue().split("KV budget ", 1)[1].split(" (")[0]
    served = serve_cmd.opened_line(session, "m", 1).split("KV budget ", 1)[1].split(" (")[0]
    assert served == run_budget  # serve said 11.353 GiB, run 11.35 GiB