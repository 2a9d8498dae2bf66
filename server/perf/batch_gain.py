"""The batching-gain curve from the performance model: decode tok/s at batch B over tok/s at batch
1, each row reading `context` cached tokens. An MoE model's gain is small because every extra row
routes to experts no other row read (more weight bytes), where a dense model's rows share all of
them. `python -m batchsim.server.perf.batch_gain [model ...]` prints the table on an M4 Max."""

from __future__ import annotations

import sys

from batchsim.server.models.spec import zoo_spec
from batchsim.server.perf import macs
from batchsim.server.perf.gpu_fit import load_fit
from batchsim.server.perf.size_limits import Settings, decode_step, mac_cost, tok_s
from batchsim.server.perf.stepcost import StepCost

BATCHES = (1, 2, 4, 8, 16, 32, 64)


def batching_curve(cost: StepCost, context: int, batches=BATCHES) -> dict[int, float]:
    """Predicted decode tok/s at each batch size."""
    return {b: tok_s(decode_step(cost, b, context), b) for b in batches}


def catalog_cost(model: str, label: str = "M4 Max 40c", quantize_bits: int | None = 4) -> StepCost:
    """`size`'s step cost for a zoo model on a catalog Mac (the fitted GPU step)."""
    catalog = macs.load_catalog()
    (mac,) = [m for m in catalog.chips if m.label == label]
    return mac_cost(zoo_spec(model), mac, Settings("float16", quantize_bits, None, None, 8.0,
                                                   fit=load_fit()))


def main(models: list[str], context: int = 1024) -> None:
    print(f"decode tok/s (gain over batch 1), 4-bit, M4 Max 40c, context {context}")
    print("batch  " + "  ".join(f"{m:>24}" for m in models))
    curves = [batching_curve(catalog_cost(m), context) for m in models]
    for b in BATCHES:
        cells = [f"{c[b]:>14.0f} ({c[b] / c[1]:5.2f}x)" for c in curves]
        print(f"{b:>5}  " + "  ".join(f"{x:>24}" for x in cells))


if __name__ == "__main__":
    main(sys.argv[1:] or ["qwen3-30b-a3b", "qwen3-8b"])
