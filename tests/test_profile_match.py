"""A profile calibrated on another CPU or BLAS is named as such wherever it is used to simulate
(`run`, `compare`, `sweep`, `validate`); one from this machine, or a catalog Mac, is not."""

from __future__ import annotations

import dataclasses
import re

import pytest
from batchsim.configs import ConfigError
from batchsim.scripts.cli import main
from batchsim.server.perf.devices import SHIPPED_DIR, load_profile, resolve_profile, save_profile
from batchsim.server.perf.profile_match import device_id, differs, here, mismatch_warning

ZEN = "AMD EPYC, OpenBLAS 0.3.21 DYNAMIC_ARCH Zen MAX_THREADS=64"


@pytest.mark.parametrize("calibrated, this, expected", [
    (ZEN, ZEN, False),
    # An older profile records no CPU family: the name and the BLAS build still match.
    (ZEN, "AMD EPYC (family 25 model 17), OpenBLAS 0.3.21 DYNAMIC_ARCH Zen MAX_THREADS=64", False),
    # one name, two CPUs
    ("AMD EPYC (family 25 model 17), X", "AMD EPYC (family 26 model 2), X", True),
    # other kernels
    (ZEN, "AMD EPYC, OpenBLAS 0.3.21 DYNAMIC_ARCH Cooperlake MAX_THREADS=64", True),
    (ZEN, "Intel Xeon, OpenBLAS 0.3.21 DYNAMIC_ARCH Zen MAX_THREADS=64", True),
    (ZEN, "AMD EPYC, unknown", False),  # this side does not know its BLAS
])
def test_differs_compares_cpu_family_and_blas(calibrated, this, expected):
    assert differs(calibrated, this) is expected


def test_device_id_names_the_cpu_family_and_the_blas_build():
    env_info = {"cpu": "AMD EPYC", "blas": "openblas", "blas_version": "OpenBLAS 0.3.21 Zen"}
    assert (device_id(env_info, model="family 26 model 2")
            == "AMD EPYC (family 26 model 2), OpenBLAS 0.3.21 Zen")
    assert device_id(env_info, model="") == "AMD EPYC, OpenBLAS 0.3.21 Zen"


def _profile_from(device: str, tmp_path):
    shipped = load_profile(SHIPPED_DIR / "linux-x86_64-openblas-2core.yaml")
    cal = dataclasses.replace(shipped.calibration, device=device)
    return save_profile(dataclasses.replace(shipped, calibration=cal), tmp_path / "p.yaml")


def test_a_catalog_mac_or_a_profile_from_here_draws_no_warning(tmp_path):
    assert mismatch_warning(resolve_profile("M2 Max"), this="Some CPU, Some BLAS") is None
    assert mismatch_warning(load_profile(_profile_from(here(), tmp_path))) is None


@pytest.mark.parametrize("command",
                         [["run"], ["compare", "--batch", "2"], ["sweep", "--max-batch", "2"]])
def test_simulating_on_a_foreign_profile_warns_once_naming_both_machines(command, tmp_path, capsys):
    path = _profile_from("Other CPU (family 1 model 1), Other BLAS", tmp_path)
    argv = [*command, "--executor", "sim", "--device-profile", str(path), "--model", "tiny",
            "--out", str(tmp_path)]
    if command[0] != "sweep":
        argv += ["--num-prompts", "2", "--output-len", "4", "--input-len", "8"]
        argv += ["--no-progress"] if command[0] == "run" else []
    else:
        argv += ["--prompt-len", "8", "--output-len", "4"]
    assert main(argv) == 0
    lines = [x for x in capsys.readouterr().err.splitlines() if "calibrated on" in x]
    assert len(lines) == 1, lines
    assert "Other CPU (family 1 model 1), Other BLAS" in lines[0] and here() in lines[0]


def test_a_profile_with_an_unreadable_mlx_version_is_one_line_naming_its_file(tmp_path, capsys):
    """Checked when the profile loads, not when a quantized layer is first priced mid-run."""
    shipped = load_profile(SHIPPED_DIR / "linux-x86_64-openblas-2core.yaml")
    path = save_profile(shipped, tmp_path / "bad.yaml")
    text = re.sub(r"(?m)^mlx_version: .*\n", "", path.read_text())  # each key once (fbf1ed4)
    path.write_text(text + "mlx_version: latest\n")
    with pytest.raises(ConfigError, match=rf"^{path}: mlx_version: MLX version 'latest': "):
        load_profile(path)
    argv = ["run", "--executor", "sim", "--device-profile", str(path), "--model", "tiny",
            "--out", str(tmp_path), "--num-prompts", "2", "--input-len", "8", "--output-len", "4",
            "--no-progress"]
    assert main(argv) != 0
    err = capsys.readouterr().err
    assert "Traceback" not in err and f"{path}: mlx_version: MLX version 'latest'" in err, err
    assert load_profile(_profile_from(here(), tmp_path)).mlx_version == ""  # none given: newest
