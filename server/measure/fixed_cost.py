"""The fixed cost of a decoder layer and of a forward pass, measured on their own: tiny's llama
layer (hidden 64: its matmuls and attention cost next to nothing) stacked 2, 8 and 16 deep, random
weights, decoded by a bare mlx-lm loop with the depths interleaved window by window. The slope of
step time over depth is the per-layer cost (op dispatch, graph building), the intercept the bare
loop's per-forward one. `calibrate` pins `layer_overhead_us` to the slope: fitted beside the other
terms on models of a few depths, the per-layer and per-forward costs trade places from machine to
machine. The per-forward cost stays fitted, on executor steps: the executor's own work per step
(its pool, sampling, reading tokens back) is not in the bare loop's intercept (55 us there against
259 us fitted on a 2-core EPYC VM, where tiny's executor steps were predicted 47% fast with 55)."""

from __future__ import annotations

import statistics
from dataclasses import dataclass

DEPTHS = (2, 8, 16)
CONTEXT = 64  # tokens each row holds before the timed steps


@dataclass(frozen=True)
class FixedCost:
    batch: int
    step_us_by_depth: dict[int, float]
    layer_us: float
    forward_us: float


def measure(batches: tuple[int, ...] = (1, 8), steps: int = 30, reps: int = 9,
            model: str = "tiny") -> list[FixedCost]:
    """`model`: a zoo model whose layer is stacked (tiny for calibrate; another architecture's tiny
    model shows what its layer costs: every layer of its own kind, the default alternation of
    sliding and full attention)."""
    from batchsim.configs import load_yaml
    from batchsim.server.measure.decode_bench import Bare
    from batchsim.server.models.spec import MODELS_DIR
    from mlx_lm.utils import _get_classes

    config = load_yaml(MODELS_DIR / f"{model}.yaml")["config"]
    models = {}
    for depth in DEPTHS:
        cfg = dict(config, num_hidden_layers=depth)
        cfg.pop("layer_types", None)
        if cfg.get("mlp_only_layers"):
            cfg["mlp_only_layers"] = []
        model_cls, args_cls = _get_classes(cfg)
        models[depth] = model_cls(args_cls.from_dict(cfg))
    out = []
    for batch in batches:
        runners = {d: Bare(m, batch, CONTEXT, config["vocab_size"]) for d, m in models.items()}
        samples: dict[int, list[float]] = {d: [] for d in runners}
        for _ in range(reps):
            for d, r in runners.items():  # interleaved: drift hits every depth alike
                samples[d].append(r.steps(steps) / steps * 1e6)
        us = {d: statistics.median(v) for d, v in samples.items()}
        layer = (us[DEPTHS[-1]] - us[DEPTHS[0]]) / (DEPTHS[-1] - DEPTHS[0])
        out.append(FixedCost(batch, us, layer, max(0.0, us[DEPTHS[0]] - DEPTHS[0] * layer)))
    return out


def pinned_terms(costs: list[FixedCost]) -> dict[str, float]:
    """The Calibration term they pin: the per-layer cost, the mean over the measured batches."""
    return {"layer_overhead_us": statistics.mean(c.layer_us for c in costs)}
