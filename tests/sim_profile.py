"""A small calibrated device profile for simulated runs in tests (20 GB/s, 0.1 TFLOP/s float32):
steps cost enough to order and compare, on any machine."""

from __future__ import annotations

from batchsim.server.perf.profile import Calibration, DeviceProfile, GemmFit

PROFILE = DeviceProfile(
    name="test", bandwidth_gbs=20.0, peak_tflops={"float32": 0.1}, bandwidth_efficiency=1.0,
    compute_efficiency=1.0,
    calibration=Calibration(
        gemm={"float32": GemmFit(weight_ns={10_000: 0.6, 10_000_000: 0.2},
                                 flop_ns={1: 0.05, 64: 0.02})},
        attention_decode_ns_per_byte=0.3, attention_prefill_ns_per_flop=0.02,
        attention_prefill_ns_per_score_byte=0.4,
        elementwise_ns_per_byte=0.5, layer_overhead_us=40.0, forward_overhead_us=300.0,
        copy_gbs=5.0, step_overhead_us=200.0, attention_decode_ns_per_score=20.0,
    ),
)
