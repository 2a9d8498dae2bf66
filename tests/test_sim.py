"""The simulator: the same scheduler object as real runs, the same plans, the real executor's KV
bytes, virtual time, a lookahead that changes nothing but speed. Calibration's fits, grids and
what `calibrate` pins: test_calibration_fit.py."""

from __future__ import annotations

import dataclasses
import time

import pytest
from batchsim.scheduler.scheduler import Scheduler
from batchsim.server.engine.run_config import RunConfig, SchedulerSettings
from batchsim.server.engine.runner import run_workload
from batchsim.server.engine.session import open_session
from batchsim.server.executors.shadow import ShadowTimer
from batchsim.server.executors.sim_executor import SimExecutor
from batchsim.server.perf.profile import DeviceProfile, at_speed
from batchsim.server.perf.stepcost import StepCost
from batchsim.workloads.lengths import LengthSpec
from batchsim.workloads.spec import WorkloadSpec

from tests.sim_profile import PROFILE


def workload(n=12, rate=float("inf"), seed=3, out="uniform:4:24") -> WorkloadSpec:
    from batchsim.workloads.lengths import parse_length

    return WorkloadSpec(name="t", num_prompts=n, arrival="poisson", request_rate=rate,
                        input_len=LengthSpec("uniform", min=8, max=300),
                        output_len=parse_length(out),
                        seed=seed)


def sim_session(model="tiny", lookahead=True, profile=PROFILE, **cfg):
    spec = cfg.pop("workload", workload())
    rc = RunConfig(model=model, dtype="float32", executor="sim", workload=spec, **cfg)
    ref_session = open_session(dataclasses.replace(rc, executor="fake"))
    ex = SimExecutor(StepCost(ref_session.spec, profile, "float32", None),
                     **({} if lookahead else {"max_lookahead_steps": 1}))
    return open_session(rc, executor=ex)


def _plans(session) -> list:
    plans = []
    run_workload(session, session.config.workload, out_dir=None, label="t",
                 on_step=lambda engine, plan, result: plans.append((engine.scheduler, plan)))
    return plans


def test_sim_and_real_make_the_same_decisions_with_the_same_scheduler(tiny):
    # All requests arrive at once, so no decision depends on step timing.
    sched = SchedulerSettings(max_num_seqs=4, max_num_batched_tokens=512, prefill_step_size=256)
    real = open_session(RunConfig(model="tiny", dtype="float32", scheduler=sched,
                                  workload=workload()))
    sim = sim_session(lookahead=False, scheduler=sched)
    real_plans, sim_plans = _plans(real), _plans(sim)
    for (s1, _), (s2, _) in zip(real_plans, sim_plans):
        assert type(s1) is Scheduler and type(s2) is Scheduler  # one policy, not a copy
    # The real prompts' blocks are cached (sim prompts have no hashes): bytes the plans evict
    # when they need them, so the decisions stay the same.
    strip = [p._replace(new_requests=tuple(n._replace(token_ids=None) for n in p.new_requests),
                        kv_bytes=0, cache_ops=None) for _, p in real_plans]
    assert any(p.cache_ops for _, p in real_plans)
    assert strip == [p._replace(kv_bytes=0) for _, p in sim_plans]
    assert len(strip) > 10


def test_sim_reports_the_kv_bytes_the_plan_allocates():
    s = sim_session(memory_gb=0.002, scheduler=SchedulerSettings(max_num_seqs=8, row_step=2))
    outcome = run_workload(s, s.config.workload, out_dir=None, label="t")
    assert outcome.summary["kv_account_mismatches"] == 0
    assert outcome.summary["max_batch_size"] < 8  # the tight budget really bound: requests queued
    assert all(st.kv_bytes_measured == st.kv_bytes for st in outcome.steps)


def test_virtual_time_runs_far_faster_than_real_time():
    s = sim_session(workload=workload(n=200, rate=2.0))
    t0 = time.perf_counter()
    summary = run_workload(s, s.config.workload, out_dir=None, label="t").summary
    wall = time.perf_counter() - t0
    assert summary["duration"] > 90  # 200 arrivals at 2/s span ~100 simulated seconds
    assert wall < summary["duration"] / 50
    assert summary["completed"] == 200


def test_lookahead_changes_speed_not_results():
    spec = workload(n=40, rate=3.0, out="uniform:20:80")
    a = run_workload(sim_session(workload=spec), spec, out_dir=None, label="a")
    b = run_workload(sim_session(workload=spec, lookahead=False), spec, out_dir=None, label="b")
    assert a.summary["num_plans"] < b.summary["num_plans"]
    for key in ("duration", "mean_ttft_ms", "p99_tpot_ms", "mean_itl_ms", "output_throughput"):
        assert a.summary[key] == pytest.approx(b.summary[key], rel=1e-9), key


