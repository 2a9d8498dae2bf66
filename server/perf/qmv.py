"""Which Metal kernel MLX runs for a quantized linear layer over a few rows, by Apple GPU family.

MLX's `QuantizedMatmul::eval_gpu` (mlx/backend/metal/quantized.cpp, ml-explore/mlx at 2026-08-22)
runs qmv, the matrix-vector kernel, for M < get_qmv_batch_limit(K, N, device) rows and qmm (or
split-K qmm) from there. qmv's grid is (M, N / bn, 1): one threadgroup per row and output block,
so every row dequantizes and multiplies the whole matrix again (its re-reads come from cache, its
arithmetic does not): the first row's pass hides under the weight stream from memory, as one row's
GEMV does, and each further row adds one pass's arithmetic at qmv's own rate. From MLX 0.32.0 on a
generation-15-or-later GPU (M3 on) an affine layer over 2 <= M rows runs qmv_wide instead (below):
each weight group dequantized once into a tile of up to 5 rows, one kernel whose weight stream
(once per tile) and rows' arithmetic overlap, so the larger binds (an M3 Max, 5120 -> 17408
4-bit, ml-explore/mlx #3863: 0.129 ms at M = 1 and 2, 0.165 / 0.323 ms at M = 4 / 8). A decode
step of B rows calls each linear layer with M = B (x is B x 1 x K, row contiguous).

qmm tiles M by bm = 32 rows: a layer over fewer rows than a tile multiplies the whole tile, so its
arithmetic is that of M rounded up to 32. Since MLX 0.31.2 (ml-explore/mlx #3120) a 2-D weight over
M >= the qmv limit runs split-K qmm (`qmm_splitk`: split_k = 512 / its 32 x 32 tiles, capped by
K's quantization groups and reduced until they divide K; split_k 1 falls back to plain qmm). Both
multiply on the shader ALUs, except on an M5 GPU (generation 17, macOS 26.2+: `is_nax_available`),
where plain qmm is `qmm_nax`, on the Neural Accelerators, in 64-row tiles past 32 rows. So a decode
step's layers over a few dozen rows (split-K) run at the shader rate even on an M5, and a long
prefill's (plain qmm) at the accelerators' (DeviceProfile.shader_flops_share prices the difference).
The accelerators' kernels came in MLX 0.30.0 (ml-explore/mlx 54f1cc6, #2772, 2025-11-19: qmm_nax,
gather_qmm_nax, gather_qmm_rhs_nax, steel GEMM and attention, behind is_nax_available): an older
MLX runs every qmm on the shader ALUs, an M5's too (the published M5 rows of MLX 0.29.3). MLX
0.30.0-0.31.1 ran qmm_nax for every M5 qmm (no split-K yet). They also need an MLX built with
them (MLX_ENABLE_NAX: Metal 4, the macOS 26.2 SDK) running on macOS 26.2 or later; neither is
modelled (an M5 is taken to run them). Only dense qmm is gated by MLX version here
(on_neural_accelerators, NAX_SINCE): routed experts (gather_qmm_rhs) and float GEMM / attention
on an M5 are priced at its FP16 (accelerators') peak whatever the MLX (review r3 #6, left open:
the published M5 rows of MLX 0.29.3 are dense 4-bit, their qmm gated, their attention not).

The GPU family is MLX's `get_architecture()` suffix: generation 13 (M1) to 17 (M5), size g (base),
s (Pro, and Max from the M2 on), c (the M1 Max alone), d (Ultra): Apple's names report an M2 Max
as applegpu_g14s, M4 Max g16s (ml-explore/mlx#3885, 2026-07-24) and M5 Max g17s (ml-explore/mlx
#3837, 2026-08-05); the M1 Max is the one 'c' part (CPU_SUBTYPE_APPLEGPU_G13C, Asahi's g13c)."""

from __future__ import annotations

import re
from functools import lru_cache

from batchsim.server.models.arch import QUANT_GROUP_SIZE

