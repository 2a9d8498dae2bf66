"""benchmarks/spec_decode.py measures on the BLAS the CLI would choose: it calls blas.preload()
before anything imports mlx (its serial drafter imports draft_model, which imports mlx), and it
refuses to report runs whose BLAS is unknown while an optimized one is installed."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest
from batchsim.server.platform import blas

from tests.cli_calls import last_json

BENCH = Path(__file__).resolve().parents[1] / "benchmarks" / "spec_decode.py"
ARGV = ["--model", "tiny", "--draft-model", "tiny", "--drafters", "serial", "--batch", "1",
        "--spec-tokens", "2", "--max-tokens", "4", "--input-len", "8"]
# Runs the benchmark as `python benchmarks/spec_decode.py ARGV` does, after `import mlx.core`
# when argv[1] says so (what the harness did by accident before it preloaded BLAS).
RUNNER = ("import runpy, sys\n"
          "sys.argv[0] = sys.argv.pop(1)\n"
          "if sys.argv.pop(1) == 'mlx-first':\n    import mlx.core\n"
          "runpy.run_path(sys.argv[0], run_name='__main__')\n")


def _bench():
    spec = importlib.util.spec_from_file_location("spec_decode_bench", BENCH)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    return bench


def _run(order: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", RUNNER, str(BENCH), order, *ARGV],
                          capture_output=True, text=True, timeout=300, check=False)


def test_env_check_refuses_unknown_blas_only_when_an_optimized_one_is_installed(monkeypatch):
    bench = _bench()
    unknown = {"blas": "unknown", "blas_note": "mlx was imported before batchsim chose a BLAS"}
    monkeypatch.setattr(blas, "optimized_paths", lambda: ["/lib/libopenblas.so.0"])
    with pytest.raises(SystemExit, match="BLAS is unknown .*libopenblas"):
        bench.check_env(unknown)
    bench.check_env({"blas": "openblas"})
    monkeypatch.setattr(blas, "optimized_paths", list)
    bench.check_env(unknown)  # nothing better to load: the reference path is all there is


@pytest.mark.skipif(not blas.optimized_paths() or sys.platform == "darwin",
                    reason="needs an optimized BLAS on Linux")
def test_benchmark_runs_on_the_preloaded_blas_and_refuses_when_mlx_came_first():
    ok = _run("plain")
    assert ok.returncode == 0, ok.stderr[-2000:]
    env = last_json(ok.stdout)["env"]
    assert env["blas"] in ("openblas", "mkl"), env["blas_note"]
    late = _run("mlx-first")
    assert late.returncode != 0
    assert late.stderr.strip().splitlines()[-1].startswith("spec_decode: not reported: the runs' "
                                                           "BLAS is unknown")
    assert "Traceback" not in late.stderr