@pytest.mark.parametrize("arrivals", [
    {"arrival": "poisson", "request_rate": 4.0, "max_concurrency": 3, "max_request_rate": 2.0},
    {"arrival": "closed", "concurrency": 3, "think_time_s": 0.05},
])
def test_advancing_the_clock_in_place_changes_nothing(monkeypatch, arrivals):
    # The virtual loop's shortcut must equal a trip through the loop, also with timers the engine
    # does not know about (a rate cap, think time, slots freed by finishing requests).
    from batchsim.server.engine.clock import VirtualTimeLoop

    spec = dataclasses.replace(workload(n=30, out="uniform:4:40"), **arrivals)
    a = run_workload(sim_session(workload=spec), spec, out_dir=None, label="a")
    monkeypatch.setattr(VirtualTimeLoop, "advance", lambda self, dt: False)
    b = run_workload(sim_session(workload=spec), spec, out_dir=None, label="b")
    assert a.summary["completed"] == 30
    for key in ("duration", "mean_ttft_ms", "p99_ttft_ms", "p99_tpot_ms", "mean_itl_ms",
                "output_throughput", "max_batch_size", "num_plans"):
        assert a.summary[key] == b.summary[key], key


@pytest.mark.parametrize("arrivals", [
    {}, {"arrival": "closed", "concurrency": 3, "think_time_s": 0.05}, {"max_concurrency": 3}])
def test_arrivals_and_callbacks_run_without_loop_turns_and_change_nothing(monkeypatch, arrivals):
    # An arrival due inside a plan's time runs from the engine's sleep, and a finished request's
    # callbacks from the engine (when they wake no task), instead of in turns of their own.
    from batchsim.server.engine import runner
    from batchsim.server.engine.clock import VirtualTimeLoop

    # The asyncio path (an open-loop run without limits goes without it: test_virtual_run.py).
    monkeypatch.setattr(runner, "replays_exactly", lambda _arrivals: False)
    spec = dataclasses.replace(workload(n=60, rate=20.0, out="uniform:20:80"), **arrivals)
    turns: list[int] = []
    run_once = VirtualTimeLoop._run_once
    monkeypatch.setattr(VirtualTimeLoop, "_run_once",
                        lambda loop: turns.append(1) or run_once(loop))
    a = run_workload(sim_session(workload=spec), spec, out_dir=None, label="a")
    inline_turns = len(turns)
    turns.clear()
    monkeypatch.setattr(VirtualTimeLoop, "run_due_timers", lambda loop, target: False)
    monkeypatch.setattr(VirtualTimeLoop, "run_ready", lambda loop: False)
    b = run_workload(sim_session(workload=spec), spec, out_dir=None, label="b")
    assert a.steps == b.steps and a.requests == b.requests
    if not arrivals:  # open loop: 60 arrivals and 60 finishes, most while plans ran
        assert 2 * inline_turns < len(turns)


def test_step_cost_grows_with_batch_width_and_chunk(smollm2_spec):
    c = StepCost(smollm2_spec, PROFILE, "float32", None)
    assert c.decode_forward_s(1, 100) < c.decode_forward_s(8, 100) < c.decode_forward_s(8, 1000)
    # Batching amortizes the weight term: 8 rows cost far less than 8 single-row passes.
    assert c.decode_forward_s(8, 100) < 0.5 * 8 * c.decode_forward_s(1, 100)
    assert c.prefill_forward_s(256, 0, False) < c.prefill_forward_s(512, 0, False)
    assert c.prefill_forward_s(256, 512, True) > c.prefill_forward_s(256, 0, True)


def test_roofline_profile_without_calibration_is_bandwidth_bound_at_batch_1(smollm2_spec):
    p = DeviceProfile(name="mac", bandwidth_gbs=400.0, peak_tflops={"float16": 13.6},
                      bandwidth_efficiency=0.8, compute_efficiency=0.75)
    c = StepCost(smollm2_spec, p, "float16", None)
    weights = smollm2_spec.weight_bytes("float16")
    expected = weights / (400e9 * 0.8)
    assert c.decode_forward_s(1, 1) == pytest.approx(expected, rel=0.05)