GENERATION_OF_CHIP = {"M1": 13, "M2": 14, "M3": 15, "M4": 16, "M5": 17}
SIZE_OF_TIER = {"": "g", "Pro": "s", "Max": "s", "Ultra": "d"}
M1_MAX_SIZE = "c"  # the M1 Max alone: its own die (T6001), not the Pro's
# get_qmv_batch_limit's thresholds by the MLX release that has them: (generation at least, Ultra or
# not) -> limits for matrices with both dims <= 2048, both <= 4096, and larger; the first matching
# line applies. ml-explore/mlx e7838d5 (#3791, 2026-08-08, first in v0.32.1) raised M5's and set
# M3/M4's; before it (9ba81e3, #2031, 2025-04-02: v0.24.2 to v0.32.0) M3-M5 shared the (18, 12, 10)
# line. Older MLX (#1503's first table, v0.19.1) is priced with v0.24.2's. A version '0.32.1.dev'
# is a build before its release, so without what came new in it (say the release where known).
_LIMITS_SINCE = (
    ((0, 32, 1, 0), (
        (17, False, (33, 25, 13)),
        (15, False, (13, 15, 13)),
        (13, False, (14, 10, 6)),
        (0, True, (32, 18, 12)),
        (0, False, (18, 12, 10)),
    )),
    ((0, 0, 0, 0), (
        (15, False, (18, 12, 10)),
        (13, False, (14, 10, 6)),
        (0, True, (32, 18, 12)),
        (0, False, (18, 12, 10)),
    )),
)


@lru_cache(maxsize=16)  # stepcost asks for each quantized layer it prices
def mlx_release(version: str) -> tuple[int, int, int, int]:
    """'0.32.0' -> (0, 32, 0, 0), '0.32.0.dev' -> (0, 32, 0, -1): a build before 0.32.0, without
    what came new in it (qmv_wide); '' (not stated) -> the newest table's."""
    m = re.match(r"(\d+)\.(\d+)\.(\d+)(.*)", version.strip())
    if not version.strip():
        return _LIMITS_SINCE[0][0]
    if not m:
        raise ValueError(f"MLX version {version!r}: expected like 0.32.0 or 0.32.0.dev")
    pre = re.match(r"[.-]?(dev|rc)", m.group(4))  # a build before its release
    return int(m.group(1)), int(m.group(2)), int(m.group(3)), -1 if pre else 0


_FAMILY = re.compile(r"g(\d+)([gscdp])")  # get_architecture()'s suffix: generation, size


def _generation_size(family: str) -> tuple[int, str] | None:
    """'g13d' -> (13, 'd'); None for an unknown family."""
    m = _FAMILY.fullmatch(family)
    return (int(m.group(1)), m.group(2)) if m else None


def gpu_family(chip: str) -> str:
    """'M1 Ultra' -> 'g13d'; '' for a chip outside M1-M5 (no qmv pricing)."""
    m = re.fullmatch(r"(M\d)(?: (Pro|Max|Ultra))?", chip.strip())
    if not m or m.group(1) not in GENERATION_OF_CHIP:
        return ""
    size = M1_MAX_SIZE if m.group(0) == "M1 Max" else SIZE_OF_TIER[m.group(2) or ""]
    return f"g{GENERATION_OF_CHIP[m.group(1)]}{size}"


def qmv_row_limit(family: str, k: int, n: int, mlx: str = "") -> int:
    """Rows from which MLX `mlx` ('': the newest) switches from qmv to qmm for a (k -> n) quantized
    matrix on `family` (get_qmv_batch_limit(D=k, O=n)); 0 for an unknown family (no qmv beyond
    one row)."""
    parsed = _generation_size(family)
    if not parsed:
        return 0
    gen, ultra = parsed[0], parsed[1] == "d"
    release = mlx_release(mlx)
    table = next(lines for since, lines in _LIMITS_SINCE if release >= since)
    for since, is_ultra, limits in table:
        if gen >= since and is_ultra == ultra:
            small, medium, large = limits
            if k <= 2048 and n <= 2048:
                return small
            return medium if k <= 4096 and n <= 4096 else large
    return 0


def runs_qmv(family: str, m: int, k: int, n: int, mlx: str = "") -> bool:
    """Whether MLX `mlx` ('': the newest) runs an (m x k) @ quantized (k -> n) as qmv over several
    rows (m > 1)."""
    return 1 < m < qmv_row_limit(family, k, n, mlx)


