"""The published fit's least squares (server.published.fit builds the design): a @ theta = 1 on
relative error, robust (Huber weights, IRLS_ROUNDS rounds), every column within its bounds (a time
>= 0, a slowdown from 1 to its cap), each engine's own host terms shrunk towards zero and towards
its kind's mean. Its hyperparameters are this module's constants (nested.applied varies them)."""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import numpy as np
from batchsim.server.perf.engines import load_engine
from batchsim.server.perf.gpu_fit import ULTRA_QMV_TERMS
from batchsim.server.perf.mac_fit import HUBER_DELTA, IRLS_ROUNDS, huber_loss, huber_weights

# (The Ultra qmv slowdowns' columns are their GpuFit fields.) Seconds per count (kept >= 0) and the
# GpuFit field (us) each is written to (attention_row_s is no column: written as 0).
TIMES = {"layer_s": "layer_overhead_us", "forward_s": "forward_overhead_us",
         "attention_row_s": "attention_row_us", "sampling_row_s": "sampling_row_us",
         "ultra_layer_s": "ultra_layer_us", "ultra_moe_layer_s": "ultra_moe_layer_us"}
ENGINE_RIDGE = 0.1  # shrinkage of each engine's own terms (columns scaled to unit norm)
PRIOR_ROWS = 1.0  # the weight of an engine's kind prior, in rows of the engine's own
HOST_PARTS = ("step", "token")  # an engine's host-cost columns: step:NAME, token:NAME
# Device columns shrunk like an engine's own: per-row sampling is, on every row of an engine calling
# its sampler per row, the same column as that engine's per-token host cost (each sampled row is a
# generated token), so only a source running one engine both ways (mlx_lm_1540) tells them apart;
# unshrunk it took every per-row server's per-token cost and priced it on every such engine (held
# out, mlx_lm_1540's per-row rows -43% / -49% at B=8 / 32; shrunk -15% / -19%).
SHRUNK_DEVICE = ("sampling_row_s",)
JITTER = 1e-9  # on the others: collinear columns share rather than fail
# The largest slowdown (1 / efficiency) a rate may take: streaming weights at under a third of the
# peak bandwidth, or matmuls at under a fifth of the peak FLOP/s, is not a Mac GPU's behaviour
# but a term the model lacks, which a free fit would hide there.
# qmv over several rows (server.perf.qmv) multiplies on the SIMD lanes and dequantizes each weight
# again per row: down to 1/30 of the FP16 peak.
# A top-p sampler's bytes (gpu_fit.GpuFit.top_p_slowdown) take qmv's cap: no bound specific to
# sorting is known, and the fitted value (configs/reference/mlx-fit.yaml) is far below it.
MAX_SLOWDOWN = {"bytes": 3.0, "kv": 5.0, "compute": 5.0, "ultra": 2.0, "qmv": 30.0}


def _bounds(col: str) -> tuple[float, float]:
    """What a column's unknown may be: a time >= 0, a slowdown (1 / efficiency) from 1 to its
    cap."""
    if col in TIMES or ":" in col:
        return 0.0, np.inf
    if col == "ultra_bytes":  # added to the format's slowdown
        return 0.0, MAX_SLOWDOWN["ultra"]
    if col in ("c_qmv", "top_p"):
        return 1.0, MAX_SLOWDOWN["qmv"]
    if col in ULTRA_QMV_TERMS:  # added to qmv's slowdown
        return 0.0, MAX_SLOWDOWN["qmv"]
    return 1.0, MAX_SLOWDOWN["kv" if col == "kv" else "compute" if col[:2] == "c_" else "bytes"]


class Shrink(NamedTuple):
    """Penalties: every engine's host terms towards zero (`zero`, by unit-norm column), and each
    kinded engine's host cost per one-row step (its step + token terms) towards the mean of its
    kind's (`pairs`: step column, token column, weight per second squared, kind)."""

    zero: np.ndarray
    pairs: list[tuple[int, int, float, str]]


def _kind(col: str) -> str:
    """The engine kind of a host-cost column ('' for any other column or a kindless engine)."""
    part, _, name = col.partition(":")
    return load_engine(name).kind if part in HOST_PARTS else ""


def _shrink(a: np.ndarray, cols: list[str], free: list[int]) -> Shrink:
    zero, pairs = np.full(len(cols), JITTER), []
    index = {c: j for j, c in enumerate(cols)}
    for j in free:
        part, _, name = cols[j].partition(":")
        if part in HOST_PARTS or cols[j] in SHRUNK_DEVICE:
            zero[j] = ENGINE_RIDGE
        if part == "step" and (kind := _kind(cols[j])):
            k = index[f"token:{name}"]
            # a row's relative error per second of the pair's cost, at batch 1 (step = token)
            per_s = np.linalg.norm((a[:, j] + a[:, k]) / 2)
            pairs.append((j, k, PRIOR_ROWS * per_s**2 / np.count_nonzero(a[:, j]), kind))
    return Shrink(zero, pairs)


