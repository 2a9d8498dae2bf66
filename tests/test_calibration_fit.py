"""Calibration: fits that recover known parameters, the grids it times, and what `calibrate`
measures alone, pins and fits (moved from test_sim.py)."""

from __future__ import annotations

import dataclasses

import pytest
from batchsim.server.measure import calibration as cal
from batchsim.server.perf.profile import DeviceProfile, GemmFit
from batchsim.server.perf.stepcost import StepCost

from tests.sim_profile import PROFILE


def test_gemm_fit_recovers_known_parameters():
    true = GemmFit(weight_ns={512 * 512: 0.5, 2048 * 2048: 0.3, 1024 * 32768: 0.25},
                   flop_ns={1: 0.08, 2: 0.07, 4: 0.06, 16: 0.03, 64: 0.02})
    samples = {(m, k, n): true.seconds(m, k, n) for m in true.flop_ns
               for k, n in ((512, 512), (2048, 2048), (1024, 32768))}
    fit = cal.fit_gemm(samples)
    for (m, k, n), t in samples.items():
        assert fit.seconds(m, k, n) == pytest.approx(t, rel=0.02)


FORWARD_ZERO = dataclasses.replace(PROFILE.calibration, **dict.fromkeys(cal.FORWARD_TERMS, 0.0))


def _exact_samples(names: tuple[str, ...], profile: DeviceProfile = PROFILE) -> tuple[list, dict]:
    """Step samples of each model timed exactly as `profile` predicts them, and StepCosts with the
    forward terms zeroed, as `calibrate` fits them."""
    from batchsim.server.models.spec import zoo_spec

    samples, costs0 = [], {}
    for name in names:
        c = StepCost(zoo_spec(name), profile, "float32", None)
        costs0[name] = StepCost(c.spec, dataclasses.replace(PROFILE, calibration=FORWARD_ZERO),
                                "float32", None)
        for b in (1, 4, 16):
            for w in (100, 700):
                samples.append(cal.StepSample(name, "decode", b, w, c.decode_forward_s(b, w)))
        for n, start in ((16, 0), (256, 0), (256, 512)):
            samples.append(cal.StepSample(name, "prefill", n, start,
                                          c.prefill_forward_s(n, start, True)))
    return samples, costs0


def test_forward_terms_fit_recovers_known_coefficients():
    # Three head shapes (3:1 x 64, 2:1 x 16, 8:1 x 32), as `calibrate` uses, make the per-K/V-byte
    # and the per-score attention terms separable.
    samples, costs0 = _exact_samples(("smollm2-135m", "tiny", "gqa8-probe"))
    terms = cal.fit_forward_terms(samples, costs0)
    for key in cal.FORWARD_TERMS:  # the per-row terms: zero here (abs: a zero's 1e-12 ns)
        want = getattr(PROFILE.calibration, key)
        assert terms[key] == pytest.approx(want, rel=1e-3, abs=1e-6), key


def test_forward_terms_fit_recovers_the_per_row_terms():
    # Steps that carry a per-row attention cost, a per-token-per-layer cost and a sampling cost:
    # the fit separates them (decode rows vs prefill tokens vs sampled rows) from the rest.
    per_row = {"attention_row_ns": 900.0, "token_layer_ns": 400.0, "sampling_row_us": 60.0}
    profile = dataclasses.replace(
        PROFILE, calibration=dataclasses.replace(PROFILE.calibration, **per_row))
    samples, costs0 = _exact_samples(("smollm2-135m", "tiny", "gqa8-probe"), profile)
    terms = cal.fit_forward_terms(samples, costs0)
    for key in cal.FORWARD_TERMS:
        want = getattr(profile.calibration, key)
        assert terms[key] == pytest.approx(want, rel=1e-3, abs=1e-6), key


def test_pinned_fixed_costs_are_taken_as_given_and_the_rest_refitted():
    # The steps carry PROFILE's fixed costs: pinned to them, every other term comes back; pinned
    # 3x too high, the fit must move the other terms (it cannot return them unchanged).
    samples, costs0 = _exact_samples(("smollm2-135m", "tiny", "gqa8-probe"))
    keys = ("layer_overhead_us", "forward_overhead_us")
    true = {k: getattr(PROFILE.calibration, k) for k in keys}
    terms = cal.fit_forward_terms(samples, costs0, pinned=true)
    for key in cal.FORWARD_TERMS:
        want = getattr(PROFILE.calibration, key)
        assert terms[key] == pytest.approx(want, rel=1e-3, abs=1e-6), key
    wrong = {k: 3 * v + 50.0 for k, v in true.items()}
    moved = cal.fit_forward_terms(samples, costs0, pinned=wrong)
    assert {k: moved[k] for k in keys} == wrong
    assert any(moved[k] != pytest.approx(terms[k], rel=1e-2)
               for k in cal.FORWARD_TERMS if k not in keys)


