"""requests.jsonl streamed in arrival order (issue 37: the simulated hour rewrote its 28 MB at the
end): a record that finishes before an earlier arrival has left is held until that one leaves,
never longer than a flush period (what a killed run keeps stays within FLUSH_EVERY_S); held longer,
records go out in completion order and close() rewrites the file in arrival order as before."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest
from batchsim.server.engine.runner import run_workload
from batchsim.server.engine.session import open_session
from batchsim.server.results import run_files
from batchsim.server.results.json_text import dumps

from tests.sim_records import request_record, sim_config, step_record


class _Clock:
    """run_files' time module, its monotonic clock set by the test."""

    def __init__(self) -> None:
        self.now_s = 0.0

    def monotonic(self) -> float:
        return self.now_s

    perf_counter = staticmethod(time.perf_counter)


@pytest.fixture
def clock(monkeypatch) -> _Clock:
    fake = _Clock()
    monkeypatch.setattr(run_files, "time", fake)
    return fake


def _ids(path: Path) -> list[int]:
    return [json.loads(x)["request_id"] for x in path.read_text().splitlines()]


def _step_at(stream: run_files.RecordStream, clock: _Clock, now_s: float) -> None:
    clock.now_s = now_s
    stream.add_step(step_record(0, 0.0, running=1, waiting=0))


def test_a_finished_sim_run_streams_arrival_order_and_is_not_rewritten(tmp_path, monkeypatch):
    rewrites = []
    write = run_files.write_atomically

    def noted(path, *args):
        rewrites.append(path.name)
        return write(path, *args)

    monkeypatch.setattr(run_files, "write_atomically", noted)
    session = open_session(sim_config())
    outcome = run_workload(session, session.config.workload, out_dir=tmp_path, label="o",
                           timeline=False)
    finish_order = sorted(outcome.requests, key=lambda r: r.finished_s)
    assert [r.request_id for r in finish_order] != [r.request_id for r in outcome.requests]
    text = (outcome.run_dir / run_files.REQUESTS).read_text()
    assert text == "".join(dumps(r.to_json()) + "\n" for r in outcome.requests)
    assert run_files.REQUESTS not in rewrites


def test_a_held_record_goes_out_in_order_once_the_earlier_arrival_leaves(tmp_path, clock):
    stream = run_files.RecordStream(tmp_path)
    stream.arrivals.extend([1, 2, 3])
    records = {i: request_record(i, 0.0, 0.5) for i in (1, 2, 3)}
    clock.now_s = 0.5 * run_files.FLUSH_EVERY_S
    stream.add_request(records[3])  # 1 and 2 still in flight: held
    stream.add_request(records[2])
    _step_at(stream, clock, run_files.FLUSH_EVERY_S)  # a flush: nothing in order to write yet
    assert _ids(tmp_path / run_files.REQUESTS) == []
    stream.add_request(records[1])
    assert _ids(tmp_path / run_files.REQUESTS) == []  # until the next flush
    _step_at(stream, clock, 1.5 * run_files.FLUSH_EVERY_S)  # due: a period since 3 finished
    assert _ids(tmp_path / run_files.REQUESTS) == [1, 2, 3]
    inode = (tmp_path / run_files.REQUESTS).stat().st_ino
    stream.close([records[1], records[2], records[3]])
    assert (tmp_path / run_files.REQUESTS).stat().st_ino == inode  # not rewritten


def test_a_record_is_held_no_longer_than_a_flush_period(tmp_path, clock):
    period_s = run_files.FLUSH_EVERY_S
    stream = run_files.RecordStream(tmp_path)
    stream.arrivals.extend([1, 2, 3])
    records = {i: request_record(i, 0.0, 0.5) for i in (1, 2, 3)}
    clock.now_s = 0.8 * period_s
    stream.add_request(records[2])  # held: 1 has not left
    _step_at(stream, clock, period_s)  # the periodic flush keeps it (held 0.2 periods)
    assert _ids(tmp_path / run_files.REQUESTS) == []
    _step_at(stream, clock, 1.7 * period_s)  # not due: the next flush is when its period ends
    assert _ids(tmp_path / run_files.REQUESTS) == []
    _step_at(stream, clock, 1.8 * period_s)
    assert _ids(tmp_path / run_files.REQUESTS) == [2]  # a period after it finished: written
    stream.add_request(records[1])  # from now on, completion order
    stream.add_request(records[3])
    stream.close_unfinished()
    assert _ids(tmp_path / run_files.REQUESTS) == [2, 1, 3]  # what a killed run keeps
    stream.close([records[1], records[2], records[3]])
    assert _ids(tmp_path / run_files.REQUESTS) == [1, 2, 3]  # a finished run: arrival order


def test_the_last_flush_writes_the_held_records(tmp_path, clock):
    stream = run_files.RecordStream(tmp_path)
    stream.arrivals.extend([1, 2])
    stream.add_request(request_record(2, 0.0, 0.5))  # 1 never leaves (the run failed)
    stream.close_unfinished()
    assert _ids(tmp_path / run_files.REQUESTS) == [2]


def test_a_flusher_between_steps_flushes_when_due_and_says_when_next(tmp_path, clock):
    period_s = run_files.FLUSH_EVERY_S
    stream = run_files.RecordStream(tmp_path)
    stream.arrivals.extend([1, 2])
    clock.now_s = 0.6 * period_s
    stream.add_request(request_record(2, 0.0, 0.5))
    assert stream.flush_if_due() == pytest.approx(0.4 * period_s)  # not due: nothing written
    clock.now_s = period_s
    assert stream.flush_if_due() == pytest.approx(0.6 * period_s)  # due; 2 is due then
    assert _ids(tmp_path / run_files.REQUESTS) == []
    clock.now_s = 1.6 * period_s
    stream.flush_if_due()
    assert _ids(tmp_path / run_files.REQUESTS) == [2]


def test_records_added_while_a_flush_writes_go_out_with_the_next(tmp_path):
    """r1 finding 1: a watchdog thread's flush writes (a syscall: the GIL is free) while the loop
    adds a record; the record must neither be counted as written nor dropped (deterministic: the
    add happens inside the write)."""
    stream = run_files.RecordStream(tmp_path)
    records = [request_record(i, float(i), float(i)) for i in range(4)]
    write, once = stream._write, {run_files.STEPS, run_files.REQUESTS}

    def adding_while_writing(name, lines):
        done = write(name, lines)
        if name in once:
            once.discard(name)
            if name == run_files.STEPS:
                stream.add_step(step_record(1, 1.0, running=1, waiting=0))
            else:
                stream.add_request(records[1])
        return done

    stream._write = adding_while_writing
    stream.add_step(step_record(0, 0.0, running=1, waiting=0))
    stream.add_request(records[0])
    stream.flush()
    stream._write = write
    stream.add_request(records[2])
    stream.add_request(records[3])
    stream.close(records)
    assert _ids(tmp_path / run_files.REQUESTS) == [0, 1, 2, 3]
    assert len((tmp_path / run_files.STEPS).read_text().splitlines()) == 2


def test_a_closed_stream_has_no_flush_due(tmp_path, clock):
    """r1 finding 5: once closed (a watchdog's abandon), flush_if_due must not answer 0 s, or the
    runner's flusher spins on sleep(0) and takes the GIL from the thread keeping the records."""
    stream = run_files.RecordStream(tmp_path)
    stream.close_unfinished()
    clock.now_s = 10 * run_files.FLUSH_EVERY_S
    assert stream.flush_if_due() == float("inf")
