"""`batchsim roofline`: the roofline arithmetic against hand-computed values, the skip rules, and a
tiny real run that checks the output contract and that every reported number is self-consistent."""

from __future__ import annotations

import argparse
import json
import math
import subprocess
import sys
from pathlib import Path

import pytest
from batchsim.scripts.common import dumps
from batchsim.server.measure import microbench as mb


def test_gemv_intensity_float32_n1024_by_hand():
    # y = W x: 2*N*N FLOPs over (N*N matrix + N input + N output) * 4 bytes
    assert mb.matmul_flops(1, 1024) == 2_097_152
    assert mb.matmul_bytes(1, 1024, "float32") == 4_202_496
    by_hand = 2 * 1024 * 1024 / ((1024 * 1024 + 2048) * 4)
    assert mb.intensity(1, 1024, "float32") == pytest.approx(by_hand)
    assert mb.intensity(1, 1024, "float32") == pytest.approx(0.499025, rel=1e-6)


def test_gemm_intensity_half_precision_by_hand():
    # N x N @ N x N in float16: 2N^3 FLOPs over 3 N*N matrices of 2 bytes -> N / 3 FLOP/byte
    assert mb.matmul_flops(1024, 1024) == 2 * 1024**3
    assert mb.matmul_bytes(1024, 1024, "float16") == 3 * 1024 * 1024 * 2
    assert mb.intensity(1024, 1024, "float16") == pytest.approx(1024 / 3)
    assert mb.intensity(1024, 1024, "bfloat16") == mb.intensity(1024, 1024, "float16")
    # batch B << N in 2-byte dtypes: the weights dominate the traffic, so intensity ~ B
    assert mb.intensity(8, 8192, "float16") == pytest.approx(8 * 8192 / (8192 + 16))


def test_intensity_grows_with_batch_toward_n_over_dtype_bytes():
    n = 4096
    values = [mb.intensity(b, n, "float32") for b in mb.sweep_batches(n)]
    assert values == sorted(values) and len(set(values)) == len(values)
    assert values[-1] < n / 4
    assert mb.intensity(10**9, n, "float32") == pytest.approx(n / 4, rel=1e-5)
    assert mb.intensity(10**9, n, "float16") == pytest.approx(n / 2, rel=1e-5)


def test_unknown_dtype_is_an_error():
    with pytest.raises(ValueError, match="int8"):
        mb.intensity(1, 16, "int8")


def test_ridge_and_roof():
    assert mb.ridge_intensity(100.0, 10.0) == 10.0
    assert mb.roof_gflops(1.0, 100.0, 10.0) == 10.0  # on the bandwidth slope
    assert mb.roof_gflops(50.0, 100.0, 10.0) == 100.0  # on the compute roof


def test_first_compute_bound_batch_by_hand():
    # float32, N=4096: intensity = B*N / (2*(N + 2B)); B=4 -> 1.995, B=8 -> 3.98
    assert mb.first_compute_bound(mb.sweep_batches(4096), 4096, "float32", ridge=2.0) == 8
    assert mb.first_compute_bound([1, 2], 4096, "float32", ridge=2.0) is None


def test_sweep_batches():
    assert mb.sweep_batches(1) == [1]
    assert mb.sweep_batches(4) == [1, 2, 4]
    assert mb.sweep_batches(12288) == [1 << k for k in range(14)] + [12288]


def test_copies_stream_the_working_set_unless_slow_or_too_big():
    mib = 1 << 20
    assert mb.copies_for(4 * mib, 1e-4, working_set_bytes=128 * mib) == 32
    assert mb.copies_for(4 * mib, 1.0, working_set_bytes=128 * mib) == 1  # compute-bound anyway
    assert mb.copies_for(4 * mib, 1e-4, working_set_bytes=128 * mib, memory_bytes=40 * mib) == 10
    assert mb.copies_for(1024, 1e-6, working_set_bytes=128 * mib) == mb.MAX_COPIES