def test_leave_one_model_out_error_measures_what_the_others_cannot_explain():
    names = ("smollm2-135m", "tiny", "gqa8-probe", "qwen2.5-0.5b")
    samples, costs0 = _exact_samples(names)
    exact = cal.transfer_errors(samples, costs0)
    assert set(exact) == set(names)
    assert all(e["median_abs_err"] < 1e-6 for e in exact.values())
    # One model runs 25% slower than the others explain: fitted without it, it is predicted at
    # 1/1.25 of its time, so its transfer error says -20%, which its in-sample error would hide.
    slow = [dataclasses.replace(s, seconds=s.seconds * 1.25) if s.model == "qwen2.5-0.5b" else s
            for s in samples]
    err = cal.transfer_errors(slow, costs0)["qwen2.5-0.5b"]
    assert err["median_err"] == pytest.approx(-0.2, abs=1e-6)
    assert err["median_abs_err"] == pytest.approx(0.2, abs=1e-6)


def test_speed_probe_points_are_calibration_grid_points(tiny):
    """The profile stores calibration's grid medians as the probe's reference: the probe's keys
    must name exactly the grid points `is_probe_point` picks out."""
    ref, model, _ = tiny
    spec, kvt = ref.spec, ref.spec.kv_bytes_per_token("float32")
    grid = cal.decode_samples("tiny", model, spec, kvt, [1, 2, 8], [128, 512], steps=5, rounds=1)
    grid += cal.prefill_samples("tiny", model, spec, kvt, [16, 64], [0, 512], reps=1)
    picked = {cal.probe_key(x) for x in grid if cal.is_probe_point(x)}
    probe = cal.speed_probe_ms("tiny", model, spec, kvt)
    assert set(probe) == picked and len(picked) == 3
    assert all(v > 0 for v in probe.values())
    assert cal.device_speed(cal.probe_speed({k: 2 * v for k, v in probe.items()},
                                            probe)) == pytest.approx(0.5)


def test_step_grid_goes_round_robin_over_models_and_keeps_each_points_median(monkeypatch):
    """A slow phase must touch every calibration model, not just the one being measured."""
    calls, speed = [], iter([1.0, 1.0, 9.0, 1.1, 1.2, 1.3])  # a 9x stall in round 2, model a

    def fake_decode(name, *args, **kw):
        assert kw.get("rounds") == 1
        calls.append(name)
        return [cal.StepSample(name, "decode", 1, 131, next(speed))]

    monkeypatch.setattr(cal, "decode_samples", fake_decode)
    monkeypatch.setattr(cal, "prefill_samples", lambda *a, **kw: [])
    got = cal.grid_samples({"a": (None, None, 0), "b": (None, None, 0)}, [1], [128], [16], [0],
                           rounds=3, log=lambda _: None)
    assert calls == ["a", "b", "a", "b", "a", "b"]
    # medians: the stall is outvoted
    assert {s.model: s.seconds for s in got} == {"a": 1.2, "b": 1.1}


def test_decode_grid_skips_points_whose_kv_would_pass_the_cap(tiny):
    ref, model, _ = tiny
    spec, kvt = ref.spec, ref.spec.kv_bytes_per_token("float32")
    cap = cal.decode_kv_bytes(kvt, 2, 512)
    got = cal.decode_samples("tiny", model, spec, kvt, [1, 2, 4], [128, 512],
                             rounds=1, max_kv_bytes=cap)
    assert sorted((s.rows, s.context) for s in got) == sorted(
        (b, cal.decode_sample_context(w, 5)) for b, w in ((1, 128), (2, 128), (4, 128),
                                                          (1, 512), (2, 512)))


def test_gemm_grid_is_timed_in_passes_and_keeps_each_points_median(monkeypatch):
    order, t = [], iter(range(1, 100))

    def fake_time(m, k, n, dtype, reps, weights, warmup):
        order.append((m, k, n, warmup))
        return float(next(t)) if (m, k, n) != (2, 8, 8) or len(order) > 4 else 1e3  # one outlier

    monkeypatch.setattr(cal, "streamed_weights", lambda k, n, dtype: [])
    monkeypatch.setattr(cal, "time_linear", fake_time)
    _, samples = cal.measure_gemm(None, rows=(1, 2), shapes=((8, 8), (8, 16)),
                                  reps=3, log=lambda _: None)
    assert [o[:3] for o in order[:4]] == [(1, 8, 8), (2, 8, 8), (1, 8, 16), (2, 8, 16)]
    # whole passes, not one point x3
    assert [o[:3] for o in order] == [o[:3] for o in order[:4]] * 3
    assert [o[3] for o in order] == [1] * 4 + [0] * 8  # warm-up on the first pass only
    assert samples[(2, 8, 8)] == 9.0  # median of (1000, 5, 9): the outlier pass is outvoted


