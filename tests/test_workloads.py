"""Workloads: arrival processes, lengths, trace parsing, strict YAML, and the asyncio driver on a
real loop and on a virtual-clock loop."""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
import math
import selectors
import time

import numpy as np
import pytest
import yaml
from batchsim.configs import CONFIG_DIR, ConfigError
from batchsim.workloads.driver import LoopThrottler, drive
from batchsim.workloads.lengths import LengthSpec, parse_length, trace_lengths
from batchsim.workloads.requests import RequestSpec, arrival_times, build_requests, trace_requests
from batchsim.workloads.spec import (
    TraceSpec,
    WorkloadSpec,
    builtin_workload,
    builtin_workload_names,
    load_workload,
    resolve_workload,
    with_overrides,
)
from batchsim.workloads.traces import parse_azure_time, read_trace

TRACES = CONFIG_DIR / "traces"


# --- a loop whose clock only moves when it would otherwise block ---------------------------------

class _VirtualSelector(selectors.DefaultSelector):
    def __init__(self) -> None:
        super().__init__()
        self.now_s = 0.0

    def select(self, timeout: float | None = None):  # type: ignore[override]
        if timeout is None:
            raise RuntimeError("virtual loop would block forever: nothing scheduled")
        self.now_s += timeout
        return []


class VirtualLoop(asyncio.SelectorEventLoop):
    def __init__(self) -> None:
        super().__init__(_VirtualSelector())

    def time(self) -> float:
        return self._selector.now_s  # type: ignore[attr-defined]


def run_virtual(coro):
    loop = VirtualLoop()
    try:
        return loop.run_until_complete(coro)
    finally:
        loop.close()


def gaps_of(spec: WorkloadSpec) -> np.ndarray:
    return np.diff([r.arrival_s for r in build_requests(spec)])


# --- arrival processes ---------------------------------------------------------------------------

def test_same_seed_same_requests_different_seed_different():
    spec = WorkloadSpec(num_prompts=50, request_rate=3.0, seed=7)
    assert build_requests(spec) == build_requests(spec)
    other = build_requests(with_overrides(spec, seed=8))
    assert [r.arrival_s for r in other] != [r.arrival_s for r in build_requests(spec)]
    assert [r.prompt_len for r in other] != [r.prompt_len for r in build_requests(spec)]


def test_lengths_do_not_depend_on_arrival_process():
    spec = WorkloadSpec(num_prompts=30, seed=3)
    a = build_requests(spec)
    b = build_requests(with_overrides(spec, arrival="gamma", burstiness=0.5))
    assert [r.prompt_len for r in a] == [r.prompt_len for r in b]
    assert [r.arrival_s for r in a] != [r.arrival_s for r in b]


def test_requests_sorted_indexed_and_in_bounds():
    spec = WorkloadSpec(num_prompts=200, arrival="gamma", burstiness=0.2, request_rate=5.0,
                        input_len=LengthSpec("uniform", min=10, max=20))
    reqs = build_requests(spec)
    assert [r.index for r in reqs] == list(range(200))
    assert reqs[0].arrival_s == 0.0
    assert all(b.arrival_s >= a.arrival_s for a, b in itertools.pairwise(reqs))
    assert all(10 <= r.prompt_len <= 20 and 32 <= r.output_len <= 128 for r in reqs)


def test_poisson_mean_gap_and_cv():
    gaps = gaps_of(WorkloadSpec(num_prompts=4001, request_rate=4.0, seed=1))
    assert gaps.mean() == pytest.approx(0.25, rel=1e-9)  # vLLM-style rescaling: exact span
    assert gaps.std() / gaps.mean() == pytest.approx(1.0, abs=0.08)
    assert gaps.min() >= 0


@pytest.mark.parametrize("burstiness", [0.25, 4.0])
def test_gamma_burstiness_sets_cv2(burstiness):
    spec = WorkloadSpec(num_prompts=5001, arrival="gamma", request_rate=2.0, burstiness=burstiness)
    gaps = gaps_of(spec)
    assert gaps.mean() == pytest.approx(0.5, rel=1e-9)
    cv2 = gaps.var() / gaps.mean() ** 2
    assert cv2 == pytest.approx(1 / burstiness, rel=0.15)


