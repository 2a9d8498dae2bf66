"""benchmarks/encode_records.py (review r4 item 9: c42be83's encoding figures came from a script
outside the repository) replays a run directory's records through RecordWriter.write_batch (the
writer's own code, not a copy of it), flush by flush, and makes the files' bytes again: preempted
requests (several token runs) and rejected ones (none) included."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
from batchsim.scripts.cli import main
from batchsim.server.results.record_writer import RecordWriter

ROOT = Path(__file__).resolve().parents[1]
BENCH = ROOT / "benchmarks" / "encode_records.py"


@pytest.mark.parametrize("max_input", [6000, 20000])  # 3 preemptions; 16 refusals
def test_a_replayed_run_encodes_to_its_files(max_input, tmp_path, capsys, monkeypatch):
    rc = main(["run", "--executor", "sim", "--model", "llama-3.2-1b", "--quantize", "4",
               "--device-profile", "M2 Max", "--memory-gb", "1.1", "--input-len",
               f"uniform:16:{max_input}", "--output-len", "uniform:1:160", "--num-prompts", "80",
               "--request-rate", "inf", "--seed", "1", "--no-progress", "--no-timeline",
               "--out", str(tmp_path)])
    assert rc == 0
    capsys.readouterr()
    run_dir = next(p for p in tmp_path.iterdir() if p.is_dir())
    spec = importlib.util.spec_from_file_location("encode_records", BENCH)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    steps, requests = bench.load(run_dir)
    inputs = bench.replay_inputs(steps, requests)
    many = {len(runs) for runs in inputs[1]}
    assert (max(many) > 1) if max_input == 6000 else (0 in many)  # preempted; refused
    batches = []
    write_batch = RecordWriter.write_batch
    monkeypatch.setattr(RecordWriter, "write_batch", lambda writer, rows, entries: (
        batches.append(len(rows)), write_batch(writer, rows, entries))[1])
    for steps_a_flush in (1, 7, 10**6):
        batches.clear()
        made = bench.encode(steps, requests, *inputs, steps_a_flush)
        assert made == ((run_dir / "steps.jsonl").read_text(),
                        (run_dir / "requests.jsonl").read_text())
        assert sum(batches) == len(steps)  # every step through the writer's own batching


def test_instructions_mode_leaves_the_parsing_to_callgrinds_child(tmp_path, monkeypatch, capsys):
    """--instructions parsed the run here too (only to print its counts) before callgrind's child
    parsed it again; the counts are the files' lines."""
    spec = importlib.util.spec_from_file_location("encode_records", BENCH)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    (tmp_path / "steps.jsonl").write_text("{}\n" * 3)
    (tmp_path / "requests.jsonl").write_text("{}\n" * 2)

    def parsed(run_dir):
        raise AssertionError("the run was parsed outside callgrind")

    monkeypatch.setattr(bench, "load", parsed)
    monkeypatch.setattr(bench, "instructions", lambda run_dir, steps_a_flush: 1234)
    monkeypatch.setattr("sys.argv", ["encode_records.py", str(tmp_path), "--instructions"])
    bench.main()
    assert capsys.readouterr().out == "3 steps, 2 requests: 1,234 instructions (callgrind)\n"
