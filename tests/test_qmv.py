"""MLX's qmv/qmm choice for a quantized layer over a few rows (server/perf/qmv.py) and its price on
a catalog Mac: every row's arithmetic at qmv's own rate, a named part of the step."""

from __future__ import annotations

import dataclasses

import pytest
from batchsim.server.perf import gpu_fit, macs
from batchsim.server.perf.batch_gain import catalog_cost
from batchsim.server.perf.qmv import (
    QMV_WIDE_TILE_ROWS,
    gpu_family,
    has_neural_accelerators,
    on_neural_accelerators,
    qmm_rows,
    qmv_parts,
    qmv_row_limit,
    runs_qmv,
    runs_qmv_wide,
    split_k,
)
from batchsim.server.perf.reference import load_published
from batchsim.server.perf.stepcost import StepCost
from batchsim.server.published import fit as published_fit
from batchsim.server.published.sim import MacModel, row_cost


@pytest.mark.parametrize("chip,family", [("M1", "g13g"), ("M1 Ultra", "g13d"), ("M3 Pro", "g15s"),
                                         ("M1 Max", "g13c"), ("M2 Max", "g14s"), ("M4 Max", "g16s"),
                                         ("M5 Max", "g17s"), ("A17", "")])
def test_gpu_family_of_chip(chip, family):
    assert gpu_family(chip) == family


@pytest.mark.parametrize("family,k,n,limit", [
    ("g17c", 1024, 2048, 33), ("g17c", 1024, 3072, 25), ("g17c", 1024, 151936, 13),
    ("g16c", 2048, 2048, 13), ("g16c", 4096, 4096, 15), ("g15g", 8192, 4096, 13),
    ("g15d", 4096, 4096, 18), ("g13d", 4096, 14336, 12), ("g13c", 2048, 2048, 14),
    ("g14s", 4096, 1024, 10), ("g13g", 5120, 5120, 6), ("", 4096, 4096, 0)])
def test_limits_are_mlx_get_qmv_batch_limit(family, k, n, limit):
    """mlx/backend/metal/quantized.cpp get_qmv_batch_limit(D=k, O=n, device), by family."""
    assert qmv_row_limit(family, k, n) == limit
    assert not runs_qmv(family, 1, k, n)  # one row: the plain GEMV (priced as before)
    assert runs_qmv(family, limit - 1, k, n) == (limit > 2)
    assert not runs_qmv(family, limit, k, n)


@pytest.mark.parametrize("family,k,n,before,since", [
    ("g17c", 1024, 2048, 18, 33), ("g17c", 1024, 3072, 12, 25), ("g16c", 2048, 2048, 18, 13),
    ("g15s", 4096, 4096, 12, 15), ("g13g", 2048, 2048, 14, 14), ("g17d", 4096, 4096, 18, 18)])
def test_limits_by_the_mlx_release_that_ran(family, k, n, before, since):
    """ml-explore/mlx e7838d5 (first in v0.32.1) changed M3-M5's limits; a 0.32.0 dev build and
    every release before it have the older table ('': the newest)."""
    for version in ("0.32.0.dev", "0.32.0", "0.31.2", "0.29.2.dev"):
        assert qmv_row_limit(family, k, n, version) == before
    for version in ("0.32.1", "0.33.0", ""):
        assert qmv_row_limit(family, k, n, version) == since
    with pytest.raises(ValueError, match="MLX version"):
        qmv_row_limit(family, k, n, "main")


def test_a_published_row_is_priced_with_the_kernels_of_its_mlx():
    """mlx-lm PR 1540's B=32 (M5 Max, Qwen3-0.6B 4-bit, mlx 0.32.0.dev): its attention projections
    (1024 -> 2048, 2048 -> 1024) ran split-K qmm (limit 18), not qmv as the newest MLX would."""
    row = next(r for r in load_published().rows if r.id == "mlxlmbatch-m5max-qwen3-0.6b-q4-b32")
    assert row.mlx_version == "0.32.0.dev"
    model = MacModel(gpu_fit.load_fit())
    ran = row_cost(row, macs.load_catalog(), model)
    newest = row_cost(dataclasses.replace(row, mlx_version=None), macs.load_catalog(), model)
    assert ran.profile.mlx_version == "0.32.0.dev" and newest.profile.mlx_version == ""
    family = ran.profile.gpu_family
    assert not runs_qmv(family, 32, 1024, 2048, "0.32.0.dev") and runs_qmv(family, 32, 1024, 2048)
    ran_step, newest_step = ran.decode_time(32, 192), newest.decode_time(32, 192)
    assert ran_step.gemv_rows_s == 0
    # qmv_wide's 7 five-row tiles each stream the projections' weights
    assert newest_step.weights_s > ran_step.weights_s