def test_gamma_infinite_burstiness_is_constant():
    spec = WorkloadSpec(num_prompts=20, arrival="gamma", request_rate=4.0, burstiness=math.inf)
    gaps = gaps_of(spec)
    np.testing.assert_allclose(gaps, 0.25)


def test_constant_spacing_exact():
    reqs = build_requests(WorkloadSpec(num_prompts=9, arrival="constant", request_rate=4.0))
    assert [r.arrival_s for r in reqs] == [i * 0.25 for i in range(9)]


@pytest.mark.parametrize("arrival", ["poisson", "gamma", "constant"])
def test_infinite_rate_all_at_once(arrival):
    reqs = build_requests(WorkloadSpec(num_prompts=16, arrival=arrival, request_rate=math.inf))
    assert all(r.arrival_s == 0.0 for r in reqs)


def test_closed_loop_arrivals_zero():
    spec = WorkloadSpec(num_prompts=5, arrival="closed", concurrency=2)
    assert all(r.arrival_s == 0.0 for r in build_requests(spec))


def test_ramp_rate_rises():
    spec = WorkloadSpec(num_prompts=3000, arrival="ramp", request_rate=1.0, ramp_end_rate=10.0)
    gaps = gaps_of(spec)
    first, last = gaps[:300].mean(), gaps[-300:].mean()
    assert first == pytest.approx(1 / 1.45, rel=0.15)  # rates 1.0 .. 1.9 over the first tenth
    assert last == pytest.approx(1 / 9.55, rel=0.15)
    # deterministic with infinite burstiness: gap i is exactly 1 / rate_i
    steady = with_overrides(spec, num_prompts=4, burstiness=math.inf)
    np.testing.assert_allclose(gaps_of(steady), [1 / 4.0, 1 / 7.0, 1 / 10.0])


def test_arrival_times_helper_matches_count():
    rng = np.random.default_rng(0)
    times = arrival_times(WorkloadSpec(request_rate=2.0), 10, rng)
    assert times.shape == (10,) and times[0] == 0.0 and times[-1] == pytest.approx(4.5)


# --- validation and YAML -------------------------------------------------------------------------

@pytest.mark.parametrize("kwargs, key", [
    ({"num_prompts": 0}, "num_prompts"),
    ({"request_rate": 0.0}, "request_rate"),
    ({"arrival": "ramp"}, "ramp_end_rate"),
    ({"arrival": "closed"}, "concurrency"),
    ({"arrival": "trace"}, "trace"),
    ({"burstiness": 0.5}, "burstiness"),  # burstiness with poisson: only gamma/ramp use it
    ({"concurrency": 4}, "concurrency"),
    ({"arrival": "closed", "concurrency": 2, "max_concurrency": 1}, "max_concurrency"),
])
def test_invalid_specs_name_the_key(kwargs, key):
    with pytest.raises(ConfigError, match=key):
        WorkloadSpec(**kwargs)


def test_a_yaml_rate_written_1e_3_is_a_number_and_a_far_think_time_is_refused(tmp_path):
    """YAML 1.1 reads `1e-3` (no dot) as a string: it was refused as "expected a number, got
    '1e-3'"; a closed loop thinking 1e308 s passed a float's range and never finished."""
    path = tmp_path / "w.yaml"
    path.write_text("num_prompts: 3\nrequest_rate: 1e-3\nburstiness: 2E+0\narrival: gamma\n")
    spec = resolve_workload(str(path))
    assert (spec.request_rate, spec.burstiness) == (1e-3, 2.0)
    path.write_text("num_prompts: 3\narrival: closed\nconcurrency: 1\nthink_time_s: 1e308\n")
    with pytest.raises(ConfigError, match="think_time_s: must be >= 0 with 2 x think_time_s"):
        resolve_workload(str(path))


