"""What the paged layout's gather costs one attention layer of a decode step, beside the padded
pool's slice: per batch size, the padded read (K/V[:B, :, :W], then attention), the paged read
(mx.take of each row's blocks into the padded rows' layout, then attention; the executor's) and a
tokens-major block layout (attention on a transposed view), timed interleaved on the same shapes.

    .venv/bin/python benchmarks/paged_gather.py --batch 1,8,32 --context 512

Shapes default to smollm2-135m's (3 KV heads of 64, 9 query heads, float32). Not part of the test
suite; the last stdout line is one JSON document."""

from __future__ import annotations

import argparse
import json
import statistics
import time

from batchsim.server.platform import blas

blas.preload()  # before the first `import mlx`, as the CLI does

import mlx.core as mx
from batchsim.scheduler.pool_geometry import KV_STEP, PAGE_TOKENS, round_up


def _read(step, q, mask):
    k, v = step()
    return mx.fast.scaled_dot_product_attention(q, k, v, scale=0.125, mask=mask)


def _layer(batch: int, context: int, kv_heads: int, q_heads: int, dim: int):
    """The reads of each layout over the same shapes (rows in shuffled blocks), and a query."""
    cap = round_up(context + 1, KV_STEP)
    pad = [mx.random.normal((batch, kv_heads, cap, dim)) for _ in "kv"]
    n = -(-context // PAGE_TOKENS)
    tables = mx.random.permutation(batch * n).reshape(batch, n)
    blocks = [mx.random.normal((batch * n, kv_heads, PAGE_TOKENS, dim)) for _ in "kv"]
    tokens_major = [mx.random.normal((batch * n, PAGE_TOKENS, kv_heads, dim)) for _ in "kv"]
    q = mx.random.normal((batch, q_heads, 1, dim))
    mx.eval(pad, blocks, tokens_major, tables, q)

    def padded():
        return [a[:, :, :context] for a in pad]

    def paged():  # the executor's: paged_store.PagedStep.gather
        return [mx.take(a, tables, axis=0).transpose(0, 2, 1, 3, 4)
                .reshape(batch, kv_heads, n * PAGE_TOKENS, dim)[:, :, :context] for a in blocks]

    def paged_tokens_major():  # (blocks, PAGE_TOKENS, heads, dim): attention reads a transpose
        return [mx.take(a, tables, axis=0).reshape(batch, n * PAGE_TOKENS, kv_heads, dim)
                [:, :context].transpose(0, 2, 1, 3) for a in tokens_major]

    return {"padded": padded, "paged": paged, "paged_tokens_major": paged_tokens_major}, q


def _time(fn, q, reps: int) -> float:
    t0 = time.perf_counter()
    for _ in range(reps):
        mx.eval(_read(fn, q, None))
    return (time.perf_counter() - t0) / reps


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--batch", default="1,8,32")
    p.add_argument("--context", type=int, default=512)
    p.add_argument("--kv-heads", type=int, default=3)
    p.add_argument("--q-heads", type=int, default=9)
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--reps", type=int, default=20, help="reads per timed window")
    p.add_argument("--windows", type=int, default=7, help="windows per layout, interleaved")
    args = p.parse_args()
    rows = []
    for b in (int(x) for x in args.batch.split(",")):
        fns, q = _layer(b, args.context, args.kv_heads, args.q_heads, args.head_dim)
        t: dict[str, list[float]] = {k: [] for k in fns}
        for _ in range(args.windows + 1):  # the first window warms up
            for k, fn in fns.items():
                t[k].append(_time(fn, q, args.reps))
        row = {"batch": b, "context": args.context}
        for k in fns:
            row[f"{k}_ms"] = 1e3 * statistics.median(t[k][1:])
            row[f"{k}_over_padded_paired"] = statistics.median(
                a / p for a, p in zip(t[k][1:], t["padded"][1:]))
        rows.append(row)
        print(f"batch {b:3d} context {args.context}: " + ", ".join(
            f"{k} {row[f'{k}_ms']:.3f} ms (x{row[f'{k}_over_padded_paired']:.2f})" for k in fns))
    print(json.dumps({"rows": rows, "backend": str(mx.default_device())}))


if __name__ == "__main__":
    main()
