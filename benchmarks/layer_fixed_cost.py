"""The fixed cost of one decoder layer, measured directly: the same tiny llama layer (hidden 64,
so its matmuls and attention cost next to nothing) stacked 2, 8 and 16 deep, random weights,
decoded by a bare mlx-lm loop with the depths interleaved window by window.

    .venv/bin/python benchmarks/layer_fixed_cost.py [--batch 1,8] [--steps 30] [--reps 9]

The slope of step time over depth is the per-layer fixed cost (op dispatch, graph building) that
`calibrate` fits as `layer_overhead_us`; the intercept is the per-forward one
(`forward_overhead_us`). The calibration separates them only through models of different depth
whose other costs it must also explain; this measures them alone. Prints one JSON line."""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

from batchsim.server.platform import blas

blas.preload()  # before mlx loads, as the CLI does

DEPTHS = (2, 8, 16)
TINY = Path(__file__).resolve().parents[1] / "configs" / "models" / "tiny.yaml"


def main() -> None:
    import yaml
    from batchsim.server.measure.decode_bench import Bare
    from batchsim.server.platform.env import environment
    from mlx_lm.utils import _get_classes

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--batch", default="1,8")
    p.add_argument("--context", type=int, default=64)
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--reps", type=int, default=9)
    args = p.parse_args()
    config = yaml.safe_load(TINY.read_text())["config"]
    models = {}
    for depth in DEPTHS:
        cfg = dict(config, num_hidden_layers=depth)
        model_cls, args_cls = _get_classes(cfg)
        models[depth] = model_cls(args_cls.from_dict(cfg))
    rows = []
    for batch in map(int, args.batch.split(",")):
        runners = {d: Bare(m, batch, args.context, config["vocab_size"]) for d, m in models.items()}
        samples: dict[int, list[float]] = {d: [] for d in runners}
        for _ in range(args.reps):
            for d, r in runners.items():  # interleaved: drift hits every depth alike
                samples[d].append(r.steps(args.steps) / args.steps * 1e6)
        us = {d: statistics.median(v) for d, v in samples.items()}
        per_layer = (us[DEPTHS[-1]] - us[DEPTHS[0]]) / (DEPTHS[-1] - DEPTHS[0])
        rows.append({"batch": batch, "step_us_by_depth": us, "layer_us": per_layer,
                     "forward_us": us[DEPTHS[0]] - DEPTHS[0] * per_layer})
        print(f"batch {batch:3d}: step us by depth {', '.join(f'{d}: {v:.0f}' for d, v in us.items())}"
              f"; {per_layer:.0f} us per layer, {rows[-1]['forward_us']:.0f} us per forward")
    print(json.dumps({"rows": rows, "env": environment(dtype="float32", model="tiny x depth")}))


if __name__ == "__main__":
    main()