def test_with_overrides_ignores_none_and_switches_arrival():
    closed = builtin_workload("closed-loop")
    assert with_overrides(closed, num_prompts=None) == closed
    opened = with_overrides(closed, arrival="poisson", request_rate=3.0)
    assert opened.concurrency is None and opened.request_rate == 3.0
    shorter = with_overrides(closed, input_len="uniform:8:16")
    assert shorter.input_len == LengthSpec("uniform", min=8, max=16)
    with pytest.raises(ConfigError, match="reqest_rate"):
        with_overrides(closed, reqest_rate=2.0)


def test_every_shipped_workload_loads_and_builds():
    names = builtin_workload_names()
    for expected in ("default", "poisson", "bursty", "closed-loop", "ramp", "azure-conv",
                     "mooncake", "burst"):
        assert expected in names
    for name in names:
        spec = builtin_workload(name)
        assert spec.name == name
        reqs = build_requests(spec)
        assert len(reqs) == spec.num_prompts
    # The built-in default is exactly what its YAML says (no hidden defaults override the file).
    default = builtin_workload("default")
    raw = yaml.safe_load((CONFIG_DIR / "workloads" / "default.yaml").read_text())
    assert (default.arrival, default.request_rate, default.num_prompts) == (
        raw["arrival"], raw["request_rate"], raw["num_prompts"])
    assert resolve_workload("bursty") == builtin_workload("bursty")


def test_unknown_builtin_lists_available():
    with pytest.raises(ConfigError, match="available: .*bursty"):
        builtin_workload("nope")


def test_yaml_typo_names_file_key_and_allowed(tmp_path):
    path = tmp_path / "w.yaml"
    path.write_text("arrival: poisson\nrequest_rte: 2\n")
    with pytest.raises(ConfigError) as info:
        load_workload(path)
    msg = str(info.value)
    assert str(path) in msg and "request_rte" in msg and "request_rate" in msg


@pytest.mark.parametrize("body, key", [
    ("num_prompts: many\n", "num_prompts"),
    ("request_rate: fast\n", "request_rate"),
    ("arrival: poison\n", "arrival"),
    ("input_len: {dist: uniform, min: 8, mx: 9}\n", "mx"),
    ("input_len: {dist: uniform, min: 8}\n", "input_len"),  # uniform needs max
    ("arrival: trace\ntrace: {path: x.csv, time_scael: 2}\n", "time_scael"),
    ("arrival: closed\nconcurrency: 0\n", "concurrency"),
])
def test_yaml_wrong_values_rejected(tmp_path, body, key):
    path = tmp_path / "bad.yaml"
    path.write_text(body)
    with pytest.raises(ConfigError) as info:
        load_workload(path)
    assert str(path) in str(info.value) and key in str(info.value)


def test_yaml_inf_rate_and_length_shorthand(tmp_path):
    path = tmp_path / "fast.yaml"
    path.write_text("request_rate: inf\ninput_len: uniform:10:20\noutput_len: 7\n")
    spec = load_workload(path)
    assert spec.name == "fast" and math.isinf(spec.request_rate)
    assert spec.input_len == LengthSpec("uniform", min=10, max=20) and spec.output_len.upper == 7


@pytest.mark.parametrize("text, says", [
    ("-5", "positive 'value'"),
    ("fixed:-1", "positive 'value'"),
    ("uniform:-3:10", "1 <= min <= max"),
    ("uniform:0:10", "1 <= min <= max"),
    ("normal:100:-5", "positive 'std'"),
    ("lognormal:100:-5", "positive 'std'"),
    ("normal:-100:5", "positive 'mean'"),
    ("normal:nan:5", "positive 'mean'"),
    ("zipf:1.5:-2:10", "1 <= min <= max"),
    ("uniform:1:inf", "expected N"),
])
def test_impossible_lengths_are_one_line_errors_naming_the_text(text, says):
    # Negatives were clamped to 1 and normal's negative std reached numpy (a traceback).
    with pytest.raises(ConfigError, match="length") as info:
        parse_length(text)
    assert text in str(info.value) and says in str(info.value)


