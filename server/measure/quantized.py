"""The quantized matmuls' own ceilings, measured: mlx-lm's 4- and 8-bit affine quantization (group
64, mx.quantized_matmul) as a GEMV's bytes per second and a large GEMM's FLOP rate, by bits.
`batchsim calibrate` records them in the profile (quantized_gemv_gbs, quantized_gemm_gflops);
`measure_rates` also runs on its own."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

from batchsim.server.measure import microbench as mb

BITS = (4, 8)
# GEMVs at decode-sized layers; the best bytes/s of them is the GEMV rate. The GEMM rate is the
# largest square GEMM of microbench.PEAK_LADDER the time budget allows (as roofline's peak).
GEMV_NS = (4096, 8192)


@dataclasses.dataclass(frozen=True)
class QuantizedRates:
    gemv_gbs: dict[int, float]  # bits -> GB/s a quantized GEMV streams (packed weights + scales)
    gemm_gflops: dict[int, float]  # bits -> GFLOP/s of the largest quantized GEMM measured
    act_dtype: str  # the activations' (and scales') dtype they were measured in
    rows: list[dict]  # every point measured or skipped, for calibrate.jsonl


def measure_rates(act_dtype: str | None = None, bandwidth_gbs: float | None = None,
                  reps: int = 5, max_s_per_point: float = 10.0, bits: tuple[int, ...] = BITS,
                  log: Callable[[str], None] = print) -> QuantizedRates:
    """Measure each bit width's GEMV and GEMM rate with activations in `act_dtype` (the backend's
    default dtype unless given); `bandwidth_gbs` (measured if None) only sizes points up front."""
    from batchsim.server.platform import env

    act = act_dtype or env.default_dtype()
    fmts = [f"q{b}" for b in bits]
    bad = [f for f in fmts if f not in mb.QUANT_BITS]
    if bad:
        raise ValueError(f"quantized bits must be among {', '.join(map(str, BITS))}, got {bad}")
    with mb.cache_limit():
        book = mb.RateBook(bandwidth_gbs or mb.measure_bandwidth_gbs(reps=reps))
        mb.probe_rates(fmts, book, quant_act=act)
        cfg = mb.BenchConfig(reps=reps, max_s_per_point=max_s_per_point, quant_act=act,
                             memory_bytes=mb.memory_budget_bytes(),
                             working_set_bytes=mb.working_set_bytes())
        bench = mb.Bench(cfg, book, lambda r: log(_describe(r)))
        gemvs = [bench.point(1, n, f) for f in fmts for n in GEMV_NS]
        gemms = mb.peak_rows(bench, fmts)
    measured = [p for p in gemvs if isinstance(p, mb.MatmulPoint)]
    gemv = {mb.QUANT_BITS[f]: max(p.gbytes_s for p in measured if p.dtype == f)
            for f in fmts if any(p.dtype == f for p in measured)}
    gemm = {mb.QUANT_BITS[p.dtype]: p.gflops for p in gemms}
    return QuantizedRates(gemv, gemm, act, [r.row() for r in bench.results.values()])


def _describe(result: mb.Result) -> str:
    what = f"quantized {result.dtype} {result.shape} n={result.n} b={result.batch}"
    if isinstance(result, mb.Skip):
        return f"{what}: skipped ({result.reason})"
    return f"{what}: {result.gflops:.2f} GFLOP/s, {result.gbytes_s:.2f} GB/s"


if __name__ == "__main__":  # python -m batchsim.server.measure.quantized [ACT_DTYPE]
    import json
    import sys

    from batchsim.server.platform import blas

    blas.preload()
    found = measure_rates(sys.argv[1] if len(sys.argv) > 1 else None,
                          log=lambda s: print(s, file=sys.stderr))
    print(json.dumps({k: v for k, v in dataclasses.asdict(found).items() if k != "rows"}))
