"""Matmul and memory-bandwidth microbenchmarks on MLX, and the exact roofline arithmetic they are
reported with. `batchsim roofline` draws them; `batchsim calibrate` can reuse them.

The arithmetic is pure and imports nothing heavy. MLX is imported inside the measuring functions,
after `server.platform.blas` has chosen the CPU backend's BLAS."""

from __future__ import annotations

import contextlib
import dataclasses
import math
import statistics
import time
from collections.abc import Callable, Iterator
from pathlib import Path

DTYPE_BYTES = {"float16": 2, "bfloat16": 2, "float32": 4}
# mlx-lm's affine quantization (mx.quantized_matmul): packed weights, a scale and a bias per group
# of 64 inputs, both in the activations' dtype (the weights' dtype before quantizing).
QUANT_BITS = {"q4": 4, "q8": 8}
QUANT_GROUP_SIZE = 64
FORMATS = (*DTYPE_BYTES, *QUANT_BITS)  # what `roofline --dtypes` accepts
# A timed rep multiplies enough independent (W, X) pairs to stream at least this much, so warm
# caches cannot serve the weights (a decode step reads every layer's weights once).
MIN_WORKING_SET_BYTES = 128 << 20
# ... unless a rep already takes this long: a multiply that slow is compute-bound, caches aside.
TARGET_REP_S = 0.05
MAX_COPIES = 256
# Square GEMMs tried, largest first, for the compute roof: the largest the time budget allows.
PEAK_LADDER = (8192, 4096, 2048, 1024, 512, 256)
DEFAULT_CACHE_LIMIT_BYTES = 4 << 30


# -- exact arithmetic ---------------------------------------------------------------------------
def dtype_bytes(dtype: str) -> int:
    try:
        return DTYPE_BYTES[dtype]
    except KeyError:
        known = ", ".join(DTYPE_BYTES)
        raise ValueError(f"unknown dtype {dtype!r}; expected one of {known}") from None


def act_dtype(fmt: str, act: str = "") -> str:
    """The activations' dtype of a format: a float dtype's own; a quantized format's `act`
    (float16, as mlx-lm's models hold scales, unless given)."""
    if fmt in QUANT_BITS:
        dtype_bytes(act or "float16")  # an unknown dtype: the same one-line error
        return act or "float16"
    dtype_bytes(fmt)
    return fmt


def weight_bytes(n: int, fmt: str, act: str = "") -> int:
    """One N x N weight matrix as stored; quantized: bits/8 per weight plus a scale and a bias per
    group (server.models.arch.quantized_matrix_bytes's layout, scales in the activations' dtype)."""
    scale_bytes = dtype_bytes(act_dtype(fmt, act))
    if fmt not in QUANT_BITS:
        return n * n * scale_bytes
    return n * n * QUANT_BITS[fmt] // 8 + 2 * scale_bytes * (n * n // QUANT_GROUP_SIZE)


def matmul_flops(batch: int, n: int) -> int:
    """Y = X @ W.T with X (batch, n) and W (n, n): a multiply and an add per weight per row."""
    return 2 * batch * n * n


def matmul_bytes(batch: int, n: int, dtype: str, act: str = "") -> int:
    """Minimal traffic: W and X read once, Y written once, as if caches reused every operand
    perfectly. A float GEMV (one decode step) is batch 1: (N*N + 2N) elements."""
    return weight_bytes(n, dtype, act) + 2 * batch * n * dtype_bytes(act_dtype(dtype, act))


def intensity(batch: int, n: int, dtype: str, act: str = "") -> float:
    """Arithmetic intensity, FLOP per byte of minimal traffic."""
    return matmul_flops(batch, n) / matmul_bytes(batch, n, dtype, act)


def ridge_intensity(peak_gflops: float, bandwidth_gbs: float) -> float:
    """FLOP per byte where the bandwidth roof meets the compute roof."""
    return peak_gflops / bandwidth_gbs


def roof_gflops(flop_per_byte: float, peak_gflops: float, bandwidth_gbs: float) -> float:
    return min(peak_gflops, flop_per_byte * bandwidth_gbs)


def shape_name(batch: int, n: int) -> str:
    return "gemv" if batch == 1 else "gemm" if batch == n else "batch"


