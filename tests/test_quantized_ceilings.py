"""Quantized ceilings (issue 36): a quantized layer's bytes at the quantized GEMV rate, its
arithmetic at the quantized GEMM rate (split from test_engines.py)."""

from __future__ import annotations

import dataclasses

import pytest
from batchsim.server.models.spec import zoo_spec
from batchsim.server.perf.stepcost import StepCost
from batchsim.server.perf.weight_bytes import matrix_weight_bytes

from tests.engine_profiles import bare_mac
from tests.sim_profile import PROFILE


# -- quantized ceilings (issue 36): a quantized layer's bytes at the quantized GEMV rate, its
# arithmetic at the quantized GEMM rate -----------------------------------------------------------
def test_quantized_gemm_ceiling_stops_a_quantized_batch_scaling():
    """The H200 case of issue 36: 4-bit GEMMs topping out near 5 TFLOP/s. With that ceiling,
    decode tok/s saturates near ceiling / (2 x params); without it, the float peak binds."""
    spec = zoo_spec("llama-3.1-8b")
    base = bare_mac()
    capped = StepCost(spec, dataclasses.replace(base, quantized_gemm_gflops={4: 5000.0}),
                      "float16", 4)
    free = StepCost(spec, base, "float16", 4)
    tok_s = {b: b / capped.step_time(decode_rows=b, width=128).total_s for b in (1, 32, 128, 512)}
    assert tok_s[512] / tok_s[128] < 1.1  # stopped scaling
    flops_per_token = 2 * sum(o * i for o, i in spec.layer_linear_shapes) * spec.num_layers
    assert tok_s[512] < 5e12 / flops_per_token
    assert capped.step_time(decode_rows=512, width=128).matmul_s > 2 * free.step_time(
        decode_rows=512, width=128).matmul_s
    # Batch 1 streams bytes: the GEMM ceiling does not touch it; a GEMV ceiling does.
    assert capped.decode_time(1, 128).total_s == free.decode_time(1, 128).total_s
    gemv = StepCost(spec, dataclasses.replace(base, quantized_gemv_gbs={4: base.bytes_per_s / 2e9}),
                    "float16", 4)
    assert gemv.decode_time(1, 128).weights_s == pytest.approx(
        2 * free.decode_time(1, 128).weights_s)
    # Another bit width, or float weights, keep the float ceilings.
    assert StepCost(spec, capped.profile, "float16", 8).matmul_rates == StepCost(
        spec, base, "float16", 8).matmul_rates
    float_rates = StepCost(spec, capped.profile, "float16", None).matmul_rates
    assert float_rates[1] == base.flops_per_s("float16")


def test_quantized_ceilings_price_routed_experts():
    spec = zoo_spec("qwen3-30b-a3b")
    base = bare_mac()
    capped = StepCost(spec, dataclasses.replace(base, quantized_gemm_gflops={4: 2000.0},
                                                quantized_gemv_gbs={4: 100.0}), "float16", 4)
    free = StepCost(spec, base, "float16", 4)
    assert capped.decode_time(1, 128).experts_s > 2 * free.decode_time(1, 128).experts_s
    assert capped.decode_time(256, 128).experts_s > 2 * free.decode_time(256, 128).experts_s


def test_a_calibrated_profile_prices_quantized_weights_at_its_ceilings(tmp_path):
    """The CPU profile calibrated float32 only: quantized weights were an error; with measured
    quantized rates in its YAML (as `calibrate` writes them) they are priced at those rates,
    routed experts' weights included."""
    import yaml
    from batchsim.server.perf.devices import load_profile, save_profile

    with pytest.raises(ValueError, match="no GEMM calibration for q4"):
        StepCost(zoo_spec("smollm2-135m"), PROFILE, "float16", 4)
    path = save_profile(dataclasses.replace(PROFILE, quantized_gemv_gbs={4: 20.0, 8: 25.0},
                                            quantized_gemm_gflops={4: 50.0}), tmp_path / "q.yaml")
    assert yaml.safe_load(path.read_text())["quantized_gemv_gbs"] == {4: 20.0, 8: 25.0}
    profile = load_profile(path)
    assert profile.quantized_gemv_gbs == {4: 20.0, 8: 25.0}
    cost = StepCost(zoo_spec("smollm2-135m"), profile, "float16", 4)
    assert cost.matmul_rates == (20e9, 50e9)
    t = cost.decode_time(1, 64)
    assert t.matmul_s > 0 and t.weights_s == 0  # 50 GFLOP/s binds even one row here
    moe = StepCost(zoo_spec("tiny-moe"), profile, "float16", 4)  # experts_ns_per_mac is set
    assert moe.weight_stream_s(64, 128) == pytest.approx(matrix_weight_bytes("q4", 64, 128) / 20e9)
    slower = StepCost(zoo_spec("tiny-moe"), dataclasses.replace(
        profile, quantized_gemv_gbs={4: 10.0}), "float16", 4)
    assert slower.decode_time(1, 64).experts_s > moe.decode_time(1, 64).experts_s