@pytest.mark.parametrize("model", ["tiny", "calib-sliding", "tiny-hybrid", "tiny-mla"])
def test_fixed_costs_grow_with_depth_and_pin_the_per_layer_term(model):
    # 16 layers of tiny's llama layer (or another architecture's) take well over 4 layers'
    # step: the slope is positive and the pinned term is its mean over the batches measured; the
    # per-forward term stays fitted.
    from batchsim.server.measure import fixed_cost

    def grows(costs) -> bool:
        return all(c.step_us_by_depth[16] > 1.5 * c.step_us_by_depth[4] for c in costs)

    # Wall-clock timings on a shared 2-core VM: one noisy window (load from other processes) can
    # flatten a ratio, so a failed measurement is taken once more, with more reps.
    costs = fixed_cost.measure(batches=(1, 4), steps=8, reps=3, model=model)
    if not grows(costs):
        costs = fixed_cost.measure(batches=(1, 4), steps=8, reps=5, model=model)
    assert [c.batch for c in costs] == [1, 4]
    assert grows(costs)
    assert all(c.layer_us > 0 and c.forward_us >= 0 for c in costs)
    mean = pytest.approx((costs[0].layer_us + costs[1].layer_us) / 2)
    pinned = fixed_cost.pinned_terms({"dense": costs, "gpt_oss": costs})
    assert pinned == {"layer_overhead_us": mean, "layer_overhead_us_by_arch": {"gpt_oss": mean}}


def test_calibrate_measures_every_architecture_and_the_expert_terms_alone(monkeypatch):
    from batchsim.scripts import calibrate
    from batchsim.server.measure import expert_cost, fixed_cost

    bandwidths = []

    def fake_measure_all(reps):
        cost = [fixed_cost.FixedCost(1, {4: 1.0, 8: 2.0, 16: 4.0}, 100.0, 0.0)]
        return {"dense": cost, **{a: cost for a in fixed_cost.ARCH_MODELS}}

    def fake_experts(bandwidth_gbs, reps):
        bandwidths.append(bandwidth_gbs)
        return expert_cost.ExpertCost(260.0, 0.27, {(64, 32, 8, 2, 1): 50.0})

    monkeypatch.setattr(fixed_cost, "measure_all", fake_measure_all)
    monkeypatch.setattr(expert_cost, "measure", fake_experts)
    pinned, timings = calibrate._measured_alone(True, 31.0)
    assert set(pinned["layer_overhead_us_by_arch"]) == set(fixed_cost.ARCH_MODELS)
    assert (pinned["experts_ns_per_pair"], pinned["experts_ns_per_mac"]) == (260.0, 0.27)
    assert bandwidths == [31.0]  # the streamed weights priced at the calibration's bandwidth
    # What they came from goes to calibrate.jsonl: every stack's timings, every SwitchGLU point.
    assert set(timings["layer_stacks"]) == {"dense", *fixed_cost.ARCH_MODELS}
    assert timings["layer_stacks"]["dense"] == [{"batch": 1,
                                                 "step_us_by_depth": {4: 1.0, 8: 2.0, 16: 4.0},
                                                "layer_us": 100.0, "forward_us": 0.0}]
    assert timings["switchglu_us"] == [{"hidden": 64, "inter": 32, "experts": 8, "top_k": 2,
                                        "tokens": 1, "us": 50.0}]


def test_calibrate_prices_the_engine_overhead_at_the_median_and_keeps_each_models(monkeypatch):
    from batchsim.scripts import calibrate

    measured = {"a": (100.0, 5.0), "b": (550.0, 30.0), "c": (300.0, 10.0)}
    monkeypatch.setattr(calibrate, "_engine_host_one_us", lambda session: measured[session])
    step_us, token_us, by_model = calibrate._engine_host_us({name: name for name in measured})
    assert (step_us, token_us) == (300.0, 10.0) and by_model == measured


