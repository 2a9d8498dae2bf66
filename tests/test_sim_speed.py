"""benchmarks/sim_speed.py keeps issue 37's contract: its last stdout line is one JSON document with
sim_speedup and wall_s per request count (simulated seconds over the engine's wall seconds)."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

BENCH = Path(__file__).resolve().parents[1] / "benchmarks" / "sim_speed.py"


def test_sim_speed_prints_speedup_and_wall_time_per_request_count(monkeypatch, capsys):
    spec = importlib.util.spec_from_file_location("sim_speed", BENCH)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    monkeypatch.setattr(sys, "argv", ["sim_speed.py", "--counts", "20,40"])
    bench.main()
    doc = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    for count in ("20", "40"):
        assert doc["wall_s"][count] > 0 and doc["cpu_s"][count] > 0
        assert doc["total_s"][count] >= doc["wall_s"][count]
        assert doc["sim_speedup"][count] > 1  # 40 arrivals at 5/s span ~8 simulated seconds
    assert doc["env"]["executor"] == "sim" and "loadavg_1m" in doc