def test_yaml_negative_std_names_the_file(tmp_path):
    path = tmp_path / "neg.yaml"
    path.write_text("input_len: {dist: normal, mean: 100, std: -5}\n")
    with pytest.raises(ConfigError, match="std") as info:
        load_workload(path)
    assert str(path) in str(info.value)


# --- traces --------------------------------------------------------------------------------------

AZURE_CSV = """TIMESTAMP,ContextTokens,GeneratedTokens
2023-11-16 18:15:46.6805900,374,44
2023-11-16 18:15:50.9951690,396,109
2023-11-16 18:15:51.2224675,2000,5
2023-11-16 18:15:59.0000000,10,0
"""
MOONCAKE_JSONL = """{"timestamp": 1000, "input_length": 6758, "output_length": 500, "hash_ids": [0]}
{"timestamp": 1000, "input_length": 100, "output_length": 3}

{"timestamp": 4500, "input_length": 2290, "output_length": 316, "hash_ids": [2]}
"""


def test_azure_time_handles_seven_digit_fraction():
    a = parse_azure_time("2023-11-16 18:15:46.6805900")
    b = parse_azure_time("2023-11-16 18:15:50.9951699")
    assert b - a == pytest.approx(4.314579, abs=2e-6)


def test_read_azure_relative_times_start_limit(tmp_path):
    path = tmp_path / "t.csv"
    path.write_text(AZURE_CSV.replace("\n", "\r\n"))  # the real file has CRLF line ends
    rows = read_trace(path)
    assert [r.t_s for r in rows] == pytest.approx([0.0, 4.314579, 4.5418775, 12.31941], abs=1e-6)
    lengths = [(r.input_len, r.output_len) for r in rows]
    assert lengths == [(374, 44), (396, 109), (2000, 5), (10, 0)]
    part = read_trace(path, start=1, limit=2)
    assert [r.t_s for r in part] == pytest.approx([0.0, 0.2272985], abs=1e-6)
    assert [r.input_len for r in part] == [396, 2000]


def test_read_mooncake_ms_and_blank_lines(tmp_path):
    path = tmp_path / "t.jsonl"
    path.write_text(MOONCAKE_JSONL)
    rows = read_trace(path)
    assert [(r.t_s, r.input_len, r.output_len) for r in rows] == [
        (0.0, 6758, 500), (0.0, 100, 3), (3.5, 2290, 316)]


def test_trace_requests_scale_and_cap(tmp_path):
    path = tmp_path / "t.csv"
    path.write_text(AZURE_CSV)
    trace = TraceSpec(str(path), time_scale=0.5, input_scale=0.1, output_scale=2.0,
                      max_input_len=100, max_output_len=150)
    reqs = trace_requests(trace, 4)
    expected_s = [0.0, 2.1572895, 2.27093875, 6.159705]
    assert [r.arrival_s for r in reqs] == pytest.approx(expected_s, abs=1e-6)
    assert [r.prompt_len for r in reqs] == [37, 40, 100, 1]  # 2000*0.1 capped; 10*0.1 -> 1 (>= 1)
    assert [r.output_len for r in reqs] == [88, 150, 10, 1]  # 109*2 capped; 0 -> 1
    with pytest.raises(ConfigError, match="only 3 rows"):
        trace_requests(dataclasses.replace(trace, start=1), 4)


def test_trace_errors_name_the_file(tmp_path):
    bad = tmp_path / "bad.csv"
    bad.write_text("TIMESTAMP,Tokens\n2023-11-16 18:15:46.68,3\n")
    with pytest.raises(ConfigError, match="ContextTokens"):
        read_trace(bad)
    with pytest.raises(ConfigError, match="no such file.*shipped"):
        read_trace("missing.csv")
    for there, kind in (("/dev/null", "a character device"), (str(tmp_path), "a directory")):
        with pytest.raises(ConfigError, match=f"is {kind}, not a regular file"):
            read_trace(there)  # it exists: "no such file" said the wrong thing


