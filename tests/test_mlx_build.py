"""scripts/mlx_build.sh: which MLX build setup installs, from the NVIDIA driver or BATCHSIM_MLX."""

from __future__ import annotations

import os
import platform
import subprocess
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "mlx_build.sh"
pytestmark = pytest.mark.skipif(platform.system() != "Linux", reason="Linux picks among MLX builds")


def _pick(tmp_path: Path, smi: str | None = None, proc: str | None = None, **env: str):
    """Run the script with a fake nvidia-smi (its stdout) and /proc driver file, or neither."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    if smi is not None:
        (bin_dir / "nvidia-smi").write_text(f"#!/bin/sh\ncat <<'X'\n{smi}\nX\n")
        (bin_dir / "nvidia-smi").chmod(0o755)
    proc_file = tmp_path / "version"
    if proc is not None:
        proc_file.write_text(proc)
    run_env = {"PATH": f"{bin_dir}:/usr/bin:/bin", "BATCHSIM_NVIDIA_PROC": str(proc_file), **env}
    return subprocess.run(["bash", str(SCRIPT)], capture_output=True, check=False,
                          text=True, env=run_env,
                          timeout=30)


SMI = "| NVIDIA-SMI 580.95.05   Driver Version: 580.95.05   CUDA Version: {} |"
PROC = "NVRM version: NVIDIA UNIX x86_64 Kernel Module  {}  Thu Sep 26 2024\n"


@pytest.mark.parametrize("smi, proc, build", [
    (None, None, "cpu"),  # no driver
    (SMI.format("13.0"), None, "cuda13"),
    (SMI.format("12.4"), None, "cuda12"),
    (SMI.format("14.1"), None, "cuda13"),  # a newer driver runs CUDA 13 builds
    (SMI.format("11.8"), None, "cpu"),  # too old
    (None, PROC.format("550.54.14"), "cuda12"),  # no nvidia-smi: the kernel module's number
    (None, PROC.format("580.65.06"), "cuda13"),
])
def test_driver_picks_the_build(tmp_path, smi, proc, build):
    got = _pick(tmp_path, smi, proc)
    assert got.returncode == 0, got.stderr
    assert got.stdout.strip() == build
    if build != "cpu":
        assert f"mlx[{build}]" in got.stderr  # setup says so


def test_override_and_a_bad_override(tmp_path):
    assert _pick(tmp_path, SMI.format("13.0"), BATCHSIM_MLX="cpu").stdout.strip() == "cpu"
    assert _pick(tmp_path, BATCHSIM_MLX="cuda12").stdout.strip() == "cuda12"
    bad = _pick(tmp_path, BATCHSIM_MLX="rocm")
    assert bad.returncode == 2 and bad.stdout == ""
    assert "BATCHSIM_MLX must be cpu, cuda12 or cuda13" in bad.stderr and "rocm" in bad.stderr


def test_setup_installs_the_chosen_build_as_a_batchsim_extra():
    tomllib = pytest.importorskip("tomllib")
    config = tomllib.loads((SCRIPT.parent.parent / "pyproject.toml").read_text())["project"]
    assert not any("mlx[" in d for d in config["dependencies"])  # plain mlx: no backend forced
    extras = config["optional-dependencies"]
    for build in ("cpu", "cuda12", "cuda13"):
        assert extras[build] == [f"mlx[{build}]>=0.32; platform_system == 'Linux'"]
    assert os.access(SCRIPT, os.X_OK)
