"""Quantized matmul ceilings: measured by bits, carried by the profile YAML, and read back."""

from __future__ import annotations

import pytest
from batchsim.configs import ConfigError
from batchsim.server.measure import quantized
from batchsim.server.perf.devices import load_profile, save_profile
from batchsim.server.perf.profile import DeviceProfile


def test_measure_rates_by_bits_in_the_backends_dtype():
    from batchsim.server.platform import env

    rates = quantized.measure_rates(bandwidth_gbs=10.0, reps=1, max_s_per_point=2.0, bits=(4,),
                                    log=lambda s: None)
    assert rates.act_dtype == env.default_dtype()
    assert set(rates.gemv_gbs) == set(rates.gemm_gflops) == {4}
    assert rates.gemv_gbs[4] > 0 and rates.gemm_gflops[4] > 0
    gemvs = [r for r in rates.rows if r["shape"] == "gemv" and "gbytes_s" in r]
    assert rates.gemv_gbs[4] == max(r["gbytes_s"] for r in gemvs)
    with pytest.raises(ValueError, match="bits"):
        quantized.measure_rates(bits=(3,), bandwidth_gbs=10.0)


def test_profile_yaml_round_trips_quantized_rates_keyed_by_bits(tmp_path):
    from batchsim.scripts.calibrate import _quantized_fields

    rates = quantized.QuantizedRates({4: 30.5, 8: 41.0}, {4: 5000.0, 8: 7000.0}, "float16", [])
    profile = DeviceProfile("p", 100.0, {"float16": 1.0}, **_quantized_fields(rates))
    path = save_profile(profile, tmp_path / "p.yaml")
    assert "quantized_gemv_gbs:\n  4: 30.5" in path.read_text()
    assert load_profile(path) == profile
    assert DeviceProfile("p", 1.0, {}).quantized_gemv_gbs == {}  # not measured: the float ones


def test_profile_yaml_with_bits_not_an_integer_is_a_one_line_error(tmp_path):
    profile = DeviceProfile("p", 100.0, {"float16": 1.0})
    path = save_profile(profile, tmp_path / "p.yaml")
    # the saved mapping's value replaced (a second key is refused first, as given twice: fbf1ed4)
    path.write_text(path.read_text().replace("quantized_gemm_gflops: {}",
                                             "quantized_gemm_gflops:\n  q4: 5000.0"))
    with pytest.raises(ConfigError, match="quantized_gemm_gflops.*integer"):
        load_profile(path)


def test_shipped_profile_carries_quantized_rates_measured_here():
    from batchsim.server.perf.devices import SHIPPED_DIR

    for path in SHIPPED_DIR.glob("*.yaml"):
        p = load_profile(path)
        assert set(p.quantized_gemv_gbs) == set(p.quantized_gemm_gflops) == {4, 8}, path
        assert all(v > 0 for v in [*p.quantized_gemv_gbs.values(),
                                   *p.quantized_gemm_gflops.values()])
