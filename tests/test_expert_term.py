"""The MoE experts' calibrated terms: each routed (token, expert) pair costs experts_ns_per_pair,
and each of its multiply-adds experts_ns_per_mac, on top of the GEMM model's price; calibration
measures the per-pair cost alone (a gathered matmul, expert_cost.py) and fits the per-MAC one on
MoE steps, and validate's MoE and sliding-window matrices name models calibration does not use."""

from __future__ import annotations

import dataclasses

import pytest
from batchsim.configs import load_yaml
from batchsim.scripts.calibrate import DEFAULT_MODELS, QUICK
from batchsim.server.measure.calibration import StepSample, fit_expert_terms, predict
from batchsim.server.measure.validation_cases import matrix_path
from batchsim.server.models.spec import zoo_spec
from batchsim.server.perf.devices import SHIPPED_DIR, load_profile
from batchsim.server.perf.stepcost import StepCost

PROFILE = load_profile(SHIPPED_DIR / "linux-x86_64-openblas-2core.yaml")


def _cost(name: str, ns_per_pair: float, ns_per_mac: float = 0.0) -> StepCost:
    cal = dataclasses.replace(PROFILE.calibration, experts_ns_per_pair=ns_per_pair,
                              experts_ns_per_mac=ns_per_mac)
    return StepCost(zoo_spec(name), dataclasses.replace(PROFILE, calibration=cal), "float32", None)


def test_each_routed_pair_adds_its_cost_to_the_experts_part():
    # small-moe: 4 MoE layers x 3 expert matrix stacks x B tokens x top 4; each matrix 256x128.
    base, priced = _cost("small-moe", 0.0), _cost("small-moe", 250.0, 0.01)
    assert base.family.expert_pairs(8) == 4 * 3 * 8 * 4
    assert base.family.expert_macs(8) == 4 * 3 * 8 * 4 * 256 * 128
    per_pair_s = (250.0 + 256 * 128 * 0.01) * 1e-9
    for batch in (1, 8, 32):
        extra = priced.decode_time(batch, 300).experts_s - base.decode_time(batch, 300).experts_s
        assert extra == pytest.approx(4 * 3 * batch * 4 * per_pair_s)
    extra = priced.prefill_time(64, 0, True).experts_s - base.prefill_time(64, 0, True).experts_s
    assert extra == pytest.approx(4 * 3 * 64 * 4 * per_pair_s)
    assert _cost("tiny", 250.0, 0.01).family is None  # dense models are priced as before


def _planted(names: list[str], ns_per_pair: float, ns_per_mac: float) -> list[StepSample]:
    points = [("decode", b, 200) for b in (1, 4, 16, 32)] + [("prefill", n, 0) for n in (16, 256)]
    samples = []
    for name in names:
        true = _cost(name, ns_per_pair, ns_per_mac)
        for kind, rows, context in points:
            s = StepSample(name, kind, rows, context, 1.0)
            samples.append(dataclasses.replace(s, seconds=predict(s, true)))
    return samples


def test_calibration_recovers_planted_pair_and_mac_costs():
    # Experts of 64x32 (tiny-moe) and 256x256 (calib-moe): both terms, told apart.
    names = ["tiny-moe", "calib-moe"]
    fitted = {n: _cost(n, 0.0) for n in names}
    assert fit_expert_terms(_planted(names, 400.0, 0.2), fitted) == pytest.approx((400.0, 0.2), rel=1e-6)
    assert fit_expert_terms(_planted(names, 0.0, 0.3), fitted) == pytest.approx((0.0, 0.3), abs=1e-9)
    dense = [StepSample("tiny", "decode", 4, 200, 1e-3)]
    assert fit_expert_terms(dense, {"tiny": _cost("tiny", 0.0)}) == (0.0, 0.0)  # no MoE model