def test_qmv_rows_cost_their_arithmetic_at_its_own_rate():
    """Llama-3.1-8B 4-bit on an M1 Ultra: every matrix runs qmv below 12 rows. With the fitted
    qmv rate each row past the first adds its FLOPs at that rate (gemv_rows_s: plain qmv on an M1,
    whose first row's pass hides under the weight stream), so the step grows with the rows, more
    than priced as a GEMM (the rate unset: 32-row qmm tiles at the GEMM rate).
    """
    cost = catalog_cost("llama-3.1-8b", "M1 Ultra 64c")
    assert cost.profile.gpu_family == "g13d" and cost.profile.quantized_gemv_row_gflops > 0
    one, eight = cost.decode_time(1, 512), cost.decode_time(8, 512)
    assert one.gemv_rows_s == 0 and eight.matmul_s == 0 and eight.gemv_rows_s > 0
    flops = 2 * 8 * cost.spec.num_params  # about: every weight multiplied once per row
    rate = cost.profile.quantized_gemv_row_gflops * 1e9
    assert eight.gemv_rows_s == pytest.approx(7 / 8 * flops / rate, rel=0.1)
    assert cost.decode_time(16, 512).gemv_rows_s < eight.gemv_rows_s  # 16 rows: qmm again
    as_gemm = StepCost(cost.spec, dataclasses.replace(cost.profile, quantized_gemv_row_gflops=0),
                       "float16", 4, engine=cost.engine)
    plain = as_gemm.decode_time(8, 512)
    assert plain.gemv_rows_s == 0 and eight.total_s > plain.total_s
    assert sum(cost.linear_split(8, 4096, 4096)) == sum(cost.linear_parts(8, 4096, 4096))


def test_qmv_rows_overlap_the_weight_stream_in_one_kernel():
    """qmv_wide (MLX 0.32.0 on, M3 on) over m <= 5 rows is one tile whose weight stream and rows'
    arithmetic overlap: the larger binds, as for one row. A few rows whose arithmetic is under the
    stream cost what one row does (M3 Max, 5120 -> 17408 4-bit, ml-explore/mlx #3863: 0.129 ms at
    M=1 and 2); past it, each row adds its arithmetic (0.165 / 0.323 ms at M=4 / 8). Plain qmv
    (before 0.32.0) adds every row past the first instead (the test below)."""
    cost = catalog_cost("llama-3.1-8b", "M3 Max 40c")
    k, n = 4096, 14336
    assert runs_qmv_wide(cost.profile.gpu_family, cost.profile.mlx_version)
    assert runs_qmv(cost.profile.gpu_family, 5, k, n)
    moved_s = cost.linear_parts(1, k, n)[0]
    row_s = 2 * k * n / (cost.profile.quantized_gemv_row_gflops * 1e9)
    fit = [m for m in range(2, QMV_WIDE_TILE_ROWS + 1) if m * row_s <= moved_s]
    over = [m for m in range(2, QMV_WIDE_TILE_ROWS + 1) if m * row_s > moved_s]
    assert fit and over  # both sides within one tile for this layer on this chip
    assert cost.linear_parts(max(fit), k, n) == pytest.approx((moved_s, 0.0, 0.0), rel=1e-2)
    m = min(over)
    assert cost.linear_parts(m, k, n) == pytest.approx((0.0, 0.0, m * row_s))
    assert sum(cost.linear_parts(m, k, n)) < moved_s + m * row_s  # not the two added


def test_qmv_wide_streams_the_weights_once_per_five_row_tile():
    """ml-explore/mlx 548dd80, quantized.cpp qmv_wide: n_tiles = ceil(M / 5), each tile re-reads
    the weights; within a tile stream and rows overlap (the larger binds)."""
    assert [qmv_parts("g15c", "", 1.0, 0.1, m)[0] for m in (2, 5, 6, 10, 11)] == [1, 1, 2, 2, 3]
    assert qmv_parts("g15c", "", 1.0, 2.5, 6) == (0.0, 0.0, 2.5)  # rows bind over 2 streams
    assert qmv_parts("g15c", "", 1.0, 1.5, 6) == (2.0, 0.0, 0.0)  # 2 streams bind over rows
    assert qmv_parts("g14c", "", 1.0, 1.5, 6) == (1.0, 0.0, 1.25)  # plain qmv: no tiles