def test_point_numbers_are_consistent():
    p = mb.MatmulPoint(n=1024, batch=1, dtype="float32", seconds=1e-3, reps=9, copies=4)
    assert p.shape == "gemv"
    assert p.gflops == pytest.approx(2 * 1024 * 1024 / 1e-3 / 1e9)
    assert p.gbytes_s == pytest.approx(4_202_496 / 1e-3 / 1e9)
    assert p.gflops / p.gbytes_s == pytest.approx(p.intensity)


def test_rate_book_estimates_from_smaller_batches_and_bandwidth():
    book = mb.RateBook(bandwidth_gbs=10.0)
    assert book.estimate_s(1, 1024, "float32") == math.inf
    book.record(mb.MatmulPoint(256, 1, "float32", seconds=1e-6, reps=3, copies=1))  # in-cache fast
    book.record(mb.MatmulPoint(256, 256, "float32", seconds=2 * 256**3 / 1e9, reps=3, copies=1))
    # GEMV: the recorded rate would say 8 us; streaming 4.2 MB at 10 GB/s takes longer
    assert book.estimate_s(1, 1024, "float32") == pytest.approx(4_202_496 / 10e9)
    # batch 512 uses the batch-256 rate (1 GFLOP/s), not the GEMV's
    assert book.estimate_s(512, 1024, "float32") == pytest.approx(2 * 512 * 1024**2 / 1e9)
    assert book.estimate_s(1, 1024, "float16") == math.inf


def test_points_that_are_too_slow_or_too_big_are_skipped_without_running():
    book = mb.RateBook(bandwidth_gbs=10.0)
    book.record(mb.MatmulPoint(256, 256, "float16", seconds=2 * 256**3 / 1e9, reps=3, copies=1))
    slow = mb.measure_or_skip(8192, 8192, "float16", mb.BenchConfig(max_s_per_point=10), book)
    assert isinstance(slow, mb.Skip) and slow.shape == "gemm"
    assert slow.estimated_s == pytest.approx(2 * 8192**3 / 1e9 * 10) and "per point" in slow.reason
    big = mb.measure_or_skip(1, 8192, "float32", mb.BenchConfig(memory_bytes=1 << 20), book)
    assert isinstance(big, mb.Skip) and "memory budget" in big.reason


def test_bench_asks_each_point_once_and_peak_needs_a_measured_gemm():
    book = mb.RateBook(bandwidth_gbs=10.0)
    book.record(mb.MatmulPoint(256, 1, "float32", seconds=1.0, reps=3, copies=1))  # 1 s per GEMV
    seen = []
    bench = mb.Bench(mb.BenchConfig(max_s_per_point=1.0), book, seen.append)
    table = mb.gemv_gemm_rows(bench, [512, 256, 512], ["float32"])
    sweep = mb.batch_sweep_rows(bench, 256, ["float32"])
    assert [(r.batch, r.n) for r in table] == [(1, 256), (256, 256), (1, 512), (512, 512)]
    assert all(isinstance(r, mb.Skip) for r in table + sweep)
    assert sweep[0] is table[0] and sweep[-1] is table[1]  # B=1 and B=N reused
    assert len(seen) == len(bench.results) == 4 + len(mb.sweep_batches(256)) - 2
    assert mb.peak_rows(bench, ["float32"]) == []  # every ladder GEMM too slow: no peak point


def test_modules_do_not_import_mlx():
    code = ("import sys, batchsim.scripts.roofline, batchsim.server.measure.microbench; "
            "assert 'mlx.core' not in sys.modules")
    subprocess.run([sys.executable, "-c", code], check=True)


def _args(tmp_path, *extra: str) -> argparse.Namespace:
    from batchsim.scripts import roofline

    p = argparse.ArgumentParser()
    roofline.add_parser(p)
    return p.parse_args(["--n", "256", "--dtypes", "float32", "--reps", "3", "--bandwidth-mb", "32",
                         "--out", str(tmp_path), *extra])