@pytest.mark.parametrize("calibrated, model", [(True, "tiny"), (False, "tiny"), (True, "tiny-moe")])
def test_a_device_at_half_speed_takes_twice_as_long_for_everything(calibrated, model):
    """`validate` re-simulates each case on the device as probed (`at_speed`): every term must
    scale, or the timeline would not stretch by exactly 1/speed (all arrivals at t=0). The MoE
    model's layers cost what the profile measured for its architecture
    (layer_overhead_us_by_arch)."""
    cal_arch = dataclasses.replace(PROFILE.calibration,
                                   layer_overhead_us_by_arch={"qwen3_moe": 70.0},
                                   experts_ns_per_pair=300.0, experts_ns_per_mac=0.2)
    base = dataclasses.replace(PROFILE, calibration=cal_arch if calibrated else None)
    runs = [run_workload(sim_session(model=model, profile=p,
                                     scheduler=SchedulerSettings(max_num_seqs=4)),
                         workload(), out_dir=None, label="t") for p in (base, at_speed(base, 0.5))]
    fast, slow = (r.summary for r in runs)
    assert slow["duration"] == pytest.approx(2 * fast["duration"], rel=1e-9)
    assert slow["mean_ttft_ms"] == pytest.approx(2 * fast["mean_ttft_ms"], rel=1e-9)
    assert [s.batch_size for s in runs[0].steps] == [s.batch_size for s in runs[1].steps]


@pytest.mark.parametrize("shadow_speed", [1.0, 0.5])
def test_shadow_timer_times_each_executed_plan_as_the_simulator_would(shadow_speed):
    """`validate`'s step-time error: the shadow replays every executed plan on a pool of its own.
    Shadowing a simulated run with the same profile must agree to the last step (any drift of
    its pool, hence of copy costs, would show); on a device at half speed every step doubles."""
    quiet = dataclasses.replace(PROFILE, calibration=dataclasses.replace(
        PROFILE.calibration, step_overhead_us=0.0))  # a real executor's time excludes the engine's
    session = sim_session(lookahead=False, profile=quiet,
                          scheduler=SchedulerSettings(max_num_seqs=4, max_num_batched_tokens=256,
                                                      prefill_step_size=256),
                          workload=workload(n=16, rate=40.0))
    shadow = ShadowTimer(StepCost(session.spec, at_speed(quiet, shadow_speed), "float32", None))
    steps = run_workload(session, session.config.workload, out_dir=None, label="t",
                         on_step=shadow).steps
    assert len(shadow.measured_s) == len(steps) > 20
    assert sum(s.num_preemptions for s in steps) == 0
    assert shadow.sim.layout.row_ids == session.executor.layout.row_ids
    assert shadow.predicted_s == pytest.approx([m / shadow_speed for m in shadow.measured_s],
                                               rel=1e-9)
    assert shadow.error() == pytest.approx(1 / shadow_speed - 1, abs=1e-9)
    # `validate`'s parts: the same predicted time, split; the pool's joins show up as copies.
    assert shadow.parts.total_s == pytest.approx(sum(shadow.predicted_s), rel=1e-9)
    shares = shadow.parts.shares()
    assert sum(shares.values()) == pytest.approx(1.0)
    assert all(shares[k] > 0 for k in ("weights_s", "matmul_s", "attention_s", "copy_s", "fixed_s"))


@pytest.fixture(scope="module")
def smollm2_spec():
    from batchsim.server.models.spec import zoo_spec

    return zoo_spec("smollm2-135m")


@pytest.mark.timeout(60)
# 2.5e-9: 3 arrivals, at 0, 6.5e8 and 8e8 s (seed 0); 1e-9's last at 2e9 s is refused since
# b7f416d (past jsonio.MAX_ARRIVAL_S, 1e9 s).
@pytest.mark.parametrize("rate,time_scale", [(1e-7, 1.0), (2.5e-9, 1.0), (None, 1e7)])
def test_the_simulator_finishes_at_any_rate_and_trace_gap(rate, time_scale, tmp_path):
    """Arrivals 1e7-1e9 simulated seconds apart: asyncio's 1 ns clock resolution is below a
    float's spacing there (timers never came due), and the per-second peaks held one bucket per
    simulated second (gigabytes). Both must stay bounded by the requests, not the gaps."""
    from batchsim.server.engine.run_path import run_config
    from batchsim.workloads.spec import resolve_workload

    if rate is None:  # a trace replay with its gaps stretched to ~1e7 s
        base = resolve_workload("azure-conv")
        spec = dataclasses.replace(base, num_prompts=4,
                                   trace=dataclasses.replace(base.trace, time_scale=time_scale))
    else:
        spec = WorkloadSpec(name="sparse", num_prompts=3, request_rate=rate,
                            input_len=LengthSpec("fixed", value=64),
                            output_len=LengthSpec("fixed", value=16))
    cfg = RunConfig(model="llama-3.2-1b", executor="sim", device_profile="M2 Max", quantize=4,
                    workload=spec)
    t0 = time.perf_counter()
    summary = run_config(cfg, tmp_path)
    assert summary["completed"] == spec.num_prompts and summary["duration"] > 1e6
    assert summary["max_concurrent_requests"] == 1 and time.perf_counter() - t0 < 30
