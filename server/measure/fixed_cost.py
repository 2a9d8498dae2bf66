"""The fixed cost of a decoder layer and of a forward pass, measured on their own: tiny's llama
layer (hidden 64: its matmuls and attention cost next to nothing) stacked 4, 8 and 16 deep, random
weights, decoded by a bare mlx-lm loop with the depths interleaved window by window. The slope of
step time over depth is the per-layer cost (op dispatch, graph building), the intercept the bare
loop's per-forward one. `calibrate` pins `layer_overhead_us` to the slope: fitted beside the other
terms on models of a few depths, the per-layer and per-forward costs trade places from machine to
machine. The per-forward cost stays fitted, on executor steps: the executor's own work per step
(its pool, sampling, reading tokens back) is not in the bare loop's intercept (55 us there against
259 us fitted on a 2-core EPYC VM, where tiny's executor steps were predicted 47% fast with 55).

Other architectures' layers dispatch more ops than llama's (a router, gathered expert matmuls,
sinks, MLA's latent projections, a gated-delta recurrence), so each is measured the same way on a
small calibration model of its own (ARCH_MODELS) and priced per layer of that architecture
(`layer_overhead_us_by_arch`): on a 2-core EPYC VM a gpt-oss layer costs 1.2-1.4x a llama one,
and priced as llama layers, gpt-oss models were predicted 15-35% fast. What a routed expert costs
per token is not what this prices (the stacked layers decode at batch 1 and 8): expert_cost.py
measures that."""

from __future__ import annotations

import statistics
from dataclasses import dataclass

DEPTHS = (4, 8, 16)  # multiples of 4: a hybrid stack holds whole periods (3 linear, 1 full)
CONTEXT = 64  # tokens each row holds before the timed steps
DENSE_MODEL = "tiny"  # its llama layer prices every layer of an architecture not measured
# The calibration model whose layer stands for each other architecture (none is a validation model).
ARCH_MODELS = {"qwen3_moe": "tiny-moe", "gpt_oss": "calib-sliding", "qwen3_next": "tiny-hybrid",
               "deepseek_v3": "tiny-mla"}


@dataclass(frozen=True)
class FixedCost:
    batch: int
    step_us_by_depth: dict[int, float]
    layer_us: float
    forward_us: float


def measure(batches: tuple[int, ...] = (1, 8), steps: int = 30, reps: int = 9,
            model: str = DENSE_MODEL) -> list[FixedCost]:
    """`model`: a zoo model whose layer is stacked: every layer its common kind (an MoE model's
    dense-only layers made MoE), its default pattern of sliding and full or linear and full
    attention."""
    return measure_many([model], batches, steps, reps)[model]


def measure_all(batches: tuple[int, ...] = (1, 8), steps: int = 30,
                reps: int = 9) -> dict[str, list[FixedCost]]:
    """The dense layer (key "dense") and each architecture of ARCH_MODELS (by model type)."""
    names = {"dense": DENSE_MODEL, **ARCH_MODELS}
    costs = measure_many(list(names.values()), batches, steps, reps)
    return {key: costs[model] for key, model in names.items()}


def measure_many(names: list[str], batches: tuple[int, ...], steps: int,
                 reps: int) -> dict[str, list[FixedCost]]:
    """measure() of several models, every depth of every model interleaved window by window: a
    shared machine's drift then hits them all alike instead of reading as a difference between
    architectures."""
    from batchsim.server.measure.decode_bench import Bare

    stacks = {name: _stacks(name) for name in names}
    out: dict[str, list[FixedCost]] = {name: [] for name in names}
    for batch in batches:
        runners = {(name, d): Bare(m, batch, CONTEXT, vocab) for name, (ms, vocab) in stacks.items()
                   for d, m in ms.items()}
        samples: dict[tuple[str, int], list[float]] = {key: [] for key in runners}
        for _ in range(reps):
            for key, r in runners.items():
                samples[key].append(r.steps(steps) / steps * 1e6)
        for name in names:
            us = {d: statistics.median(samples[(name, d)]) for d in DEPTHS}
            layer = (us[DEPTHS[-1]] - us[DEPTHS[0]]) / (DEPTHS[-1] - DEPTHS[0])
            out[name].append(FixedCost(batch, us, layer,
                                       max(0.0, us[DEPTHS[0]] - DEPTHS[0] * layer)))
    return out


def _stacks(name: str) -> tuple[dict, int]:
    """({depth: the model's layer stacked that deep, random weights}, its vocabulary size)."""
    from batchsim.configs import load_yaml
    from batchsim.server.models.spec import MODELS_DIR
    from mlx_lm.utils import _get_classes

    config = load_yaml(MODELS_DIR / f"{name}.yaml")["config"]
    models = {}
    for depth in DEPTHS:
        cfg = dict(config, num_hidden_layers=depth)
        cfg.pop("layer_types", None)
        if cfg.get("mlp_only_layers"):
            cfg["mlp_only_layers"] = []
        model_cls, args_cls = _get_classes(cfg)
        models[depth] = model_cls(args_cls.from_dict(cfg))
    return models, config["vocab_size"]


def layer_us(costs: list[FixedCost]) -> float:
    """One per-layer cost for the simulator: the mean over the measured batches."""
    return statistics.mean(c.layer_us for c in costs)


def pinned_terms(costs: dict[str, list[FixedCost]]) -> dict[str, object]:
    """The Calibration terms measure_all's costs pin: the dense per-layer cost and each other
    architecture's."""
    return {"layer_overhead_us": layer_us(costs["dense"]),
            "layer_overhead_us_by_arch": {a: layer_us(c) for a, c in costs.items() if a != "dense"}}
