"""Every benchmark that imports mlx when loaded chooses MLX's BLAS first (blas.preload(), as the
CLI does): mlx imported earlier keeps its bundled reference BLAS, and the benchmark's float32
matmuls then run ~30x slower than under batchsim (docs/how-it-works.md: the paged-read ratios and
the draft paragraph's figures were measured so)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from batchsim.server.platform import blas

BENCHMARKS = sorted((Path(__file__).resolve().parents[1] / "benchmarks").glob("*.py"))
PROBE = ("import importlib.util, sys\n"
         "spec = importlib.util.spec_from_file_location('bench', sys.argv[1])\n"
         "spec.loader.exec_module(importlib.util.module_from_spec(spec))\n"
         "from batchsim.server.platform import blas\n"
         "print('mlx.core' in sys.modules, blas._choice.name if blas._choice else None)\n")


@pytest.mark.skipif(not blas.optimized_paths() or sys.platform == "darwin",
                    reason="needs an optimized BLAS on Linux")
@pytest.mark.parametrize("bench", BENCHMARKS, ids=lambda p: p.name)
def test_benchmark_loads_no_mlx_before_choosing_blas(bench):
    out = subprocess.run([sys.executable, "-c", PROBE, str(bench)], capture_output=True,
                         text=True, timeout=120, check=False, cwd=bench.parent)
    assert out.returncode == 0, out.stderr[-1500:]
    mlx_loaded, choice = out.stdout.split()
    assert mlx_loaded == "False" or choice not in ("None", "unknown"), (bench.name, choice)
