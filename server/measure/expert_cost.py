"""The per-pair cost of a gathered expert matmul, measured on its own: MLX's `gather_mm` (what
mlx-lm's SwitchGLU runs for each expert matrix stack) over P (token, expert) pairs, for experts of
a few sizes and two pair counts. Time per call = c + P * (a + b * in * out): `a` is what a pair
costs beyond its multiply-adds, `b` what each multiply-add costs, `c` the op's own launch (already
in the per-layer fixed cost). `calibrate` pins `experts_ns_per_pair` to `a`: fitted beside `b` on
the MoE models' steps, the two are nearly collinear (two models), and the per-pair term soaked up
noise (2,000 ns per pair on a 2-core EPYC VM, where this measurement finds ~0) and priced another
MoE architecture's experts 40% high."""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass

import numpy as np

SHAPES = ((64, 32), (64, 64), (256, 128), (256, 256))  # expert matrices (in, out)
PAIRS = (128, 512)  # SwitchGLU sorts tokens by expert from 64 pairs on: the batched regime
EXPERTS = 8


@dataclass(frozen=True)
class ExpertCost:
    ns_per_pair: float
    ns_per_mac: float
    us_by_point: dict[tuple[int, int, int], float]  # (pairs, in, out) -> median us per call


def _time_call_us(pairs: int, k: int, n: int, reps: int, calls: int = 10) -> float:
    import mlx.core as mx

    x = mx.random.normal((pairs, 1, k))
    w = mx.random.normal((EXPERTS, k, n))
    idx = mx.sort(mx.random.randint(0, EXPERTS, (pairs,)).astype(mx.uint32))
    mx.eval(x, w, idx)
    samples = []
    for _ in range(reps):
        t0 = time.perf_counter()
        for _ in range(calls):
            mx.eval(mx.gather_mm(x, w, rhs_indices=idx, sorted_indices=True))
        samples.append((time.perf_counter() - t0) / calls * 1e6)
    return statistics.median(samples)


def fit(us_by_point: dict[tuple[int, int, int], float]) -> tuple[float, float]:
    """(ns per pair, ns per multiply-add), least squares with a per-call constant, neither below
    0 (the better single term when both cannot be)."""
    points = list(us_by_point)
    a = np.asarray([[1.0, p, p * k * n] for p, k, n in points])
    y = np.asarray([us_by_point[x] * 1e3 for x in points])  # ns
    coef = np.linalg.lstsq(a, y, rcond=None)[0]
    if (coef[1:] >= 0).all():
        return float(coef[1]), float(coef[2])
    fits = []
    for col in (1, 2):
        c = np.linalg.lstsq(a[:, [0, col]], y, rcond=None)[0]
        fits.append((float(np.sum((a[:, [0, col]] @ c - y) ** 2)), col, max(0.0, float(c[1]))))
    _, col, value = min(fits)
    return (value, 0.0) if col == 1 else (0.0, value)


def measure(reps: int = 7) -> ExpertCost:
    us = {(p, k, n): _time_call_us(p, k, n, reps) for k, n in SHAPES for p in PAIRS}
    pair_ns, mac_ns = fit(us)
    return ExpertCost(pair_ns, mac_ns, us)
