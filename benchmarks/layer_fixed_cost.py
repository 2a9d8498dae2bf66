r"""The fixed cost of one decoder layer and of one forward pass, measured alone (`calibrate` pins
`layer_overhead_us` to the first, and `layer_overhead_us_by_arch` to other architectures', and
fits the per-forward cost on executor steps; server/measure/fixed_cost.py).

    .venv/bin/python benchmarks/layer_fixed_cost.py [--model tiny] [--batch 1,8] [--steps 30] \
        [--reps 9]

--model calib-sliding, tiny-moe, tiny-hybrid or tiny-mla measures a gpt-oss, Qwen3-MoE, Qwen3-Next
or DeepSeek-V3 layer instead of tiny's llama one.

Prints a line per batch and one JSON line with the environment."""

from __future__ import annotations

import argparse
import dataclasses
import json

from batchsim.server.platform import blas

blas.preload()  # before mlx loads, as the CLI does


def main() -> None:
    from batchsim.server.measure import fixed_cost
    from batchsim.server.platform.env import environment

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="tiny", help="zoo model whose layer is stacked")
    p.add_argument("--batch", default="1,8")
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--reps", type=int, default=9)
    args = p.parse_args()
    costs = fixed_cost.measure(tuple(map(int, args.batch.split(","))), args.steps, args.reps,
                               args.model)
    for c in costs:
        print(f"batch {c.batch:3d}: step us by depth "
              f"{', '.join(f'{d}: {v:.0f}' for d, v in c.step_us_by_depth.items())}; "
              f"{c.layer_us:.0f} us per layer, {c.forward_us:.0f} us per forward")
    print(json.dumps({"rows": [dataclasses.asdict(c) for c in costs],
                      "layer_us": fixed_cost.layer_us(costs),
                      "env": environment(dtype="float32", model=f"{args.model} x depth")}))


if __name__ == "__main__":
    main()
