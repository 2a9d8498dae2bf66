"""The Mac GPU step: the published reference set, the fit on it (terms recovered from synthetic
rows, the shipped fit reproduced), its place in StepCost's one model, which Mac a profile name
means, and the default Metal working-set rule against published recommendedMaxWorkingSetSize
values."""

from __future__ import annotations

import argparse
import dataclasses

import pytest
from batchsim.configs import CONFIG_DIR, ConfigError
from batchsim.scripts import fit_macs, size
from batchsim.server.models.spec import zoo_spec
from batchsim.server.perf import devices, gpu_fit, mac_fit, mac_report, macs
from batchsim.server.perf.reference import load_published, load_reference
from batchsim.server.perf.stepcost import StepCost
from batchsim.server.perf.weight_bytes import matrix_weight_bytes
from batchsim.server.published import cv as mac_cv

GIB = 1 << 30


@pytest.fixture(scope="module")
def catalog():
    return macs.load_catalog()


@pytest.fixture(scope="module")
def ref():
    return load_reference()


def test_reference_set_covers_chips_sizes_and_families(ref, catalog):
    rows = ref.rows
    assert len(rows) >= 30 and len(ref.chips) >= 6 and len(ref.models) >= 8
    assert {"qwen3-30b-a3b", "gpt-oss-20b", "gemma-3-27b"} <= set(ref.models)  # MoE, sliding
    params = [zoo_spec(m).num_params for m in ref.models]
    assert min(params) < 1e9 and max(params) > 60e9
    for r in rows:  # every row prices: a zoo model on one catalog Mac, a cited source
        assert mac_fit.basis(r, catalog).peak_s > 0 and ref.sources[r.src].startswith("https://")


def test_fit_recovers_known_terms_from_synthetic_rows(ref, catalog):
    true = gpu_fit.GpuFit({"float": 0.8, "q8": 0.7, "q4": 0.6}, 40.0, 300.0, 0.5, 0.5, "synthetic")
    rows = [dataclasses.replace(r, decode_tok_s=mac_fit.predict_tok_s(r, catalog, true))
            for r in ref.rows]
    got = mac_fit.fit_rows(rows, catalog, 0.5)
    for f, v in true.bandwidth_efficiency.items():
        assert got.bandwidth_efficiency[f] == pytest.approx(v, rel=1e-3)
    assert got.layer_overhead_us == pytest.approx(40.0, rel=1e-3)
    assert got.forward_overhead_us == pytest.approx(300.0, rel=1e-2)
    assert got.expert_bandwidth_efficiency == pytest.approx(0.5)
    errs = mac_fit.held_out_errors(rows, catalog, lambda r: r.chip, 0.5)
    # Exact data, so held out is exact too, but where the held-out chip took its format's only
    # rows with it (bfloat16: M2 Ultra): that format then gets the others' mean.
    assert max(abs(e) for i, e in errs.items() if rows[i].weights != "bfloat16") < 1e-3
    assert max(abs(e) for e in errs.values()) > 0.05


def test_shipped_fit_is_the_fit_of_the_published_set(ref, catalog):
    before = mac_report.fit_reference(ref, catalog)  # the batch-1-only fit that shipped before
    rows = list(load_published().rows)
    # What fit-macs runs in every fold, on every row (seeded by the rows' own batch-1 fit).
    refit = mac_cv.published_fitter(mac_fit.prefill_rows(ref))(rows, catalog)
    shipped = fit_macs.shipped_model(refit)  # engines without rows: at their kind's prior
    assert fit_macs.same_model(refit, shipped)
    assert shipped.fit.fitted_on.startswith("configs/reference/published.yaml: ")
    assert {"leave_one_source_out_median_abs", "leave_one_chip_out_worst_abs"} <= set(
        shipped.fit.errors)
    # Small models pay the fixed per-layer cost the roofline alone missed (the 55-81%).
    (small, _) = [r for r in ref.rows if (r.model, r.chip) == ("qwen3-0.6b", "M3 Ultra")]
    assert mac_report.before_tok_s(small, catalog) > 2.5 * small.decode_tok_s
    assert mac_fit.predict_tok_s(small, catalog, before) == pytest.approx(small.decode_tok_s,
                                                                          rel=0.1)


def test_fixed_costs_are_named_parts_of_the_one_step_model():
    fit = gpu_fit.load_fit()
    profile = devices.resolve_profile("M4 Max 40c", 4)
    cost = StepCost(zoo_spec("qwen3-8b"), profile, "float16", 4)
    step = cost.step_time(decode_rows=8, width=1000)
    # 36 qwen3 layers of 19 kernels, layer_overhead_us being a 17-kernel layer's (kernels.py)
    fixed_us = 36 * 19 / 17 * fit.layer_overhead_us + fit.forward_overhead_us
    assert step.fixed_s == pytest.approx(fixed_us * 1e-6)
    assert profile.fitted_on.startswith(fit.fitted_on)
    assert cost.decode_forward_s(8, 1000) == pytest.approx(step.total_s)  # the fast path agrees


