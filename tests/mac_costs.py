"""A catalog Mac's step cost for the pricing tests (speculative decoding, the paged read ratio)."""

from __future__ import annotations

from batchsim.server.models.spec import zoo_spec
from batchsim.server.perf import macs, size_limits
from batchsim.server.perf.gpu_fit import load_fit
from batchsim.server.perf.stepcost import StepCost


def m2_ultra_cost() -> StepCost:
    """llama-3.1-8b in float16 on an M2 Ultra 76c under the shipped fit, 8 GB kept for the OS."""
    catalog = macs.load_catalog()
    (mac,) = [m for m in catalog.chips if m.label == "M2 Ultra 76c"]
    # float16: a verify step's rows stream the weights once (4-bit ones over a few rows run MLX's
    # qmv, each row's arithmetic again: server/perf/qmv.py)
    s = size_limits.Settings("float16", None, None, None, 8.0, fit=load_fit())
    return size_limits.mac_cost(zoo_spec("llama-3.1-8b"), mac, s)