def sweep_batches(n: int) -> list[int]:
    """1, 2, 4, ... below n, then n itself."""
    batches = [1 << k for k in range(max(1, n).bit_length()) if (1 << k) < n]
    return batches + [n]


def first_compute_bound(batches: list[int], n: int, dtype: str, ridge: float) -> int | None:
    """The first batch whose intensity passes the ridge point: from there the multiply is bound by
    the matmul rate, not by reading the weights."""
    return next((b for b in batches if intensity(b, n, dtype) > ridge), None)


def copies_for(bytes_per_multiply: int, estimated_s: float,
               working_set_bytes: int = MIN_WORKING_SET_BYTES, memory_bytes: int = 0) -> int:
    """Independent multiplies per timed rep: enough to stream `working_set_bytes`, no more than a
    rep of TARGET_REP_S affords or `memory_bytes` holds (0: no memory cap)."""
    want = math.ceil(working_set_bytes / bytes_per_multiply)
    affordable = int(TARGET_REP_S / estimated_s) if estimated_s > 0 else MAX_COPIES
    fits = memory_bytes // bytes_per_multiply if memory_bytes else MAX_COPIES
    return max(1, min(want, affordable, fits, MAX_COPIES))


@dataclasses.dataclass(frozen=True)
class MatmulPoint:
    """One measured Y = X @ W.T."""

    n: int
    batch: int
    dtype: str
    seconds: float  # median over reps of one multiply's time
    reps: int
    copies: int  # independent multiplies per timed rep (see copies_for)
    act: str = ""  # a quantized format's activation dtype (act_dtype)

    shape = property(lambda self: shape_name(self.batch, self.n))
    flops = property(lambda self: matmul_flops(self.batch, self.n))
    bytes = property(lambda self: matmul_bytes(self.batch, self.n, self.dtype, self.act))
    intensity = property(lambda self: intensity(self.batch, self.n, self.dtype, self.act))
    gflops = property(lambda self: self.flops / self.seconds / 1e9)
    gbytes_s = property(lambda self: self.bytes / self.seconds / 1e9)

    def row(self) -> dict:
        return {"n": self.n, "batch": self.batch, "dtype": self.dtype, "shape": self.shape,
                "gflops": self.gflops, "gbytes_s": self.gbytes_s, "intensity": self.intensity,
                "seconds": self.seconds, "flops": self.flops, "bytes": self.bytes,
                "reps": self.reps, "copies": self.copies,
                "act_dtype": act_dtype(self.dtype, self.act)}


@dataclasses.dataclass(frozen=True)
class Skip:
    """A point not measured, and why."""

    n: int
    batch: int
    dtype: str
    reason: str
    estimated_s: float | None = None  # predicted time of its reps, when time was the reason

    shape = property(lambda self: shape_name(self.batch, self.n))

    def row(self) -> dict:
        return {"n": self.n, "batch": self.batch, "dtype": self.dtype, "shape": self.shape,
                "skipped": self.reason, "estimated_s": self.estimated_s}


class RateBook:
    """Predicts a multiply's time from those measured so far: the latest rate of the same dtype at
    the largest batch not above this one (rates grow with the batch, so the guess errs long), and
    never faster than streaming its bytes at `bandwidth_gbs`."""

    def __init__(self, bandwidth_gbs: float) -> None:
        self.bandwidth_gbs = bandwidth_gbs
        self._flops_per_s: dict[tuple[str, int], float] = {}

    def record(self, point: MatmulPoint) -> None:
        self._flops_per_s[(point.dtype, point.batch)] = point.flops / point.seconds

    def estimate_s(self, batch: int, n: int, dtype: str) -> float:
        known = [b for d, b in self._flops_per_s if d == dtype and b <= batch]
        if not known:
            return math.inf
        rate = self._flops_per_s[(dtype, max(known))]
        stream_s = matmul_bytes(batch, n, dtype) / (self.bandwidth_gbs * 1e9)
        return max(matmul_flops(batch, n) / rate, stream_s)


@dataclasses.dataclass(frozen=True)
class BenchConfig:
    reps: int = 9
    warmup: int = 1
    max_s_per_point: float = 10.0  # skip a point whose warm-up and reps should take longer
    memory_bytes: int = 0  # one point's arrays must fit in this (0: no check)
    working_set_bytes: int = MIN_WORKING_SET_BYTES
    quant_act: str = "float16"  # quantized formats' activation (and scale) dtype

    def act(self, fmt: str) -> str:
        return self.quant_act if fmt in QUANT_BITS else ""