@pytest.mark.parametrize("row, says", [
    ('{"timestamp": 0, "input_length": 1000000000000, "output_length": 8}',
     "token count must be an integer in \\[0, 2147483647\\]"),  # ran out of memory
    ('{"timestamp": 0, "input_length": -5, "output_length": 8}', "token count"),  # read as 1
    ('{"timestamp": 0, "input_length": true, "output_length": 8}', "token count"),
    ('{"timestamp": 1' + "0" * 400 + ', "input_length": 5, "output_length": 8}',
     "int too large"),  # an OverflowError traceback
    ("[" * 5000 + "]" * 5000, "nested too deeply"),  # a RecursionError traceback
    ('{"timestamp": 0, "input_length": 10.5, "output_length": 8}', "token count"),  # read as 10
    ('{"timestamp": "x", "input_length": 5, "output_length": 8}', "timestamp is a number"),
    ("[1, 2]", "a Mooncake row is a JSON object"),  # 'list indices must be integers ...'
])
def test_a_bad_mooncake_row_is_a_config_error_naming_its_line(tmp_path, row, says):
    path = tmp_path / "t.jsonl"
    path.write_text('{"timestamp": 0, "input_length": 5, "output_length": 8}\n' + row + "\n")
    with pytest.raises(ConfigError, match=f"t.jsonl:2: .*{says}"):
        read_trace(path)


@pytest.mark.parametrize("cells, got", [
    ("10", "None"),  # int(None) said "int() argument must be a string, ... NoneType"
    ("10.5,8", "'10.5'"),  # CSV cells are strings: "invalid literal for int() with base 10"
    ("10,", "''"),
    ("abc,8", "'abc'"),
])
def test_a_bad_azure_token_count_names_its_row(tmp_path, cells, got):
    path = tmp_path / "t.csv"
    path.write_text(f"TIMESTAMP,ContextTokens,GeneratedTokens\n2023-11-16 18:15:46,{cells}\n")
    with pytest.raises(ConfigError, match=f"t.csv:2: a token count .* got {got}$"):
        read_trace(path)


def test_shipped_slices_parse_with_documented_rows():
    azure = read_trace("azure_conv_2023_slice.csv")
    moon = read_trace("mooncake_conversation_slice.jsonl")
    assert len(azure) == 2000 and len(moon) == 2000
    for rows, span_s in ((azure, 424.3), (moon, 669.0)):
        assert rows[0].t_s == 0.0 and rows[-1].t_s == pytest.approx(span_s, abs=0.5)
        assert all(b.t_s >= a.t_s for a, b in itertools.pairwise(rows))
    assert 900 < float(np.median([r.input_len for r in azure])) < 1200
    assert 6000 < float(np.median([r.input_len for r in moon])) < 10000
    total_bytes = sum(p.stat().st_size for p in TRACES.iterdir())
    assert total_bytes < 1_000_000
    assert (TRACES / "SOURCES.md").exists() and (TRACES / "LICENSE.AzurePublicDataset.txt").exists()


def test_trace_lengths_empirical_and_parse_length():
    spec = trace_lengths("azure_conv_2023_slice.csv", "output", limit=100, max_len=200)
    assert spec.dist == "empirical" and len(spec.values) == 100 and spec.upper <= 200
    draws = spec.sample(500, np.random.default_rng(0))
    assert set(draws.tolist()) <= set(spec.values)
    via_cli = parse_length("trace:mooncake_conversation_slice.jsonl:input:1024")
    assert via_cli.upper == 1024 and len(via_cli.values) == 2000


# --- driver on a real event loop -----------------------------------------------------------------

def _reqs(n: int, gap_s: float = 0.0) -> list[RequestSpec]:
    return [RequestSpec(i, i * gap_s, 8, 8) for i in range(n)]


class InFlight:
    """A submit that sleeps `service_s` and records how many were in flight at once."""

    def __init__(self, service_s: float) -> None:
        self.service_s, self.now, self.peak, self.started = service_s, 0, 0, []

    async def __call__(self, req: RequestSpec) -> None:
        self.now += 1
        self.peak = max(self.peak, self.now)
        self.started.append(req.index)
        try:
            await asyncio.sleep(self.service_s)
        finally:
            self.now -= 1