def test_calibrate_measures_the_engines_host_work_per_token(monkeypatch):
    # Busy steps spaced 300 us + 20 us per row: the intercept is the engine's cost per step, the
    # slope its cost per token, which the profile prices per sampled row (StepTime.host_token_s).
    from batchsim.scripts import calibrate
    from batchsim.server.models.spec import zoo_spec

    gaps = [(b, (300.0 + 20.0 * b) * 1e-6) for b in (16, 12, 9, 5, 2, 1)]
    monkeypatch.setattr(calibrate, "_busy_gaps", lambda session, spec: gaps)
    assert calibrate._engine_host_one_us("s") == pytest.approx((300.0, 20.0))
    monkeypatch.setattr(calibrate, "_busy_gaps", lambda session, spec: gaps[:1] * 4)
    # One batch size: no slope to measure, the step's cost is the median gap.
    assert calibrate._engine_host_one_us("s") == pytest.approx((620.0, 0.0))
    measured = dataclasses.replace(PROFILE, calibration=dataclasses.replace(
        PROFILE.calibration, host_token_us=20.0))
    spec = zoo_spec("tiny")
    step = StepCost(spec, measured, "float32", None).decode_time(8, 100)
    assert step.host_token_s == pytest.approx(8 * 20e-6)
    assert StepCost(spec, PROFILE, "float32", None).decode_time(8, 100).host_token_s == 0.0


def test_layers_of_a_measured_architecture_cost_its_own_fixed_time():
    # The profile's dense per-layer cost is 40 us; gpt-oss layers measured at 100 and Qwen3-MoE ones
    # at 70: every gpt-oss layer costs 100, a Qwen3-MoE model's MoE layers 70 and its dense-only
    # layer 40, and an architecture not measured (gemma3_text) 40 a layer.
    from batchsim.server.models.spec import zoo_spec

    cal = dataclasses.replace(PROFILE.calibration,
                              layer_overhead_us_by_arch={"gpt_oss": 100.0, "qwen3_moe": 70.0})
    profile = dataclasses.replace(PROFILE, calibration=cal)
    forward_us = cal.forward_overhead_us
    for name, want_us in (("tiny-sliding", 4 * 100), ("tiny-moe", 70 + 40),
                          ("gemma-3-1b", 26 * 40), ("tiny", 2 * 40)):
        step = StepCost(zoo_spec(name), profile, "float32", None).decode_time(1, 100)
        assert step.fixed_s == pytest.approx((want_us + forward_us) * 1e-6), name


def test_calibrate_pins_what_it_measured_alone_and_fits_the_rest_on_dense_steps():
    # Steps timed exactly as a profile with known expert terms predicts them: calibrate's fit takes
    # the pinned per-layer and expert costs as given and recovers the per-forward one; an MoE
    # model's steps among the samples are reported, not fitted (pinned 0, the terms stay 0).
    import argparse

    from batchsim.scripts import calibrate
    from batchsim.server.models.spec import zoo_spec

    by_arch = {"qwen3_moe": 70.0, "gpt_oss": 90.0}
    experts = {"experts_ns_per_pair": 150.0, "experts_ns_per_mac": 0.2}
    true = dataclasses.replace(PROFILE, calibration=dataclasses.replace(
        PROFILE.calibration, layer_overhead_us_by_arch=by_arch, **experts))
    names = ("smollm2-135m", "tiny", "gqa8-probe", "tiny-moe")
    samples, _ = _exact_samples(names, true)
    sessions = {n: argparse.Namespace(spec=zoo_spec(n)) for n in names}
    ceilings = calibrate._Ceilings(20.0, PROFILE.calibration.gemm["float32"], 100.0, 5.0)
    args = argparse.Namespace(name="t", models=list(names))
    env_info = {"cpu": "x", "backend": "cpu", "blas": "b"}
    pinned = {"layer_overhead_us": 40.0, "layer_overhead_us_by_arch": by_arch, **experts}
    profile, terms, _ = calibrate._fit(args, "float32", "now", env_info, ceilings, sessions,
                                       samples, 200.0, {}, pinned)
    got = profile.calibration
    assert got.layer_overhead_us == 40.0 and (got.experts_ns_per_pair,
                                              got.experts_ns_per_mac) == (150.0, 0.2)
    assert got.layer_overhead_us_by_arch == by_arch
    assert terms["layer_overhead_us[qwen3_moe]"] == 70.0
    assert terms["experts_ns_per_mac"] == 0.2
    assert got.calibrated_on == (*names, "calib-sliding")  # what the gpt-oss layer was measured on
    assert got.forward_overhead_us == pytest.approx(300.0, rel=1e-3)
    assert got.step_overhead_us == 200.0
    zeroed = pinned | dict.fromkeys(experts, 0.0)
    profile, _, _ = calibrate._fit(args, "float32", "now", env_info, ceilings, sessions, samples,
                                   200.0, {}, zeroed)
    assert (profile.calibration.experts_ns_per_pair,
            profile.calibration.experts_ns_per_mac) == (0.0, 0.0)
    assert profile.calibration.forward_overhead_us == pytest.approx(300.0, rel=1e-3)
