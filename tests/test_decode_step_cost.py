"""benchmarks/decode_step_cost.py: the executor's padded decode step (forward, sampling, the
tokens fed to the step run ahead) hands MLX no primitive the bare model loop does not have (issue
35's bench-decode gate holds the executor to the bare loop), and the benchmark reports CPU per step
with the load average."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

from tests.cli_calls import last_json

BENCH = Path(__file__).resolve().parents[1] / "benchmarks" / "decode_step_cost.py"


def test_executor_decode_step_has_the_bare_loops_graph(monkeypatch, capsys):
    spec = importlib.util.spec_from_file_location("decode_step_cost", BENCH)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    monkeypatch.setattr(sys, "argv", ["decode_step_cost.py", "--model", "tiny", "--batch", "1,4",
                                      "--steps", "1", "--windows", "1", "--modes", "bare,executor"])
    bench.main()
    doc = last_json(capsys.readouterr().out)
    for row in doc["rows"]:
        assert row["executor_extra_ops"] == {}, row["batch"]
        assert row["executor"]["graph_ops"] == row["bare"]["graph_ops"] > 0
        assert row["executor"]["process_cpu_ms"] >= row["executor"]["host_cpu_ms"] > 0
        assert "loadavg_1m" in row
    assert doc["env"]["model"] == "tiny"
