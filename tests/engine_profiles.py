"""Profiles for the engine-term tests: a catalog Mac with every per-row term and quantized ceiling
unset (`bare_mac`), and an engine profile with only the host costs a test names (`host_engine`)."""

from __future__ import annotations

import dataclasses

from batchsim.server.perf import macs
from batchsim.server.perf.engines import EngineProfile
from batchsim.server.perf.gpu_fit import load_fit, mac_profile


def bare_mac(label: str = "M4 Max 40c", quantize_bits: int | None = 4):
    """A catalog Mac's profile under the shipped fit with the per-row terms and quantized
    ceilings unset (each test sets the one it checks)."""
    mac, _ = macs.load_catalog().variant(label)
    fit = dataclasses.replace(load_fit(), attention_row_us=0.0, kv_bandwidth_efficiency=0.0,
                              token_layer_us=0.0, sampling_row_us=0.0, quantized_gemm_efficiency={},
                              top_p_slowdown=0.0)
    return mac_profile(mac, fit, quantize_bits)


def host_engine(**kw) -> EngineProfile:
    """An engine profile with no host costs but the ones given."""
    return EngineProfile(**{"name": "test", "host_step_us": 0.0, "host_token_us": 0.0, **kw})
