"""Measure this device for the simulator: a GEMM timing model, copy bandwidth, and the remaining
per-forward terms fitted on real executor steps of calibration models.

The GEMM model is device-level (shapes on a grid, no model involved); attention, elementwise and
fixed costs are fitted on decode and prefill steps of two models of different depth, so a per-layer
cost can be told from a per-forward one. Models used for validation must not be used here."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence

import mlx.core as mx
import numpy as np
from batchsim.scheduler.config import SchedulerConfig
from batchsim.scheduler.kv_bytes import CacheLayout
from batchsim.scheduler.plan import StepPlan
from batchsim.scheduler.pool_geometry import KV_STEP, PoolGeometry, round_up
from batchsim.scheduler.request import Request, SamplingParams
from batchsim.scheduler.scheduler import Scheduler
from batchsim.server.executors.mlx_executor import MLXExecutor
from batchsim.server.measure.microbench import median_time_s, working_set_bytes
from batchsim.server.measure.prefilled import prefilled
from batchsim.server.models.spec import ModelSpec
from batchsim.server.perf.profile import Calibration, GemmFit
from batchsim.server.perf.stepcost import StepCost

# Every row count up to 32, then steps of 8: CPU BLAS kernels block rows by the vector width (16
# float32 on AVX-512), so m = 12 or 24 can take longer than m = 16 or 32. Powers of two alone hide
# it.
GEMM_ROWS = (*range(1, 33), 40, 48, 56, 64, 96, 128, 256, 512)
# (k, n): from small projections to a wide output head, so the per-weight cost can follow size.
GEMM_SHAPES = ((512, 512), (512, 2048), (2048, 512), (1024, 1024), (1024, 4096), (4096, 1024),
               (2048, 2048), (2048, 8192), (1024, 32768), (1024, 131072))  # up to a 128k-vocab head


@dataclasses.dataclass(frozen=True)
class StepSample:
    model: str
    kind: str  # "decode" | "prefill"
    rows: int  # batch (decode) or chunk tokens (prefill)
    context: int  # attention width (decode) or tokens before the chunk (prefill)
    seconds: float


def streamed_weights(k: int, n: int, dtype: mx.Dtype) -> list[mx.array]:
    """Enough distinct (n, k) weight matrices that cycling through them defeats the caches (twice
    the last-level cache), as a model's weights do in a decode step."""
    copies = max(1, min(1024, working_set_bytes() // (k * n * dtype.size)))
    base = mx.random.normal((n, k)).astype(dtype)
    ws = [base + i for i in range(copies)]  # distinct buffers; values do not change the timing
    mx.eval(ws)
    return ws


def time_linear(m: int, k: int, n: int, dtype: mx.Dtype, reps: int = 5,
                weights: list[mx.array] | None = None, warmup: int = 1) -> float:
    """Seconds for one (m, k) @ (k, n)^T as nn.Linear computes it, weights streamed from memory:
    each timed call cycles through enough distinct weight matrices to defeat the caches."""
    ws = weights or streamed_weights(k, n, dtype)
    x = mx.random.normal((m, k)).astype(dtype)
    mx.eval(x)

    def run() -> None:
        mx.eval([x @ w.T for w in ws])

    return median_time_s(run, reps, warmup) / len(ws)


def fit_gemm(samples: dict[tuple[int, int, int], float]) -> GemmFit:
    """From t(m, k, n): per matrix size, the weight term is the small-m intercept of t against
    2*m*k*n; the cost per FLOP at each m is what remains, averaged over shapes in log space."""
    weight_ns: dict[int, list[float]] = {}
    for k, n in {(k, n) for _, k, n in samples}:
        pts = sorted((m, t) for (m, kk, nn), t in samples.items() if (kk, nn) == (k, n) and m <= 4)
        a = np.asarray([[1.0, 2 * m * k * n] for m, _ in pts])
        b = np.asarray([t for _, t in pts])
        coef, *_ = np.linalg.lstsq(a / b[:, None], np.ones(len(b)), rcond=None)  # relative error
        intercept = coef[0] if coef[0] > 0 else min(b)
        weight_ns.setdefault(k * n, []).append(float(intercept) / (k * n) * 1e9)
    weights = {kn: float(np.exp(np.mean(np.log(v)))) for kn, v in weight_ns.items()}
    w_at = GemmFit(weights, {1: 0.0}).seconds
    flop_ns = {}
    for m in sorted({m for m, _, _ in samples}):
        vals = [(t - w_at(1, k, n)) / (2 * m * k * n) for (mm, k,
                                                           n), t in samples.items() if mm == m]
        vals = [v for v in vals if v > 0] or [1e-12]
        flop_ns[m] = float(np.exp(np.mean(np.log(vals)))) * 1e9
    return GemmFit(weight_ns=weights, flop_ns=flop_ns)


def measure_gemm(dtype: mx.Dtype, rows: Sequence[int] = GEMM_ROWS, shapes=GEMM_SHAPES,
                 reps: int = 5, log: Callable[[str], None] = print) -> tuple[GemmFit, dict]:
    """Each (m, k, n) timed once per pass over the whole grid, `reps` passes, median per point: a
    shared machine's slow minutes then touch every point a little instead of bending a few (timed
    back to back, one shape's whole row sweep could fall into one slow phase)."""
    weights = {(k, n): streamed_weights(k, n, dtype) for k, n in shapes}
    times: dict[tuple[int, int, int], list[float]] = {}
    for rep in range(reps):
        for k, n in shapes:
            for m in rows:
                times.setdefault((m, k, n), []).append(
                    time_linear(m, k, n, dtype, reps=1, weights=weights[(k, n)],
                                warmup=int(rep == 0)))
        log(f"gemm pass {rep + 1}/{reps} done")
    samples = {key: float(np.median(v)) for key, v in times.items()}
    for k, n in shapes:
        log(f"gemm {k}x{n}: " + ", ".join(f"m={m} {samples[(m, k, n)] * 1e3:.2f}ms" for m in rows))
    return fit_gemm(samples), samples


# The speed probe: three executor steps of the first calibration model, points of calibration's
# own grid (decode at batch 1 and 8, 128 tokens of context; a 64-token prefill), so the profile
# keeps what calibration measured for them. A fixed GEMV/GEMM probe did not follow this VM's slow
# phases (it read x1.0-1.2 while model steps ran 10-15% slower than calibrated); model steps do.
PROBE_DECODE_BATCHES = (1, 8)
PROBE_WIDTH = 128
PROBE_CHUNK = 64
PROBE_STEPS = 5  # decode steps per probe point (the first, joining step not counted)


def probe_key(sample: StepSample) -> str:
    return f"{sample.model}:{sample.kind}:{sample.rows}x{sample.context}"


def is_probe_point(sample: StepSample) -> bool:
    if sample.kind == "decode":
        return (sample.rows in PROBE_DECODE_BATCHES
                and sample.context == decode_sample_context(PROBE_WIDTH, PROBE_STEPS))
    return sample.rows == PROBE_CHUNK and sample.context == 0


def speed_probe_ms(name: str, model, spec: ModelSpec, kv: CacheLayout | int) -> dict[str, float]:
    """A few seconds of real executor steps on a calibration model, keyed by grid point."""
    samples = decode_samples(name, model, spec, kv, PROBE_DECODE_BATCHES, [PROBE_WIDTH],
                             steps=PROBE_STEPS, rounds=1)
    samples += prefill_samples(name, model, spec, kv, [PROBE_CHUNK], [0], reps=2)
    return {probe_key(x): x.seconds * 1e3 for x in samples}


def device_speed(speeds: dict[str, float]) -> float | None:
    """One number for a probe reading: the geometric mean of its points' speeds."""
    vals = [v for v in speeds.values() if v > 0]
    return float(np.exp(np.mean(np.log(vals)))) if vals else None


def probe_speed(now_ms: dict[str, float], calibrated_ms: dict[str, float]) -> dict[str, float]:
    """Device speed now relative to calibration, per probe (1.0 = same, 0.8 = 20% slower)."""
    return {k: calibrated_ms[k] / now_ms[k] for k in now_ms if k in calibrated_ms and now_ms[k] > 0}


def mean_by_key(a: dict[str, float], b: dict[str, float]) -> dict[str, float]:
    """Two probe readings (timings or speeds) averaged, per probe."""
    return {k: (a[k] + b[k]) / 2 for k in a if k in b}


def format_speed(speed: dict[str, float]) -> str:
    return ", ".join(f"{k} x{v:.2f}" for k, v in speed.items()) or "n/a"


def measure_copy_gbs(reps: int = 5) -> float:
    """Bytes per second that the pool's copies (pad, gather, scatter) move."""
    a = mx.random.normal((64, 4, 1024, 128))  # 128 MiB, pool-shaped
    mx.eval(a)

    def run() -> None:
        mx.eval(mx.pad(a[:, :, :768], [(0, 0), (0, 0), (0, 256), (0, 0)]))

    return a.nbytes / median_time_s(run, reps) / 1e9


def as_layout(kv: CacheLayout | int) -> CacheLayout:
    """What a calibration model's cache holds: its session's cache_layout (sliding windows, fixed
    states, MLA latents), or for a dense model its bytes per token."""
    return kv if isinstance(kv, CacheLayout) else CacheLayout.dense(kv)


def session_layout(session) -> CacheLayout:
    """A session's cache as its executor's pool holds it (the scheduler's pricing)."""
    return session.cache_layout or CacheLayout.dense(session.kv_bytes_per_token)


def _scheduler(kv: CacheLayout | int, batch: int, prefill: int) -> Scheduler:
    cache = as_layout(kv)
    return Scheduler(SchedulerConfig(
        kv_budget_bytes=1 << 50, kv_bytes_per_token=cache.full_token_bytes, max_model_len=1 << 20,
        max_num_seqs=batch, max_num_batched_tokens=max(4096, batch, prefill),
        prefill_step_size=prefill,
        cache_layout=None if cache.is_dense else cache,
    ))


def decode_sample_context(width: int, steps: int) -> int:
    """The attention width a decode sample stands for: its middle timed step's."""
    return width + 1 + steps // 2


def decode_geometry(batch: int, width: int, steps: int) -> PoolGeometry:
    """The pool a decode grid point runs in: `batch` rows with room for `steps` more tokens."""
    return PoolGeometry(batch, round_up(width + steps + 2, KV_STEP))


def decode_kv_bytes(kv: CacheLayout | int, batch: int, width: int, steps: int = 5) -> int:
    """Memory a decode grid point holds: each row's private cache and the pool it is joined into."""
    return 2 * as_layout(kv).pool_bytes(decode_geometry(batch, width, steps))


def decode_samples(name: str, model, spec: ModelSpec, kv: CacheLayout | int, batches: Sequence[int],
                   widths: Sequence[int], steps: int = 5, rounds: int = 3,
                   max_kv_bytes: int | None = None) -> list[StepSample]:
    """Executor-timed decode steps at each (batch, context width); the first (joining) step of
    each configuration is not counted. The grid is measured `rounds` times over and each point
    takes the median of its rounds, so a shared machine's slow minutes spread over every point
    instead of bending a few. Points whose KV would pass `max_kv_bytes` are skipped."""
    times: dict[tuple[int, int], list[float]] = {}
    for _ in range(rounds):
        for width in widths:
            for b in batches:
                if max_kv_bytes is not None and decode_kv_bytes(kv, b, width, steps) > max_kv_bytes:
                    continue
                ex = MLXExecutor(model)
                prefilled(model, ex, spec, b, width)
                geom = decode_geometry(b, width, steps)
                step_s = []
                for i in range(steps + 1):
                    plan = StepPlan(i, (), (), (), tuple(range(b)), tuple([width + i] * b), geom,
                                    as_layout(kv).pool_bytes(geom))
                    step_s.append(ex.execute(plan).elapsed_s)
                times.setdefault((width, b), []).append(float(np.median(step_s[1:])))
                del ex
    return [StepSample(name, "decode", b, decode_sample_context(width, steps), float(np.median(t)))
            for (width, b), t in times.items()]


def prefill_samples(name: str, model, spec: ModelSpec, kv: CacheLayout | int, chunks: Sequence[int],
                    starts: Sequence[int], reps: int = 3) -> list[StepSample]:
    """Executor-timed final prefill chunks of n tokens after `start` cached tokens."""
    out = []
    rng = np.random.default_rng(1)
    for start in starts:
        for n in chunks:
            times = []
            step = max(512, round_up(max(start, n), KV_STEP))  # one chunk to `start`, then n
            for _ in range(reps):
                sched = _scheduler(kv, 1, step)
                ex = MLXExecutor(model)
                ids = rng.integers(0, spec.vocab_size, start + n).tolist()
                sched.add_request(Request(0, start + n,
                                          SamplingParams(1, ignore_eos=True), 0.0, ids))
                while sched.has_work():
                    plan = sched.schedule()
                    result = ex.execute(plan)
                    sched.update_from_output(plan, result)
                    if plan.prefills and plan.prefills[0].sample:
                        chunk = plan.prefills[0]
                        assert (chunk.start, chunk.num_tokens) == (start, n), chunk
                        times.append(result.elapsed_s)
            out.append(StepSample(name, "prefill", n, start, float(np.median(times))))
    return out


def grid_samples(models: dict[str, tuple], batches: Sequence[int], widths: Sequence[int],
                 chunks: Sequence[int], starts: Sequence[int], rounds: int = 3,
                 max_kv_bytes: int | None = None,
                 log: Callable[[str], None] = print) -> list[StepSample]:
    """The decode and prefill grid of every calibration model ({name: (model, spec, its cache:
    session_layout, or bytes per token)}), measured `rounds` times round-robin over the models,
    median per point. Model by model, each model's samples would sit in one phase of a shared
    machine, and the fit would read a phase as a difference between models. Decode points whose KV
    would pass `max_kv_bytes` are skipped (a 0.6B model with 8 KV heads of 128 holds 15 GB at 64
    rows of 1024 tokens)."""
    times: dict[tuple[str, str, int, int], list[float]] = {}
    for name, (_, _, kv) in models.items():
        skipped = [f"{b}x{w}" for w in widths for b in batches
                   if max_kv_bytes is not None and decode_kv_bytes(kv, b, w) > max_kv_bytes]
        if skipped:
            log(f"{name}: decode points over the KV cap of {max_kv_bytes / 2**30:.1f} GiB skipped "
                f"(batch x width): {', '.join(skipped)}")
    for r in range(rounds):
        for name, (model, spec, kv) in models.items():
            log(f"round {r + 1}/{rounds}: {name} decode steps and prefill chunks")
            got = decode_samples(name, model, spec, kv, batches, widths, rounds=1,
                                 max_kv_bytes=max_kv_bytes)
            got += prefill_samples(name, model, spec, kv, chunks, starts, reps=1)
            for x in got:
                times.setdefault((x.model, x.kind, x.rows, x.context), []).append(x.seconds)
    return [StepSample(*key, float(np.median(v))) for key, v in times.items()]


# The Calibration fields fitted on executor steps, in the order of fit_forward_terms's columns.
FORWARD_TERMS = ("attention_decode_ns_per_byte", "attention_prefill_ns_per_flop",
                 "attention_prefill_ns_per_score_byte", "elementwise_ns_per_byte",
                 "layer_overhead_us", "forward_overhead_us", "attention_decode_ns_per_score",
                 "attention_row_ns", "token_layer_ns", "sampling_row_us")


def fit_forward_terms(samples: Sequence[StepSample], costs: dict[str, StepCost],
                      pinned: dict[str, float] | None = None) -> dict[str, float]:
    """Least squares (relative error, non-negative) for what the GEMM model leaves unexplained.
    `pinned` terms (measured on their own: fixed_cost.py) are taken as given, not fitted."""
    names = FORWARD_TERMS
    pinned = pinned or {}
    rows, target = [], []
    for s in samples:
        c = costs[s.model]
        rows.append(_features(s, c))
        linear = c.linear_layers_s(s.rows) + c.lm_head_s(s.rows if s.kind == "decode" else 1)
        target.append(s.seconds - linear)
    a = np.asarray(rows) / np.asarray([s.seconds for s in samples])[:, None]
    b = np.asarray(target) / np.asarray([s.seconds for s in samples])
    fixed = [i for i, n in enumerate(names) if n in pinned]
    if fixed:
        b = b - a[:, fixed] @ np.asarray([pinned[names[i]] for i in fixed])
    active = [i for i in range(len(names)) if i not in fixed]
    while True:
        coef, *_ = np.linalg.lstsq(a[:, active], b, rcond=None)
        if (coef >= 0).all() or not active:
            break
        active.pop(int(np.argmin(coef)))
    values = dict.fromkeys(names, 0.0) | pinned
    for i, c in zip(active, coef):
        values[names[i]] = float(c)
    return values


def _features(s: StepSample, c: StepCost) -> list[float]:
    """One sample's columns of fit_forward_terms (FORWARD_TERMS' order): the work of a model whose
    every layer is full attention (K/V bytes and scores of a decode over `context` tokens; score
    FLOPs and bytes of a prefill chunk after `context`; elementwise bytes), layers, one pass; then
    the per-row terms StepCost._row_parts prices: decode rows past the first x layers, tokens x
    layers, sampled rows (a decode step samples every row, a final prefill chunk one)."""
    sp, layers = c.spec, c.spec.num_layers
    if s.kind == "decode":
        kv_bytes = s.rows * s.context * c.kv_bytes_per_token
        scores = layers * s.rows * sp.num_heads * s.context
        return [kv_bytes * 1e-9, 0.0, 0.0, c.elementwise_bytes(s.rows, logits=True) * 1e-9,
                layers * 1e-6, 1e-6, scores * 1e-9,
                layers * (s.rows - 1) * 1e-9, layers * s.rows * 1e-9, s.rows * 1e-6]
    ctx = s.context + s.rows  # a final chunk of `rows` tokens: one row's logits
    logits = c.elementwise_bytes(1, logits=True) - c.elementwise_bytes(1, logits=False)
    return [0.0, 4 * layers * sp.num_heads * sp.head_dim * s.rows * ctx * 1e-9,
            layers * sp.num_heads * s.rows * ctx * 4 * 1e-9,
            (c.elementwise_bytes(s.rows, logits=False) + logits) * 1e-9, layers * 1e-6, 1e-6, 0.0,
            0.0, layers * s.rows * 1e-9, 1e-6]


def predict(sample: StepSample, cost: StepCost) -> float:
    if sample.kind == "decode":
        return cost.decode_forward_s(sample.rows, sample.context)
    return cost.prefill_forward_s(sample.rows, sample.context, sample=True)


def transfer_errors(samples: Sequence[StepSample], costs: dict[str, StepCost],
                    pinned: dict[str, float] | None = None) -> dict[str, dict[str, float]]:
    """Leave one model out: fit the forward terms on the other models, predict the one left out
    ({model: median |error|, median error}). Every model the simulator is used on is one the fit
    has not seen, so this, not the in-sample error, is what to expect on a new model. `costs`
    are StepCosts whose profile carries the GEMM fit (their forward terms are not used)."""
    out = {}
    for held, c in costs.items():
        train = [s for s in samples if s.model != held]
        test = [s for s in samples if s.model == held]
        if not train or not test or c.cal is None:
            continue
        terms = fit_forward_terms(train, costs, pinned)
        profile = dataclasses.replace(c.profile, calibration=dataclasses.replace(c.cal, **terms))
        cost = StepCost(c.spec, profile, c.fmt, None)
        errs = np.asarray([predict(s, cost) / s.seconds - 1 for s in test])
        out[held] = {"median_abs_err": float(np.median(np.abs(errs))),
                     "median_err": float(np.median(errs))}
    return out


def calibration_from(gemm: dict[str, GemmFit], terms: dict[str, float], copy_gbs: float,
                     step_overhead_us: float, models: Sequence[str], when: str,
                     probe_ms: dict[str, float] | None = None, device: str = "") -> Calibration:
    return Calibration(gemm=gemm, copy_gbs=copy_gbs, step_overhead_us=step_overhead_us,
                       calibrated_on=tuple(models), measured_at=when, device=device,
                       speed_probe_ms=dict(probe_ms or {}), **terms)


def sample_errors(samples: Sequence[StepSample], costs: dict[str, StepCost]) -> dict[str, float]:
    """Median |error| and median error of `costs` predicting these steps."""
    errs = np.asarray([predict(s, costs[s.model]) / s.seconds - 1 for s in samples])
    return {"median_abs_err": float(np.median(np.abs(errs))), "median_err": float(np.median(errs)),
            "max_abs_err": float(np.max(np.abs(errs)))}