@pytest.mark.parametrize("family,mlx,wide", [
    ("g15c", "", True), ("g15d", "0.32.0", True), ("g17g", "0.32.1", True),
    ("g16s", "0.31.2", False), ("g14c", "", False), ("g13d", "0.32.1", False), ("", "", False),
    ("g17c", "0.32.0.dev", False), ("g17c", "0.32.1.dev", True), ("g15c", "0.32.0rc1", False)])
def test_qmv_wide_from_mlx_0_32_0_on_m3_and_later(family, mlx, wide):
    """ml-explore/mlx 548dd80 (#3764, first in v0.32.0): use_qmv_wide for affine weights is
    get_architecture_gen() >= 15; a 0.32.0.dev build is before the release (mlx_lm_1540's rows)."""
    assert runs_qmv_wide(family, mlx) == wide


def test_plain_qmv_adds_every_row_past_the_first():
    """Before MLX 0.32.0 (or on an M1/M2) qmv re-reads and dequantizes the matrix for every row:
    the first row's pass is a one-row GEMV's, hidden under the weight stream; each further row adds
    its arithmetic. So a step is continuous from one row to two (the second row's arithmetic)."""
    cost = catalog_cost("llama-3.1-8b", "M3 Max 40c")
    old = StepCost(cost.spec, dataclasses.replace(cost.profile, mlx_version="0.31.2"), "float16",
                   4, engine=cost.engine)
    k, n = 4096, 14336
    row_s = 2 * k * n / (cost.profile.quantized_gemv_row_gflops * 1e9)
    assert old.linear_parts(1, k, n)[2] == 0
    for m in (2, 4, 8):
        moved_s, _, rows_s = old.linear_parts(m, k, n)
        assert moved_s == pytest.approx(old.linear_parts(1, k, n)[0], rel=1e-2)
        assert rows_s == pytest.approx((m - 1) * row_s)
        assert sum(old.linear_parts(m, k, n)) >= sum(cost.linear_parts(m, k, n))


def test_qmm_multiplies_whole_tiles_of_rows():
    """qmm's tile is 32 rows: 16 rows cost 32 rows' arithmetic, so the step does not get cheaper
    when the batch crosses from qmv to qmm (Llama-3.2-1B 4-bit, M4 Max: qmv below 13 rows)."""
    assert [qmm_rows("g16c", m) for m in (1, 13, 32, 33)] == [1, 32, 32, 64]
    assert qmm_rows("", 13) == 13
    cost = catalog_cost("llama-3.2-1b", "M4 Max 40c")
    steps = [cost.decode_time(b, 1024).total_s for b in (1, 8, 12, 13, 16, 32)]
    assert steps == sorted(steps)
    _, flops_16 = cost.linear_split(16, 2048, 8192)
    _, flops_32 = cost.linear_split(32, 2048, 8192)
    assert flops_16 == pytest.approx(flops_32)


def test_an_m1_m2_ultra_pays_its_own_qmv_slowdown_an_m3_on_ultra_none():
    """GpuFit.ultra_gemv_row_slowdown is added to qmv's 1 / efficiency on M1/M2 Ultra chips only:
    an M3-on Ultra prices qmv's rows at the one-die chips' share of its peak (no term of its own
    is fitted: published.fit has no column for it)."""
    fit = gpu_fit.load_fit()
    catalog = macs.load_catalog()
    ultra, m2u, m3u, mx = (next(m for m in catalog.chips if m.chip == chip)
                           for chip in ("M1 Ultra", "M2 Ultra", "M3 Ultra", "M1 Max"))
    slow = dataclasses.replace(fit, quantized_gemv_row_efficiency=0.5, ultra_gemv_row_slowdown=2.0)
    for mac, slowdown in ((ultra, 4.0), (m2u, 4.0), (m3u, 2.0), (mx, 2.0)):
        profile = gpu_fit.mac_profile(mac, slow, 4)
        assert profile.quantized_gemv_row_gflops == pytest.approx(
            profile.tflops("float16") * 1e3 / slowdown)
    assert gpu_fit.ultra_qmv_term("M3 Ultra") == gpu_fit.ultra_qmv_term("M5 Max") == ""
    assert not any("m3" in col for col in published_fit.DEVICE)