# -- the machine --------------------------------------------------------------------------------
def last_level_cache_bytes() -> int | None:
    """The largest CPU cache Linux reports (sysfs), or None elsewhere."""
    sizes = []
    for f in Path("/sys/devices/system/cpu/cpu0/cache").glob("index*/size"):
        text = f.read_text().strip().upper()
        scale = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(text[-1:], 1)
        with contextlib.suppress(ValueError):
            sizes.append(int(text.rstrip("KMG")) * scale)
    return max(sizes) if sizes else None


def working_set_bytes() -> int:
    """Twice the last-level cache, and at least MIN_WORKING_SET_BYTES."""
    return max(MIN_WORKING_SET_BYTES, 2 * (last_level_cache_bytes() or 0))


def memory_budget_bytes(fraction: float = 0.5) -> int:
    """A share of the device's memory (the GPU's working set, else RAM) one point may use."""
    from batchsim.server.platform import env

    info: dict = {}
    with contextlib.suppress(Exception):  # device_info is missing on some builds
        info = dict(_mx().device_info())
    total = (info.get("max_recommended_working_set_size") or info.get("memory_size")
             or env.ram_bytes())
    return int(total * fraction)


# -- measuring ----------------------------------------------------------------------------------
def _mx():
    from batchsim.server.platform import blas

    blas.preload()  # no-op once chosen; must precede the first `import mlx`
    import mlx.core as mx

    return mx


@contextlib.contextmanager
def cache_limit(nbytes: int = DEFAULT_CACHE_LIMIT_BYTES) -> Iterator[int]:
    """Keep freed buffers for reuse while measuring: without it every rep faults fresh pages in
    and CPU-backend bandwidth reads several times lower."""
    mx = _mx()
    previous = mx.set_cache_limit(nbytes)
    try:
        yield nbytes
    finally:
        mx.set_cache_limit(previous)
        mx.clear_cache()


def median_time_s(fn: Callable[[], object], reps: int, warmup: int = 1) -> float:
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def _uniform(mx, shape: tuple[int, ...], dtype: str):
    return mx.random.uniform(-1.0, 1.0, shape, dtype=getattr(mx, dtype))


def _multiply(mx, w, fmt: str) -> Callable:
    """x -> x @ W.T: a float matmul, or mx.quantized_matmul on W quantized as mlx-lm does
    (affine, group 64)."""
    if fmt not in QUANT_BITS:
        mx.eval(w)
        return lambda x: x @ w.T
    bits = QUANT_BITS[fmt]
    wq, scales, biases = mx.quantize(w, group_size=QUANT_GROUP_SIZE, bits=bits)
    mx.eval(wq, scales, biases)
    return lambda x: mx.quantized_matmul(x, wq, scales, biases, transpose=True,
                                         group_size=QUANT_GROUP_SIZE, bits=bits)


def time_matmul(batch: int, n: int, dtype: str, reps: int = 9, copies: int = 1,
                warmup: int = 1, act: str = "") -> float:
    """Median seconds of one X (batch, n) @ W.T (the layout of a decoder's linear layer); each rep
    evaluates `copies` independent multiplies and is divided by that count. `dtype` is a float
    dtype or a quantized format (QUANT_BITS) with activations in `act`."""
    mx = _mx()
    fns = [_multiply(mx, _uniform(mx, (n, n), act_dtype(dtype, act)), dtype) for _ in range(copies)]
    xs = [_uniform(mx, (batch, n), act_dtype(dtype, act)) for _ in range(copies)]
    mx.eval(xs)
    seconds = median_time_s(lambda: mx.eval([f(x) for x, f in zip(xs, fns)]), reps, warmup)
    return seconds / copies


