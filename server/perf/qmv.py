"""Which Metal kernel MLX runs for a quantized linear layer over a few rows, by Apple GPU family.

MLX's `QuantizedMatmul::eval_gpu` (mlx/backend/metal/quantized.cpp, ml-explore/mlx at 2026-08-22)
runs qmv, the matrix-vector kernel, for M < get_qmv_batch_limit(K, N, device) rows and qmm (or
split-K qmm) from there. qmv's grid is (M, N / bn, 1): one threadgroup per row and output block,
so every row dequantizes and multiplies the whole matrix again (its re-reads come from cache, its
arithmetic does not): M rows cost M times one row's arithmetic, at qmv's own rate. A decode step
of B rows calls each linear layer with M = B (x is B x 1 x K, row contiguous).

qmm (and split-K qmm) tile M by bm = 32 rows: a layer over fewer rows than a tile multiplies the
whole tile, so its arithmetic is that of M rounded up to 32. (M5's qmm_nax tiles by 64 rows past 32
rows; here every family is charged 32-row tiles, so an M5 step of 65-96 rows is priced as 96 rows,
not 128.)

The GPU family is MLX's `get_architecture()` suffix: generation 13 (M1) to 17 (M5), size g (base),
s (Pro), c (Max), d (Ultra)."""

from __future__ import annotations

import re

GENERATION_OF_CHIP = {"M1": 13, "M2": 14, "M3": 15, "M4": 16, "M5": 17}
SIZE_OF_TIER = {"": "g", "Pro": "s", "Max": "c", "Ultra": "d"}
# get_qmv_batch_limit's thresholds: (generation at least, Ultra or not) -> limits for matrices with
# both dims <= 2048, both <= 4096, and larger; the first matching line applies.
_LIMITS = (
    (17, False, (33, 25, 13)),
    (15, False, (13, 15, 13)),
    (13, False, (14, 10, 6)),
    (0, True, (32, 18, 12)),
    (0, False, (18, 12, 10)),
)


def gpu_family(chip: str) -> str:
    """'M1 Ultra' -> 'g13d'; '' for a chip outside M1-M5 (no qmv pricing)."""
    m = re.fullmatch(r"(M\d)(?: (Pro|Max|Ultra))?", chip.strip())
    if not m or m.group(1) not in GENERATION_OF_CHIP:
        return ""
    return f"g{GENERATION_OF_CHIP[m.group(1)]}{SIZE_OF_TIER[m.group(2) or '']}"


def qmv_row_limit(family: str, k: int, n: int) -> int:
    """Rows from which MLX switches from qmv to qmm for a (k -> n) quantized matrix on `family`
    (get_qmv_batch_limit(D=k, O=n)); 0 for an unknown family (no qmv beyond one row)."""
    m = re.fullmatch(r"g(\d+)([gscd])", family)
    if not m:
        return 0
    gen, ultra = int(m.group(1)), m.group(2) == "d"
    for since, is_ultra, limits in _LIMITS:
        if gen >= since and is_ultra == ultra:
            small, medium, large = limits
            if k <= 2048 and n <= 2048:
                return small
            return medium if k <= 4096 and n <= 4096 else large
    return 0


def runs_qmv(family: str, m: int, k: int, n: int) -> bool:
    """Whether MLX runs an (m x k) @ quantized (k -> n) as qmv over several rows (m > 1)."""
    return 1 < m < qmv_row_limit(family, k, n)


QMM_TILE_ROWS = 32  # qmm's bm: the rows each threadgroup's tile multiplies


def qmm_rows(family: str, m: int) -> int:
    """The rows qmm's arithmetic covers for m rows on `family`: m rounded up to whole tiles (an
    unknown family: m)."""
    if not family or m <= 1:
        return m
    return -(-m // QMM_TILE_ROWS) * QMM_TILE_ROWS