def test_open_loop_issues_in_order_on_time():
    spec = WorkloadSpec(num_prompts=20, arrival="constant", request_rate=200.0)
    reqs = build_requests(spec)
    issued: list[tuple[int, float]] = []
    submit = InFlight(0.001)
    asyncio.run(drive(spec, reqs, submit, on_issue=lambda r, t: issued.append((r.index, t))))
    assert [i for i, _ in issued] == list(range(20)) == submit.started
    lateness = [t - reqs[i].arrival_s for i, t in issued]
    assert min(lateness) > -0.002 and max(lateness) < 0.05


def test_closed_loop_holds_concurrency():
    spec = WorkloadSpec(num_prompts=24, arrival="closed", concurrency=4)
    submit = InFlight(0.005)
    asyncio.run(drive(spec, _reqs(24), submit))
    assert submit.peak == 4 and submit.started == list(range(24))


def test_max_concurrency_caps_in_flight():
    spec = WorkloadSpec(num_prompts=12, request_rate=math.inf, max_concurrency=3)
    submit = InFlight(0.005)
    asyncio.run(drive(spec, _reqs(12), submit))
    assert submit.peak == 3 and submit.started == list(range(12))


def test_max_request_rate_caps_issue_rate():
    spec = WorkloadSpec(num_prompts=10, request_rate=math.inf, max_request_rate=50.0)
    issued: list[float] = []
    start = time.perf_counter()
    asyncio.run(drive(spec, _reqs(10), InFlight(0.0), on_issue=lambda r, t: issued.append(t)))
    assert time.perf_counter() - start >= 0.175
    assert min(np.diff(issued)) >= 0.0199


def test_submit_exception_propagates_and_cancels_the_rest():
    spec = WorkloadSpec(num_prompts=5, request_rate=math.inf)
    cancelled: list[int] = []

    async def submit(req: RequestSpec) -> None:
        if req.index == 2:
            raise RuntimeError("boom")
        try:
            await asyncio.sleep(10)
        except asyncio.CancelledError:
            cancelled.append(req.index)
            raise

    start = time.perf_counter()
    with pytest.raises(RuntimeError, match="boom"):
        asyncio.run(drive(spec, _reqs(5), submit))
    assert time.perf_counter() - start < 2 and sorted(cancelled) == [0, 1, 3, 4]


# --- driver on a virtual clock -------------------------------------------------------------------

def test_virtual_clock_poisson_takes_virtual_time_not_real():
    spec = WorkloadSpec(num_prompts=100, request_rate=1.0, seed=5)
    reqs = build_requests(spec)
    issued: list[float] = []

    async def main() -> float:
        loop = asyncio.get_running_loop()
        t0 = loop.time()
        await drive(spec, reqs, InFlight(0.5), on_issue=lambda r, t: issued.append(t))
        return loop.time() - t0

    start = time.perf_counter()
    virtual_s = run_virtual(main())
    assert time.perf_counter() - start < 1.0
    assert virtual_s == pytest.approx(99.5, abs=1e-6)  # last arrival at 99 s, then 0.5 s of service
    np.testing.assert_allclose(issued, [r.arrival_s for r in reqs], atol=1e-9)


def test_virtual_clock_throttle_fractional_rate():
    spec = WorkloadSpec(num_prompts=6, request_rate=math.inf, max_request_rate=2.5)
    issued: list[float] = []
    run_virtual(drive(spec, _reqs(6), InFlight(0.0), on_issue=lambda r, t: issued.append(t)))
    np.testing.assert_allclose(issued, [0.0, 0.4, 0.8, 1.2, 1.6, 2.0], atol=1e-6)