def test_flags_parse():
    from batchsim.scripts import roofline

    p = argparse.ArgumentParser()
    roofline.add_parser(p)
    args = p.parse_args(["--n", "1024,2048", "--dtypes", "float32,float16", "--reps", "9"])
    assert (args.n, args.dtypes, args.reps) == ([1024, 2048], ["float32", "float16"], 9)


def test_tiny_run_contract_files_and_consistency(tmp_path):
    from batchsim.scripts import roofline

    summary = roofline.run(_args(tmp_path, "--max-seconds-per-point", "1"))
    doc = json.loads(dumps(summary))  # what the CLI prints as its last line
    assert {"rows", "bandwidth_gbs", "peak_gflops", "skipped", "png", "jsonl", "env"} <= doc.keys()
    assert doc["bandwidth_gbs"] > 0 and set(doc["peak_gflops"]) == {"float32"}
    shapes = {r["shape"]: r for r in doc["rows"]}
    assert set(shapes) == {"gemv", "gemm"}
    for r in doc["rows"] + doc["sweep"]["rows"] + doc["peak_rows"]:
        assert {"n", "dtype", "shape", "gflops", "gbytes_s", "intensity"} <= r.keys()
        assert r["intensity"] == pytest.approx(mb.intensity(r["batch"], r["n"], r["dtype"]))
        assert r["gflops"] == pytest.approx(r["flops"] / r["seconds"] / 1e9)
        assert r["gbytes_s"] == pytest.approx(r["bytes"] / r["seconds"] / 1e9)
        assert r["gflops"] <= doc["peak_gflops"]["float32"] * (1 + 1e-9)
    assert [r["batch"] for r in doc["sweep"]["rows"]] == mb.sweep_batches(256)
    assert [r["shape"] for r in doc["peak_rows"]] == ["gemm"]  # the compute roof's own GEMM
    assert doc["peak_gflops"]["float32"] == max(r["gflops"] for r in doc["rows"]
                                                + doc["sweep"]["rows"] + doc["peak_rows"])
    assert shapes["gemm"]["gflops"] > shapes["gemv"]["gflops"]  # ~10x on a 2-core CPU

    assert doc["png"].startswith(str(tmp_path))
    assert Path(doc["png"]).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    records = [json.loads(line) for line in Path(doc["jsonl"]).read_text().splitlines()]
    assert {r["record"] for r in records} >= {"bandwidth", "peak", "point"}
    for r in records:
        assert r["env"]["backend"] in ("cpu", "metal", "cuda")
        assert r["env"]["mlx_cache_limit_bytes"] > 0
        assert r["env"]["blas"] and r["env"]["dtype"] == "float32"


def test_quantized_bytes_by_hand_and_as_models_hold_them():
    from batchsim.server.models.arch import quantized_matrix_bytes

    n = 1024  # q4: half a byte per weight, a float16 scale and bias per 64 weights
    assert mb.weight_bytes(n, "q4") == n * n // 2 + 2 * 2 * n * n // 64
    assert mb.weight_bytes(n, "q4") == quantized_matrix_bytes(n, n, 4)
    assert mb.weight_bytes(n, "q8") == quantized_matrix_bytes(n, n, 8)
    # float32 activations (the CPU backend): scales and biases in float32 too, and X, Y
    assert mb.matmul_bytes(1, n, "q8", "float32") == n * n + 2 * 4 * n * n // 64 + 2 * 4 * n
    assert mb.intensity(1, n, "q4") > 3.5 * mb.intensity(1, n, "float16")  # ~4x fewer bytes
    p = mb.MatmulPoint(n, 1, "q4", seconds=1e-3, reps=3, copies=1, act="float32")
    assert p.row()["act_dtype"] == "float32" and p.row()["dtype"] == "q4"
    assert p.bytes == mb.matmul_bytes(1, n, "q4", "float32")
    with pytest.raises(ValueError, match="int8"):
        mb.intensity(1, 64, "q4", "int8")


