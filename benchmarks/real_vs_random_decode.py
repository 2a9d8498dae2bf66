"""Decode tok/s of the real-weight SmolLM2-135M-Instruct against the random-weight model of the
same shapes, and the real model's stored forms, window by window interleaved in one process.

    .venv/bin/python benchmarks/real_vs_random_decode.py [--batch 1,8] [--context 128] [--reps 4]

Same shapes and dtype should decode at the same speed (weight values do not change the work);
the kept-quantized form shows why the CPU backend stores a dense copy. Prints one JSON line."""

from __future__ import annotations

import argparse
import json
import statistics

from batchsim.server.platform import blas

blas.preload()  # before mlx loads, as the CLI does

FORMS = {  # name: (zoo model, dtype, quantize_bits)
    "real-dense": ("smollm2-135m-instruct", "float32", None),
    "random-dense": ("smollm2-135m", "float32", None),
    "real-q4-float32-scales": ("smollm2-135m-instruct", "float32", 4),
}


def main() -> None:
    from batchsim.server.measure.decode_bench import Bare
    from batchsim.server.models.loader import load, resolve

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--batch", default="1,8")
    p.add_argument("--context", type=int, default=128)
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--reps", type=int, default=4)
    args = p.parse_args()
    models = {k: load(resolve(*form))[0] for k, form in FORMS.items()}
    rows = []
    for batch in map(int, args.batch.split(",")):
        runners = {k: Bare(m, batch, args.context, 49152) for k, m in models.items()}
        samples: dict[str, list[float]] = {k: [] for k in runners}
        for _ in range(args.reps):
            for k, r in runners.items():  # interleaved: drift hits every form alike
                samples[k].append(batch * args.steps / r.steps(args.steps))
        for k, v in samples.items():
            rows.append({"batch": batch, "form": k, "decode_tok_s": statistics.median(v)})
            print(f"batch {batch:3d} {k:24s} {statistics.median(v):8.1f} tok/s")
    print(json.dumps({"rows": rows}))


if __name__ == "__main__":
    main()