def _pull(scale: np.ndarray, keep: list[int], shrink: Shrink
          ) -> tuple[np.ndarray, np.ndarray, Callable[[np.ndarray], np.ndarray]]:
    """(penalty matrix, v, the kind means by pair under a theta) of the pairs on the kept columns:
    each engine's one-row host cost (seconds: step + token, v @ coefficients) towards its kind's
    mean, weighed as one of its rows' relative error squared over PRIOR_ROWS / its rows. The
    penalty's right-hand side is v.T @ (weight * means(theta))."""
    at = {j: i for i, j in enumerate(keep)}
    v = np.zeros((len(shrink.pairs), len(keep)))
    for p, (j, k, _, _) in enumerate(shrink.pairs):
        for c in (j, k):
            if c in at:
                v[p, at[c]] = 1.0 / scale[c]  # the seconds of a unit-norm coefficient
    weight = np.array([w for _, _, w, _ in shrink.pairs])
    steps, tokens = ([pair[i] for pair in shrink.pairs] for i in (0, 1))
    kinds = [kind for *_, kind in shrink.pairs]
    same = np.array([[a == b for b in kinds] for a in kinds], dtype=float)
    same /= np.maximum(same.sum(axis=1, keepdims=True), 1.0)

    def means(theta: np.ndarray) -> np.ndarray:
        return weight * (same @ (theta[steps] + theta[tokens]))

    return (v.T * weight) @ v, v, means


def _lsq(a: np.ndarray, rhs: np.ndarray, keep: list[int], shrink: Shrink,
         row_scale: np.ndarray | None = None) -> np.ndarray:
    """Huber-weighted least squares of a @ theta = rhs over the kept columns (others zero),
    penalised by `shrink` (each kind's mean taken from the round before); `row_scale` multiplies
    each row's IRLS weight (the square root of a row weight: benchmarks/fit_weighting.py)."""
    scale = np.linalg.norm(a, axis=0)
    scale[scale == 0] = 1.0
    an = a[:, keep] / scale[keep]
    pull, v, means = _pull(scale, keep, shrink)
    ridge = np.diag(shrink.zero[keep]) + pull
    theta, w = np.zeros(a.shape[1]), np.ones(a.shape[0])
    for _ in range(IRLS_ROUNDS):
        rw = w if row_scale is None else w * row_scale
        lhs = an * rw[:, None]  # the normal equations: a small square system
        sol = np.linalg.solve(lhs.T @ lhs + ridge, lhs.T @ (rhs * rw) + v.T @ means(theta))
        theta[:] = 0.0
        theta[keep] = sol / scale[keep]
        w = huber_weights(np.abs(a @ theta - rhs), HUBER_DELTA)  # solve's (nested sets it)
    return theta


def _bounded(a: np.ndarray, target: np.ndarray, cols: list[str], free: list[int], shrink: Shrink,
             row_scale: np.ndarray | None) -> np.ndarray:
    """fit_at's theta (_lsq of a @ theta = target over the free columns) within each column's
    bounds: the worst violator is held at its bound and the rest refitted, until none is out. Its
    own function (fit_at its one caller) only to keep fit_at short."""
    free, held = list(free), {}
    while True:
        rhs = target - sum((a[:, j] * v for j, v in held.items()), np.zeros(a.shape[0]))
        theta = _lsq(a, rhs, free, shrink, row_scale)
        out = {j: min(max(theta[j], lo), hi) for j in free
               for lo, hi in [_bounds(cols[j])] if not lo <= theta[j] <= hi}
        if not out:
            break
        j = max(out, key=lambda j: abs(theta[j] - out[j]) / max(abs(out[j]), 1e-9))
        held[j] = out[j]
        free.remove(j)
    for j, v in held.items():
        theta[j] = v
    return theta


def fit_at(a: np.ndarray, cols: list[str], transform: np.ndarray | None = None,
           row_weights: np.ndarray | None = None) -> tuple[float, np.ndarray]:
    """(Huber loss, theta) of a @ theta = 1 within each column's bounds (_bounded). Weighing
    variants (benchmarks/fit_weighting.py): `transform` T fits T @ a @ theta = T @ 1 instead (the
    shrinkage still read off a), `row_weights` weigh each fitted row in the IRLS and the loss."""
    free = [j for j in range(len(cols)) if np.any(a[:, j] > 0)]
    shrink = _shrink(a, cols, free)  # row: (a device product) not shrunk
    target = np.ones(a.shape[0])
    if transform is not None:
        a, target = transform @ a, transform @ target
    row_scale = None if row_weights is None else np.sqrt(row_weights)
    theta = _bounded(a, target, cols, free, shrink, row_scale)
    return huber_loss(np.abs(a @ theta - target), HUBER_DELTA, row_weights), theta
