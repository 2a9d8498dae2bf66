"""What a routed (token, expert) pair costs, measured on its own: mlx-lm's SwitchGLU (the routed
experts of Qwen3-MoE, gpt-oss, DeepSeek-V3 and Qwen3-Next) over T tokens, each routed to top_k of
E experts, for a few expert geometries, with enough copies of the weights cycled that they come
from memory, as a model's layers do. Per call:

    c + D(T) * streamed weight bytes + 3 * T * top_k * (a + b * in * out)

D(T) the distinct experts the tokens reach, 3 the gate, up and down matrix stacks; c (per geometry:
the module's op dispatch, in the layer's fixed cost) is fitted and dropped, `a` (per pair: gathers,
sorting, the activation) and `b` (per routed multiply-add) are shared and `calibrate` pins them.

On MLX's CPU backend gather_mm multiplies pair by pair, a mat-vec each, at ~0.27 ns per
multiply-add on a 2-core EPYC VM whatever the batch; the GEMM rate a batched expert would reach is
no guide. Fitted instead on the MoE calibration models' executor steps, the per-MAC term came out
at half that (0.10-0.20 ns, moving between calibrations) and small-moe's prefill chunks were
predicted 25-37% fast."""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass

import numpy as np
from batchsim.server.perf.layer_cost import expected_experts

# (hidden, expert intermediate, experts, top_k): none a validation model's.
GEOMETRIES = ((64, 32, 8, 2), (128, 64, 16, 4), (256, 256, 8, 2), (512, 128, 32, 4))
TOKENS = (1, 2, 4, 8, 16, 32, 64, 128)  # SwitchGLU sorts the pairs by expert from 64 on
STACKS = 3  # gate, up and down projections
MAX_COPIES = 256
BYTES_PER_WEIGHT = 4  # float32, as calibrate measures
POINT = ("hidden", "inter", "experts", "top_k", "tokens")  # what a us_by_point key holds


@dataclass(frozen=True)
class ExpertCost:
    ns_per_pair: float
    ns_per_mac: float
    us_by_point: dict[tuple[int, int, int, int, int], float]  # POINT -> us per call

    def rows(self) -> list[dict[str, float]]:
        """Every timed point as a record: POINT's fields and `us`."""
        return [dict(zip(POINT, point), us=us) for point, us in self.us_by_point.items()]


def streamed_bytes(hidden: int, inter: int, experts: int, top_k: int, tokens: int) -> float:
    """Weight bytes one SwitchGLU call streams: each distinct expert's three matrices, once."""
    return expected_experts(experts, top_k, tokens) * STACKS * hidden * inter * BYTES_PER_WEIGHT


def _copies(hidden: int, inter: int, experts: int) -> int:
    from batchsim.server.measure.microbench import working_set_bytes

    stack_bytes = STACKS * experts * hidden * inter * BYTES_PER_WEIGHT
    return max(1, min(MAX_COPIES, working_set_bytes() // stack_bytes))


def _time_us(geometry: tuple[int, int, int, int], tokens: tuple[int, ...],
             reps: int) -> dict[int, float]:
    """Median microseconds per SwitchGLU call at each token count (interleaved, so a shared
    machine's slow seconds spread over all of them), weights cycled from memory."""
    import mlx.core as mx
    from mlx_lm.models.switch_layers import SwitchGLU

    hidden, inter, experts, top_k = geometry
    mods = [SwitchGLU(hidden, inter, experts) for _ in range(_copies(hidden, inter, experts))]
    mx.eval([m.parameters() for m in mods])
    inputs = {}
    for t in tokens:
        routes = mx.argsort(mx.random.uniform(shape=(1, t, experts)), axis=-1)[..., :top_k]
        inputs[t] = (mx.random.normal((1, t, hidden)), routes.astype(mx.uint32))
    mx.eval(list(inputs.values()))
    samples: dict[int, list[float]] = {t: [] for t in tokens}
    for _ in range(reps + 1):  # the first pass warms up
        for t, (x, routes) in inputs.items():
            t0 = time.perf_counter()
            mx.eval([m(x, routes) for m in mods])
            samples[t].append((time.perf_counter() - t0) / len(mods) * 1e6)
    return {t: statistics.median(v[1:]) for t, v in samples.items()}


def fit(us_by_point: dict[tuple[int, int, int, int, int], float],
        bandwidth_gbs: float) -> tuple[float, float]:
    """(ns per pair, ns per multiply-add): least squares on relative error over what the streamed
    weights leave, an intercept per geometry; neither below 0 (the better single term when both
    cannot be)."""
    geoms = sorted({p[:4] for p in us_by_point})
    rows, target = [], []
    for (h, i, e, k, t), us in us_by_point.items():
        pairs = STACKS * t * k
        rows.append([float((h, i, e, k) == g) for g in geoms] + [pairs, pairs * h * i])
        target.append(us * 1e3 - streamed_bytes(h, i, e, k, t) / bandwidth_gbs)  # ns
    scale = np.asarray([us * 1e3 for us in us_by_point.values()])
    a, y = np.asarray(rows) / scale[:, None], np.asarray(target) / scale
    n = len(geoms)
    coef = np.linalg.lstsq(a, y, rcond=None)[0]
    if (coef[n:] >= 0).all():
        return float(coef[n]), float(coef[n + 1])
    fits = []
    for col in (n, n + 1):
        cols = [*range(n), col]
        c = np.linalg.lstsq(a[:, cols], y, rcond=None)[0]
        fits.append((float(np.sum((a[:, cols] @ c - y) ** 2)), col - n, max(0.0, float(c[-1]))))
    _, which, value = min(fits)
    return (value, 0.0) if which == 0 else (0.0, value)


def measure(bandwidth_gbs: float, reps: int = 5, geometries=GEOMETRIES,
            tokens=TOKENS) -> ExpertCost:
    us = {(*g, t): v for g in geometries for t, v in _time_us(g, tokens, reps).items()}
    pair_ns, mac_ns = fit(us, bandwidth_gbs)
    return ExpertCost(pair_ns, mac_ns, us)