# ml-explore/mlx 548dd80 (#3764, 2026-06-26, first in v0.32.0; quantized.cpp 298-322): for
# 2 <= M < the qmv limit, dispatch_qmv runs qmv_wide where `use_qmv_wide` holds: mode != "affine"
# or architecture generation >= 15. It tiles the rows by at most 5 (n_tiles = ceil(M / 5)); each
# tile dequantizes each weight group once and multiplies it into its rows, so a tile's weight
# stream and its rows' arithmetic overlap as one row's do, and every tile re-reads the weights.
# Plain qmv re-reads and dequantizes the whole matrix for every row. batchsim prices every
# quantized layer as affine (a model description names no quantization mode; MXFP4 / NVFP4
# checkpoints are priced as 4-bit affine), so the non-affine modes' qmv_wide on every generation
# is not priced.
QMV_WIDE_GENERATION = 15
QMV_WIDE_SINCE = (0, 32, 0, 0)
QMV_WIDE_TILE_ROWS = 5  # qmv_wide's largest row tile (vecs_per_tg)


def runs_qmv_wide(family: str, mlx: str = "") -> bool:
    """Whether MLX `mlx` ('': the newest) runs an affine quantized layer over a few rows (qmv's
    range) as qmv_wide on `family`."""
    parsed = _generation_size(family)
    return bool(parsed) and parsed[0] >= QMV_WIDE_GENERATION and mlx_release(mlx) >= QMV_WIDE_SINCE


def qmv_parts(family: str, mlx: str, moved_s: float, rows_s: float,
              m: int) -> tuple[float, float, float]:
    """(weights_s, matmul_s, gemv_rows_s) of a layer MLX runs over m rows as qmv (each row past
    the first adds its share of rows_s, the first hides under the weight stream moved_s) or
    qmv_wide (ceil(m / 5) tiles, each streaming the weights; stream and rows overlap: the larger
    binds)."""
    if not runs_qmv_wide(family, mlx):
        return moved_s, 0.0, rows_s * (m - 1) / m
    stream_s = moved_s * -(-m // QMV_WIDE_TILE_ROWS)
    return (stream_s, 0.0, 0.0) if stream_s >= rows_s else (0.0, 0.0, rows_s)


QMM_TILE_ROWS = 32  # qmm's (and split-K qmm's) bm: the rows each threadgroup's tile multiplies
NAX_TILE_ROWS = 64  # qmm_nax's bm past one 32-row block
NAX_GENERATION = 17  # is_nax_available: architecture generation 17 on (18 for 'p' parts)
NAX_SINCE = (0, 30, 0, 0)  # the first MLX with Neural Accelerator kernels (54f1cc6, #2772)
SPLITK_SINCE = (0, 31, 2, 0)  # the first MLX with split-K qmm (38ad257, #3120, 2026-03-20)
SPLITK_TARGET_GROUPS = 512  # qmm_splitk's target threadgroups


@lru_cache(maxsize=64)
def has_neural_accelerators(family: str) -> bool:
    """Whether MLX runs plain qmm on the GPU's Neural Accelerators (qmm_nax) on `family`."""
    parsed = _generation_size(family)
    return bool(parsed) and parsed[0] >= NAX_GENERATION + (parsed[1] == "p")


def split_k(m: int, k: int, n: int) -> int:
    """qmm_splitk's K partitions for an (m x k) @ quantized (k -> n) (1: it runs plain qmm)."""
    tiles = -(-n // QMM_TILE_ROWS) * -(-m // QMM_TILE_ROWS)
    split = min(max(1, SPLITK_TARGET_GROUPS // tiles), k // QUANT_GROUP_SIZE)
    while split > 1 and k % (split * QUANT_GROUP_SIZE):
        split -= 1
    return split


def on_neural_accelerators(family: str, m: int, k: int, n: int, mlx: str = "") -> bool:
    """Whether MLX `mlx` ('': the newest) multiplies a quantized layer over m rows (qmm: m at least
    the qmv limit) on the Neural Accelerators: an M5 family on MLX 0.30.0 or later, running plain
    qmm (split-K, from 0.31.2, not taken)."""
    release = mlx_release(mlx)
    if not has_neural_accelerators(family) or release < NAX_SINCE:
        return False
    return release < SPLITK_SINCE or split_k(m, k, n) <= 1


def qmm_rows(family: str, m: int, nax: bool = False) -> int:
    """The rows qmm's arithmetic covers for m rows on `family`: m rounded up to whole tiles, 64-row
    tiles past 32 rows on the Neural Accelerators (`nax`); an unknown family: m."""
    if not family or m <= 1:
        return m
    tile = NAX_TILE_ROWS if nax and m > QMM_TILE_ROWS else QMM_TILE_ROWS
    return -(-m // tile) * tile