def test_a_pinned_pair_cost_leaves_the_rest_to_the_per_mac_term():
    names = ["tiny-moe", "calib-moe"]
    fitted = {n: _cost(n, 0.0) for n in names}
    samples = _planted(names, 400.0, 0.2)
    assert fit_expert_terms(samples, fitted, 400.0) == pytest.approx((400.0, 0.2), rel=1e-6)
    pair, mac = fit_expert_terms(samples, fitted, 0.0)  # pinned wrong: the MAC term takes it up
    assert pair == 0.0 and mac > 0.2


def test_gathered_matmul_fit_recovers_planted_pair_and_mac_costs():
    from batchsim.server.measure import expert_cost

    def planted(call_ns, pair_ns, mac_ns):
        return {(p, k, n): (call_ns + p * (pair_ns + mac_ns * k * n)) / 1e3
                for k, n in expert_cost.SHAPES for p in expert_cost.PAIRS}

    assert expert_cost.fit(planted(30e3, 250.0, 0.2)) == pytest.approx((250.0, 0.2), rel=1e-6)
    assert expert_cost.fit(planted(30e3, 0.0, 0.3)) == pytest.approx((0.0, 0.3), abs=1e-6)
    # a negative per-pair estimate (measurement noise) is clipped, the MAC term refitted alone
    us = planted(30e3, 0.0, 0.25)
    us[(512, 64, 32)] *= 0.8
    pair, mac = expert_cost.fit(us)
    assert pair == 0.0 and mac == pytest.approx(0.25, rel=0.02)


def test_gathered_matmul_costs_grow_with_pairs_and_expert_size():
    from batchsim.server.measure import expert_cost

    c = expert_cost.measure(reps=1)
    us = c.us_by_point
    assert us[(512, 256, 256)] > 2 * us[(128, 256, 256)] and us[(512, 256, 256)] > 4 * us[(512, 64, 64)]
    assert c.ns_per_pair >= 0 and c.ns_per_mac > 0


@pytest.mark.parametrize("matrix, family", [("moe", "moe"), ("sliding", "sliding")])
def test_family_matrices_validate_on_models_calibration_does_not_use(matrix, family):
    doc = load_yaml(matrix_path(matrix))
    model = doc["model"]
    assert model not in DEFAULT_MODELS and model not in QUICK["models"]
    kinds = {lay.ffn.kind for lay in zoo_spec(model).arch.layers} | {
        lay.attention.kind for lay in zoo_spec(model).arch.layers}
    assert family in kinds and len(doc["cases"]) >= 3


def test_validate_skips_a_model_the_real_executor_cannot_serve_yet(monkeypatch, capsys, tmp_path,
                                                                   batchsim_home):
    import json

    from batchsim.scripts import validate
    from batchsim.scripts.cli import main
    from batchsim.server.engine.run_config import RunConfig

    class Refusing:  # a session whose real runs fail as an unsupported cache kind does
        config = RunConfig()

        def with_config(self, cfg):
            raise NotImplementedError("the decode pool serves one-token decode steps")

    assert validate._not_runnable(Refusing()).startswith("NotImplementedError: the decode pool")
    monkeypatch.setattr(validate, "_not_runnable", lambda session: "NotImplementedError: sliding")
    matrix = tmp_path / "m.yaml"  # a model that loads here; the probe is what refuses it
    matrix.write_text("model: tiny-sliding\ncases:\n  - {name: a, max_num_seqs: 1, workload: {num_prompts: 2}}\n")
    assert main(["validate", "--matrix", str(matrix), "--device-profile",
                 "linux-x86_64-openblas-2core", "--out", str(tmp_path)]) == 0
    captured = capsys.readouterr()
    assert "tiny-sliding is not runnable yet" in captured.err and "1 cases are skipped" in captured.err
    doc = json.loads(captured.out.strip().splitlines()[-1])
    assert doc["skipped"] == "not runnable yet: NotImplementedError: sliding" and doc["cases"] == []