@pytest.mark.parametrize("m,k,n,split", [
    (32, 1024, 2048, 8),  # 64 tiles: 512 / 64
    (32, 1024, 3072, 4),  # 96 tiles: 5, cut to 4 so that 4 x 64 divides K
    (32, 3072, 1024, 16),
    (32, 1024, 151936, 1),  # 4748 tiles: plain qmm
    (128, 4096, 4096, 1),  # 512 tiles
    (4, 128, 256, 2)])  # capped by K's two quantization groups
def test_split_k_is_mlx_qmm_splitk(m, k, n, split):
    """mlx/backend/metal/quantized.cpp qmm_splitk (MLX 0.31.2 on): 512 / tiles, capped and cut."""
    assert split_k(m, k, n) == split


def test_an_m5_decode_qmm_multiplies_at_the_shader_rate():
    """On an M5 (Neural Accelerators; its catalog FP16 peak is theirs) a decode layer over 32 rows
    runs split-K qmm on the shader ALUs: its FLOPs at the FP32 shader peak. The lm head (plain qmm:
    qmm_nax) keeps the accelerators' peak, and an M4 Max (no accelerators) is unchanged."""
    assert has_neural_accelerators("g17c") and not has_neural_accelerators("g16c")
    m5 = catalog_cost("qwen3-0.6b", "M5 Max 40c")
    share = m5.profile.shader_flops_share
    assert share == pytest.approx(17.18 / 49.5)
    flat = StepCost(m5.spec, dataclasses.replace(m5.profile, shader_flops_share=1.0), "float16", 4,
                    engine=m5.engine)
    assert not runs_qmv("g17c", 32, 1024, 3072) and split_k(32, 1024, 3072) > 1
    assert m5.linear_parts(32, 1024, 3072)[1] == pytest.approx(
        flat.linear_parts(32, 1024, 3072)[1] / share)
    assert m5.linear_parts(32, 1024, 151936) == flat.linear_parts(32, 1024, 151936)
    assert m5.decode_time(32, 256).total_s > flat.decode_time(32, 256).total_s
    assert catalog_cost("qwen3-0.6b", "M4 Max 40c").profile.shader_flops_share == 1.0


def test_qmm_nax_tiles_64_rows_past_32():
    """qmm_nax's bm: 32 rows when one block covers M, else 64 (an M5's prefill chunk)."""
    assert [qmm_rows("g17c", m, nax=True) for m in (13, 32, 33, 65)] == [32, 32, 64, 128]
    assert qmm_rows("g17c", 65) == 96


@pytest.mark.parametrize("mlx, lm_head_nax, layer_nax", [
    ("0.29.3", False, False),  # before the Neural Accelerator kernels: every qmm on the shaders
    ("0.29.9", False, False),
    ("0.30.0.dev", False, False),  # a build before 0.30.0 (mlx_release: (0, 30, 0, -1))
    ("0.30.0", True, True),  # the first release with qmm_nax
    ("0.31.1", True, True),  # qmm_nax for every qmm: no split-K yet
    ("0.31.2.dev", True, True),  # a build before split-K
    ("0.31.2", True, False),  # split-K qmm (shader) for the 32-row layer, qmm_nax for the lm head
    ("", True, False),
])
def test_an_m5_runs_qmm_on_the_neural_accelerators_from_mlx_0_30(mlx, lm_head_nax, layer_nax):
    """ml-explore/mlx 54f1cc6 (#2772, first in v0.30.0) added qmm_nax; 38ad257 (#3120, v0.31.2)
    split-K qmm, which runs on the shader ALUs. The published M5 rows of MLX 0.29.3 (mlxlm-m5-*)
    had no accelerator kernel: their 32-row lm head multiplies at the shader rate."""
    assert on_neural_accelerators("g17g", 32, 3072, 128256, mlx) is lm_head_nax
    assert on_neural_accelerators("g17g", 32, 1024, 3072, mlx) is layer_nax
    assert not on_neural_accelerators("g16s", 512, 4096, 4096, mlx)
    m5 = catalog_cost("llama-3.2-3b", "M5 10c")
    old, new = (StepCost(m5.spec, dataclasses.replace(m5.profile, mlx_version=v), "float16", 4,
                         engine=m5.engine) for v in ("0.29.3", "0.31.2"))
    share = m5.profile.shader_flops_share
    assert share < 1
    assert old.linear_parts(32, 3072, 128256)[1] == pytest.approx(
        new.linear_parts(32, 3072, 128256)[1] / share)
