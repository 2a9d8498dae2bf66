"""What a routed (token, expert) pair costs, measured alone on mlx-lm's SwitchGLU (`calibrate` pins
`experts_ns_per_pair` and `experts_ns_per_mac` to it; server/measure/expert_cost.py).

    .venv/bin/python benchmarks/expert_cost.py [--reps 5]

Prints microseconds per call by expert geometry and token count, what the fitted terms predict
for each, the growth checks the test suite once timed (tests/test_expert_term.py now counts the
work instead: a timed ratio failed under load), and one JSON line with the terms, the checks and
the environment. Exit 1 when a check fails."""

from __future__ import annotations

import argparse
import json
import sys

from batchsim.server.platform import blas

blas.preload()  # before mlx loads, as the CLI does
GROWTH_MIN = 4.0


def main() -> None:
    from batchsim.server.measure import expert_cost
    from batchsim.server.measure.microbench import cache_limit, measure_bandwidth_gbs
    from batchsim.server.platform.env import environment

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--reps", type=int, default=5)
    args = p.parse_args()
    with cache_limit():  # as calibrate measures it: freed buffers reused, not re-faulted
        bandwidth_gbs = measure_bandwidth_gbs()
    c = expert_cost.measure(bandwidth_gbs, args.reps)
    print(f"bandwidth {bandwidth_gbs:.1f} GB/s; {c.ns_per_pair:.0f} ns per pair + "
          f"{c.ns_per_mac:.3f} ns per multiply-add (x3 matrix stacks)")
    for (h, i, e, k, t), us in c.us_by_point.items():
        pairs = expert_cost.STACKS * t * k
        model_us = (expert_cost.streamed_bytes(h, i, e, k, t) / bandwidth_gbs
                    + pairs * (c.ns_per_pair + h * i * c.ns_per_mac)) / 1e3
        print(f"hidden {h:4d} expert {i:4d} E {e:3d} top {k}  tokens {t:4d}: {us:9.1f} us "
              f"(pairs and streamed weights: {model_us:9.1f} us, the rest the call's own)")
    us = c.us_by_point
    growth = {  # each expected above GROWTH_MIN: more routed pairs, bigger experts
        "256x256 experts, 64 tokens over 1": us[(256, 256, 8, 2, 64)] / us[(256, 256, 8, 2, 1)],
        "64 tokens, 256x256 experts over 64x32": us[(256, 256, 8, 2, 64)] / us[(64, 32, 8, 2, 64)],
    }
    for name, ratio in growth.items():
        print(f"{name}: {ratio:.1f}x (expected > {GROWTH_MIN:g}x)")
    print(json.dumps({"ns_per_pair": c.ns_per_pair, "ns_per_mac": c.ns_per_mac,
                      "bandwidth_gbs": bandwidth_gbs, "growth": growth,
                      "us_by_point": [[*key, us] for key, us in c.us_by_point.items()],
                      "env": environment(dtype="float32", model="SwitchGLU")}))
    if min(growth.values()) <= GROWTH_MIN or c.ns_per_pair < 0 or c.ns_per_mac <= 0:
        sys.exit(1)


if __name__ == "__main__":
    main()