def measure_bandwidth(array_bytes: int = 256 << 20, reps: int = 9) -> dict[str, float]:
    """GB/s of streaming float32 kernels, counting every byte read and written: `add` (a + b) and
    `scale` (a * 2)."""
    mx = _mx()
    rates = _stream_rates_gbs(mx, max(1, array_bytes // 4), reps)
    mx.clear_cache()  # the arrays died with the helper's frame
    return rates


def _stream_rates_gbs(mx, size: int, reps: int) -> dict[str, float]:
    a, b = _uniform(mx, (size,), "float32"), _uniform(mx, (size,), "float32")
    mx.eval(a, b)
    kernels = {"add": (lambda: mx.eval(a + b), 3), "scale": (lambda: mx.eval(a * 2.0), 2)}
    return {name: arrays * 4 * size / median_time_s(fn, reps, warmup=2) / 1e9
            for name, (fn, arrays) in kernels.items()}


def measure_bandwidth_gbs(array_bytes: int = 256 << 20, reps: int = 9) -> float:
    """The memory roof: the best streaming kernel's GB/s."""
    return max(measure_bandwidth(array_bytes, reps).values())


def probe_rates(dtypes: list[str], book: RateBook, reps: int = 3, quant_act: str = "") -> None:
    """Seed `book` with a small GEMV and GEMM per dtype, so later points can be sized up front."""
    for dtype in dtypes:
        act = quant_act if dtype in QUANT_BITS else ""
        for batch, n in ((1, 512), (256, 256)):
            seconds = time_matmul(batch, n, dtype, reps, act=act)
            book.record(MatmulPoint(n, batch, dtype, seconds, reps, 1, act))


def measure_or_skip(batch: int, n: int, dtype: str, cfg: BenchConfig,
                    book: RateBook) -> MatmulPoint | Skip:
    """Measure one point, unless its arrays do not fit or its reps would run too long."""
    act = cfg.act(dtype)
    per = matmul_bytes(batch, n, dtype, act)
    if cfg.memory_bytes and per > cfg.memory_bytes:
        return Skip(n, batch, dtype, f"needs {per / 2**30:.1f} GiB, over the "
                    f"{cfg.memory_bytes / 2**30:.1f} GiB memory budget")
    est_s = book.estimate_s(batch, n, dtype)
    copies = copies_for(per, est_s, cfg.working_set_bytes, cfg.memory_bytes)
    total_s = est_s * copies * (cfg.reps + cfg.warmup)
    if total_s > cfg.max_s_per_point:
        return Skip(n, batch, dtype, f"estimated {total_s:.0f} s > {cfg.max_s_per_point:g} s "
                    "per point", total_s)
    seconds = time_matmul(batch, n, dtype, cfg.reps, copies, cfg.warmup, act)
    _mx().clear_cache()
    point = MatmulPoint(n, batch, dtype, seconds, cfg.reps, copies, act)
    book.record(point)
    return point


Result = MatmulPoint | Skip


class Bench:
    """One measuring session: the config, the rate book that sizes points up front, and every
    result so far, so a point asked for twice (the sweep's B=1 and B=N) is measured once."""

    def __init__(self, cfg: BenchConfig, book: RateBook,
                 on_result: Callable[[Result], None] = lambda r: None) -> None:
        self.cfg, self.book, self.on_result = cfg, book, on_result
        self.results: dict[tuple[str, int, int], Result] = {}

    def point(self, batch: int, n: int, dtype: str) -> Result:
        key = (dtype, batch, n)
        if key not in self.results:
            self.results[key] = measure_or_skip(batch, n, dtype, self.cfg, self.book)
            self.on_result(self.results[key])
        return self.results[key]


def gemv_gemm_rows(bench: Bench, ns: list[int], dtypes: list[str]) -> list[Result]:
    """Per dtype and ascending N: the GEMV (batch 1) and the GEMM (batch N)."""
    return [bench.point(b, n, d) for d in dtypes for n in sorted(set(ns)) for b in (1, n)]


def batch_sweep_rows(bench: Bench, n: int, dtypes: list[str]) -> list[Result]:
    """Batch 1, 2, 4, ... N at one N."""
    return [bench.point(b, n, d) for d in dtypes for b in sweep_batches(n)]


def peak_rows(bench: Bench, dtypes: list[str]) -> list[MatmulPoint]:
    """Per dtype, the largest square GEMM of PEAK_LADDER within budget: the compute roof, whatever
    N the caller asked for."""
    found = []
    for dtype in dtypes:
        for n in PEAK_LADDER:
            result = bench.point(n, n, dtype)
            if isinstance(result, MatmulPoint):
                found.append(result)
                break
    return found
