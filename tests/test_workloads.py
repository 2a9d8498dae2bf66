"""Workloads: arrival processes, lengths and strict YAML. Trace parsing: test_traces.py; the asyncio
driver on a real loop and on a virtual-clock loop: test_workload_driver.py."""

from __future__ import annotations

import itertools
import math

import numpy as np
import pytest
import yaml
from batchsim.configs import CONFIG_DIR, ConfigError
from batchsim.workloads.lengths import LengthSpec, parse_length
from batchsim.workloads.requests import arrival_times, build_requests
from batchsim.workloads.spec import (
    WorkloadSpec,
    builtin_workload,
    builtin_workload_names,
    load_workload,
    resolve_workload,
    with_overrides,
)


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