def test_virtual_clock_closed_loop_think_time():
    spec = WorkloadSpec(num_prompts=6, arrival="closed", concurrency=2, think_time_s=1.0)
    issued: list[float] = []
    run_virtual(drive(spec, _reqs(6), InFlight(2.0), on_issue=lambda r, t: issued.append(t)))
    # two users, each: 2 s of service then 1 s of thought
    np.testing.assert_allclose(issued, [0, 0, 3, 3, 6, 6], atol=1e-6)


def test_virtual_clock_failure_stops_issuing_early():
    spec = WorkloadSpec(num_prompts=50, arrival="constant", request_rate=1.0)
    issued: list[int] = []

    async def submit(req: RequestSpec) -> None:
        await asyncio.sleep(0.5)
        if req.index == 2:
            raise ValueError("bad request")

    with pytest.raises(ValueError, match="bad request"):
        run_virtual(drive(spec, _reqs(50, 1.0), submit,
                          on_issue=lambda r, t: issued.append(r.index)))
    assert issued == [0, 1, 2]  # the failure at 2.5 s stopped the dispatcher before 3 s


def test_a_submit_that_refuses_at_once_stops_issuing():
    """A submit may hand back a future already in flight (the engine's own) or raise while
    issuing; the raise ends the drive there and then."""
    spec = WorkloadSpec(num_prompts=5, arrival="constant", request_rate=1.0)
    issued: list[int] = []

    def submit(req: RequestSpec) -> asyncio.Future:
        if req.index == 2:
            raise ValueError("queue full")
        fut = asyncio.get_running_loop().create_future()
        fut.set_result(req.index)
        return fut

    with pytest.raises(ValueError, match="queue full"):
        run_virtual(drive(spec, _reqs(5, 1.0), submit, on_issue=lambda r,
                          t: issued.append(r.index)))
    assert issued == [0, 1, 2]


def test_cancelling_drive_cancels_in_flight():
    spec = WorkloadSpec(num_prompts=10, arrival="constant", request_rate=1.0)
    submit = InFlight(100.0)

    async def main() -> None:
        task = asyncio.ensure_future(drive(spec, _reqs(10, 1.0), submit))
        await asyncio.sleep(3.5)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    run_virtual(main())
    assert submit.started == [0, 1, 2, 3] and submit.now == 0


def test_loop_throttler_window():
    async def main() -> list[float]:
        loop = asyncio.get_running_loop()
        throttler = LoopThrottler(rate_limit=2, period=1.0)
        times = []
        for _ in range(5):
            async with throttler:
                times.append(loop.time())
        return times

    np.testing.assert_allclose(run_virtual(main()), [0, 0, 1, 1, 2], atol=1e-6)


@pytest.mark.parametrize("name", ["t.jsonl", "t"])  # read as Mooncake, or sniffed
def test_a_binary_trace_names_its_file(tmp_path, name):
    path = tmp_path / name  # was "'utf-8' codec can't decode byte 0xff ...", no file named
    path.write_bytes(b"\xff\xfe\x00garbage\n")
    with pytest.raises(ConfigError, match=f"{name}: not UTF-8 text"):
        read_trace(path)


@pytest.mark.parametrize("encoding, says", [
    ("utf-16", "not UTF-8 text (byte 0: invalid start byte; it is UTF-16: save it as UTF-8)"),
    ("utf-16-le", r"(found: 'T\x00I\x00M"),  # said "found: TIMESTAMP" (the NULs unseen)
    ("utf-32", "; it is UTF-32: save it as UTF-8)"),  # r3: FF FE 00 00 was named UTF-16
])
def test_a_utf16_trace_is_named_for_what_it_is(tmp_path, encoding, says):
    """h8: Excel's 'Unicode Text' and PowerShell write UTF-16; the trace without a byte order
    mark was refused as 'missing column TIMESTAMP (found: TIMESTAMP, ...)'."""
    path = tmp_path / "t.csv"
    path.write_bytes("TIMESTAMP,ContextTokens,GeneratedTokens\n2023-11-16 18:15:46.68,30,3\n"
                     .encode(encoding))
    with pytest.raises(ConfigError) as exc:
        read_trace(path)
    assert says in str(exc.value)