def test_linux_profile_keeps_its_calibrated_terms():
    profile = devices.load_profile(CONFIG_DIR / "devices" / "linux-x86_64-openblas-2core.yaml")
    assert (profile.layer_overhead_s, profile.expert_bandwidth_efficiency) == (0.0, 1.0)
    cost = StepCost(zoo_spec("qwen3-0.6b"), profile, "float32", None)
    cal = profile.calibration
    want = (28 * cal.layer_overhead_us + cal.forward_overhead_us) * 1e-6
    assert cost.decode_time(1, 100).fixed_s == pytest.approx(want)


def test_quantized_bytes_have_one_formula():
    spec = zoo_spec("qwen3-0.6b")
    arch = spec.arch
    mats = [m for lay in arch.layers for m in lay.mats] + list(arch.outer_mats)
    small = sum(lay.small_params for lay in arch.layers) + arch.hidden_size
    for bits in (4, 8):
        priced = sum(m.count * matrix_weight_bytes(f"q{bits}", m.in_dim, m.out_dim) for m in mats)
        assert priced + 2 * small == spec.weight_bytes("float16", bits)
    assert matrix_weight_bytes("q4", 100, 10) == 100 * 10 * 2  # 64 does not divide 100: float16


def test_a_chip_name_means_its_base_variant_and_says_so():
    p = devices.resolve_profile("M2 Ultra")
    assert p.name == "M2 Ultra 60c" and "2 GPU variants (M2 Ultra 60c, M2 Ultra 76c)" in p.source
    assert devices.resolve_profile("M5 Max").name == "M5 Max 32c"
    assert devices.resolve_profile("M2 Ultra 76c").name == "M2 Ultra 76c"
    assert "variants" not in devices.resolve_profile("M2 Ultra 76c").source
    with pytest.raises(ConfigError, match="ambiguous: M1 Ultra 48c, .*M3 Ultra 80c"):
        devices.resolve_profile("Ultra")


def test_working_set_rule_matches_published_values(catalog):
    ws = catalog.metal_working_set
    points = [p for p in ws.measured_points if "working_set_gib" in p and "ram_gb" in p]
    older = [p for p in points if "macos" in p]
    assert {p["ram_gb"] for p in older} == {16, 32, 64, 96}
    for p in points:
        rule_gib = macs.default_working_set_bytes(p["ram_gb"], ws) / GIB
        if "macos" in p:  # macOS 13-15 logs: the rule exactly
            assert rule_gib == pytest.approx(p["working_set_gib"], abs=0.01)
        else:  # macOS 26 reports more: the rule is a floor
            assert rule_gib <= p["working_set_gib"]


def test_size_rows_say_which_profile_and_keep_their_keys(tmp_path):
    parser = argparse.ArgumentParser()
    size.add_parser(parser)
    summary = size.run(parser.parse_args(["--model", "llama-3.2-1b", "--quantize", "4", "--mac",
                                          "M4 Max 40c", "--memory-gb", "64",
                                          "--out", str(tmp_path)]))
    (row,) = summary["rows"]
    assert row["decode_tok_s_b1"] > 0 and row["max_batch"] > 0
    assert row["profile"] == "M4 Max 40c" and "published.yaml" in row["profile_fitted_on"]
    assert summary["profile_errors"] == gpu_fit.load_fit().errors


def test_simulated_sweep_rows_say_which_profile(tmp_path, monkeypatch):
    from batchsim.scripts import sweep

    monkeypatch.setenv("BATCHSIM_HOME", str(tmp_path / "home"))
    parser = argparse.ArgumentParser()
    sweep.add_parser(parser)
    summary = sweep.run(parser.parse_args([
        "--executor", "sim", "--device-profile", "M2 Max", "--model", "llama-3.2-1b",
        "--quantize", "4", "--batches", "1,2", "--no-progress", "--out", str(tmp_path),
        "--runs-dir", str(tmp_path / "runs")]))
    rows = summary["rows"]
    assert [r["profile"] for r in rows] == ["M2 Max 30c", "M2 Max 30c"]
    assert all(r["decode_tok_s"] > 0 and "published.yaml" in r["profile_fitted_on"] for r in rows)


def test_one_huber_weight_and_loss_for_both_fits():
    """mac_fit and published.solve each wrote the IRLS weight and the loss (r2): one helper, at
    each caller's delta (nested CV sets solve.HUBER_DELTA)."""
    import numpy as np

    r = np.array([0.05, 0.2, 0.1])
    assert mac_fit.huber_weights(r, 0.1).tolist() == [1.0, np.sqrt(0.5), 1.0]
    assert mac_fit.huber_loss(r, 0.1) == pytest.approx(0.05**2 + 0.1 * (0.4 - 0.1) + 0.1**2)
    assert mac_fit.huber_loss(r, 0.2) == pytest.approx(0.05**2 + 0.2**2 + 0.1**2)
