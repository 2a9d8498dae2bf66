"""The cost of encoding a run's records as RecordStream writes them (RecordWriter.write_batch:
steps a batch at a time, each request's token-times text, request lines), reproducibly (review
r4 item 9: c42be83's callgrind figures came from a script outside the repository). It reads a run
directory's steps.jsonl and requests.jsonl back into records, replays them in flushes of
--steps-a-flush steps (each request after its last token's step, in file order), checks the text it
makes is the files' bytes, and prints the best wall time of --repeat, or with --instructions the
instructions of the encoding alone under valgrind's callgrind (deterministic):

    batchsim run --executor sim --device-profile "M2 Ultra" --quantize 4 --model llama-3.1-8b \\
        --request-rate 5 --num-prompts 18000 --seed 3 --no-timeline --out /tmp/hour
    python benchmarks/encode_records.py /tmp/hour/<run> --instructions
"""

from __future__ import annotations

import argparse
import io
import json
import operator
import os
import time
from pathlib import Path

from batchsim.server.results.json_lines import step_rows_of
from batchsim.server.results.record_writer import REQUESTS, STEPS, RecordWriter
from batchsim.server.results.records import RequestRecord, StepRecord
from batchsim.server.results.run_files import WRITER_FLUSH_EVERY_S

# A simulated run's steps per second of wall time: the simulated hour of the docstring made its
# 25,696 steps in 1.03-1.86 s of loop wall time (summary wall_s; this Linux x86_64 2-core machine,
# load 3.9-4.2, 2026-12-05). A writer process is sent a batch every WRITER_FLUSH_EVERY_S.
SIM_STEPS_PER_S = 20_000
STEPS_A_FLUSH = round(SIM_STEPS_PER_S * WRITER_FLUSH_EVERY_S)
FILES = (STEPS, REQUESTS)


def load(run_dir: Path) -> tuple[list[StepRecord], list[RequestRecord]]:
    def rows(name: str) -> list[dict]:
        return [json.loads(line) for line in (run_dir / name).read_text().splitlines()]

    return ([StepRecord.from_json(r) for r in rows(STEPS)],
            [RequestRecord.from_json(r) for r in rows(REQUESTS)])


def _runs(indices: list[int]) -> list[list[int]]:
    """[first, end) runs of consecutive step indices."""
    runs: list[list[int]] = []
    for i in indices:
        if runs and runs[-1][1] == i:
            runs[-1][1] += 1
        else:
            runs.append([i, i + 1])
    return runs


def replay_inputs(steps: list[StepRecord], requests: list[RequestRecord]) -> tuple:
    """(every step end time in order, each request's token runs over them, each step's number
    of end times: the recorder's step_end_s as each step extends it)."""
    ends = sorted({t for r in requests for t in r.token_times_s} | {s.end_s for s in steps})
    index = {t: i for i, t in enumerate(ends)}
    runs = [_runs([index[t] for t in r.token_times_s]) for r in requests]
    upto = [index[s.end_s] + 1 for s in steps]
    return ends, runs, upto


def encode(steps, requests, ends, runs, upto, steps_a_flush: int) -> tuple[str, str]:
    """steps.jsonl's and requests.jsonl's text, flush by flush, as RecordStream makes it: each
    flush's step rows and the requests whose token runs its ends cover through
    RecordWriter.write_batch, into files in memory."""
    files = {name: io.BytesIO() for name in FILES}
    writer, grown, next_request = RecordWriter(Path("."), files), [], 0
    writer.follow_ends(grown)
    for at in range(0, len(steps), steps_a_flush):
        batch = steps[at:at + steps_a_flush]
        grown.extend(ends[len(grown):upto[at + len(batch) - 1]])
        first = next_request
        while next_request < len(requests) and all(
                b <= len(grown) for _, b in runs[next_request]):
            next_request += 1
        writer.write_batch(step_rows_of(batch), list(zip(requests[first:next_request],
                                                         runs[first:next_request])))
    grown.extend(ends[len(grown):])
    writer.write_batch([], list(zip(requests[next_request:], runs[next_request:])))
    if writer.error is not None:
        raise SystemExit(f"encode_records: {writer.error}")
    return tuple(files[name].getvalue().decode() for name in FILES)


def instructions(run_dir: Path, steps_a_flush: int) -> int:
    """This file under callgrind, counting only inside operator.call (the encoding)."""
    from sim_speed import callgrind  # imports the engine: only here

    argv = [__file__, str(run_dir), "--steps-a-flush", str(steps_a_flush)]
    env = {**os.environ, "PYTHONHASHSEED": "0"}  # str hashes move dicts' probes: counts too
    return callgrind(["_operator_call"], argv, "the callgrind run", env)[0]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("run_dir", type=Path, help="a run directory (steps.jsonl, requests.jsonl)")
    p.add_argument("--steps-a-flush", type=int, default=STEPS_A_FLUSH)
    p.add_argument("--repeat", type=int, default=1, help="encodings timed; the fastest is kept")
    p.add_argument("--instructions", action="store_true", help="callgrind's count instead")
    args = p.parse_args()
    if args.steps_a_flush < 1:
        p.error("--steps-a-flush must be at least 1")
    if not (args.run_dir / STEPS).is_file():
        p.error(f"{args.run_dir}: no {STEPS} (give a run directory, not its parent)")
    if args.instructions:  # the run is parsed in callgrind's child, not here as well
        ir = instructions(args.run_dir, args.steps_a_flush)
        num_steps, num_requests = ((args.run_dir / n).read_bytes().count(b"\n") for n in FILES)
        print(f"{num_steps} steps, {num_requests} requests: {ir:,} instructions (callgrind)")
        return
    steps, requests = load(args.run_dir)
    inputs = replay_inputs(steps, requests)
    best_s = float("inf")
    for _ in range(max(1, args.repeat)):
        t0 = time.perf_counter()
        made = operator.call(encode, steps, requests, *inputs, args.steps_a_flush)
        best_s = min(best_s, time.perf_counter() - t0)
    for text, name in zip(made, FILES):
        if text != (args.run_dir / name).read_text():
            raise SystemExit(f"encode_records: the encoded {name} differs from the file")
    print(f"{len(steps)} steps, {len(requests)} requests: {best_s:.3f} s (best of "
          f"{max(1, args.repeat)}), the same bytes as the files")


if __name__ == "__main__":
    main()