def test_quantized_multiply_matches_dequantized_weights():
    """time_matmul's quantized path multiplies what mlx-lm's QuantizedLinear does."""
    import mlx.core as mx

    w = mx.random.uniform(-1, 1, (128, 128))
    x = mx.random.uniform(-1, 1, (3, 128))
    dense = mx.dequantize(*mx.quantize(w, group_size=64, bits=4), group_size=64, bits=4)
    mul = mb._multiply(mx, w, "q4")
    assert mx.allclose(mul(x), x @ dense.T, atol=1e-4).item()


def test_tiny_quantized_run_rows_carry_q4_q8(tmp_path):
    from batchsim.scripts import roofline

    args = _args(tmp_path, "--max-seconds-per-point", "1", "--sweep-n", "128")
    args.dtypes = ["float32", "q4", "q8"]
    doc = json.loads(dumps(roofline.run(args)))
    act = doc["env"]["quant_act_dtype"]
    assert act == ("float32" if doc["env"]["backend"] == "cpu" else "float16")
    for dtype in ("q4", "q8"):
        rows = [r for r in doc["rows"] + doc["sweep"]["rows"] if r["dtype"] == dtype]
        assert {r["shape"] for r in rows} == {"gemv", "gemm", "batch"}
        for r in rows:
            assert r["bound"] in ("memory", "compute") and r["gflops"] > 0
            assert r["act_dtype"] == act
            assert r["bytes"] == mb.matmul_bytes(r["batch"], r["n"], dtype, act)
        assert doc["peak_gflops"][dtype] > 0


def test_unknown_format_is_a_one_line_error(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "batchsim.scripts.cli", "roofline", "--dtypes",
                           "q3", "--out", str(tmp_path)], capture_output=True, check=False,
                           text=True, timeout=120)
    assert proc.returncode != 0 and "Traceback" not in proc.stderr
    assert "q4" in proc.stderr and "q3" in proc.stderr


def test_plot_labels_do_not_overprint(tmp_path, monkeypatch):
    """A loaded machine's GEMVs land close together (0.40-0.46 GFLOP/s at one intensity, beside a
    sweep point): their labels overprinted each other in the README's roofline.png."""
    from batchsim.scripts import roofline

    figures = []
    monkeypatch.setattr(roofline, "save_figure", lambda fig, path, **_: figures.append(fig))
    gemv = [{"dtype": "float32", "batch": 1, "n": n, "intensity": 0.5, "gflops": g,
             "shape": "gemv"} for n, g in ((1024, 0.40), (2048, 0.42), (4096, 0.44),
                                           (8192, 0.46))]
    sweep = [{"dtype": "q4", "batch": 2, "n": 4096, "intensity": 0.55, "gflops": 0.43,
              "shape": "batch"}]
    summary = {"bandwidth_gbs": 4.7, "peak_gflops": {"float32": 42.8, "q4": 1.3},
               "ridge_flop_per_byte": {"float32": 9.1, "q4": 0.28}, "rows": gemv,
               "sweep": {"rows": sweep, "n": 4096}, "peak_rows": [],
               "env": {"device_name": None, "cpu": "CPU", "backend": "cpu", "blas": "openblas",
                       "mlx": "0"}}
    roofline._plot(tmp_path / "r.png", summary)
    fig = figures[0]
    fig.canvas.draw()
    renderer = fig.canvas.get_renderer()
    from matplotlib.text import Text  # the text's box alone, not its line to the point

    boxes = [Text.get_window_extent(t, renderer) for t in fig.axes[0].texts]
    assert len(boxes) == 5
    for i, a in enumerate(boxes):
        for b in boxes[i + 1:]:
            assert not a.overlaps(b), (a, b)
