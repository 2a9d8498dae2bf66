"""benchmarks/sim_speed.py keeps issue 37's contract: its last stdout line is one JSON document with
sim_speedup and wall_s per request count (simulated seconds over the engine's wall seconds)."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

from tests.cli_calls import last_json

BENCH = Path(__file__).resolve().parents[1] / "benchmarks" / "sim_speed.py"


def test_sim_speed_prints_speedup_and_wall_time_per_request_count(monkeypatch, capsys):
    spec = importlib.util.spec_from_file_location("sim_speed", BENCH)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    monkeypatch.setattr(sys, "argv", ["sim_speed.py", "--counts", "20,40"])
    bench.main()
    doc = last_json(capsys.readouterr().out)
    for count in ("20", "40"):
        assert doc["wall_s"][count] > 0 and doc["cpu_s"][count] > 0
        assert doc["total_s"][count] >= doc["wall_s"][count]
        assert doc["sim_speedup"][count] > 1  # 40 arrivals at 5/s span ~8 simulated seconds
    assert doc["env"]["executor"] == "sim" and "loadavg_1m" in doc


def test_callgrind_totals_reads_the_instruction_count():
    spec = importlib.util.spec_from_file_location("sim_speed", BENCH)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    text = "version: 1\nevents: Ir\nsummary: 1152354531\nfn=(1) main\n0 5\ntotals: 1152354531\n"
    assert bench.callgrind_totals(text) == 1152354531
    assert bench.callgrind_totals("events: Ir\n") == 0  # nothing counted: the caller says so


def test_loop_only_counts_the_loop_less_its_writing(monkeypatch, capsys):
    """callgrind toggles counting on operator.call (the loop) and on a context's run (the
    writings inside it, which wall_s leaves out): each must run through its door."""
    spec = importlib.util.spec_from_file_location("sim_speed", BENCH)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    calls, context = [], bench.contextvars.copy_context()
    real_call = bench.operator.call
    monkeypatch.setattr(bench.operator, "call", lambda f, *a: calls.append(f) or real_call(f, *a))
    for cls, name in ((bench.VirtualRun, "_loop"), (bench.RecordStream, "flush"),
                      (bench.RunRecorder, "on_finish")):
        monkeypatch.setattr(cls, name, getattr(cls, name))  # restored after
    monkeypatch.setattr(bench.contextvars, "copy_context", lambda: _Spy(calls, context))
    bench._loop_only(20)
    names = [f.__name__ for f in calls]
    assert names[0] == "_loop" and names.count("on_finish") == 20
    assert last_json(capsys.readouterr().out)["plans"] > 0


class _Spy:
    """A context whose run records what it ran."""

    def __init__(self, calls: list, context) -> None:
        self.calls, self.context = calls, context

    def run(self, f, *args):
        self.calls.append(f)
        return self.context.run(f, *args)
