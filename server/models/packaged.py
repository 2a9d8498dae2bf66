"""Real weights shipped inside a PyPI package (a GGUF file in its wheel): where the installed file
is, and the model directory imported from it on first use, per backend."""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable
from pathlib import Path

from batchsim.configs import ConfigError

IMPORT_VERSION = 1  # bump when the import writes different files for the same GGUF


@dataclasses.dataclass(frozen=True)
class Package:
    """A PyPI distribution that holds a model's weights (installed with --no-deps: only the file
    is needed, not the package's own runtime)."""

    name: str  # distribution name on PyPI
    version: str  # the one pin: scripts/setup.sh installs exactly this
    file: str  # the GGUF's path inside the installed distribution
    bits: int  # bits per weight of its quantized matrices (Q4_1: 4)

    @property
    def pip_spec(self) -> str:
        return f"{self.name}=={self.version}"


def keeps_quantized() -> bool:
    """The stored form of imported quantized weights on this backend: kept quantized on a GPU;
    dense on MLX's CPU backend, where quantized matmuls are slow and gain little from batching."""
    from batchsim.server.platform import env

    return env.backend() != "cpu"


class PackageMissingError(ConfigError):
    """The package holding a real-weight model is not installed (or another version is)."""


def gguf_path(pkg: Package) -> Path:
    """The installed GGUF, found through the distribution's metadata (its module is not imported:
    its own dependencies are not installed)."""
    from importlib import metadata  # here: 15 ms of imports a simulated run does without

    fix = f"install it with `pip install --no-deps {pkg.pip_spec}` (scripts/setup.sh does)"
    try:
        dist = metadata.distribution(pkg.name)
    except metadata.PackageNotFoundError:
        raise PackageMissingError(f"package {pkg.name} (real weights) is not installed; "
                                  f"{fix}") from None
    if dist.version != pkg.version:
        raise PackageMissingError(f"package {pkg.name} {dist.version} is installed, this model is "
                                  f"pinned to {pkg.version}; {fix}")
    path = Path(str(dist.locate_file(pkg.file)))
    if not path.is_file():
        raise PackageMissingError(f"package {pkg.name} has no {pkg.file}; reinstall: {fix}")
    return path


def missing(packages: list[Package]) -> list[str]:
    """pip specs of the packages not installed at their pinned version (scripts/setup.sh)."""
    from importlib import metadata

    def installed(pkg: Package) -> bool:
        try:
            return metadata.version(pkg.name) == pkg.version
        except metadata.PackageNotFoundError:
            return False

    return [p.pip_spec for p in packages if not installed(p)]


def import_marker(pkg: Package, dtype: str, keep_quantized: bool) -> dict:
    """What batchsim.json of an imported directory says; a differing one is re-imported."""
    return {"weights": "real", "package": pkg.pip_spec, "file": pkg.file,
            "form": "quantized" if keep_quantized else "dense", "float_dtype": dtype,
            "import_version": IMPORT_VERSION}


def is_imported(path: Path, marker: dict) -> bool:
    try:
        info = json.loads((path / "batchsim.json").read_text())
    except (OSError, json.JSONDecodeError):
        return False
    return all(info.get(k) == v for k, v in marker.items())


def import_packaged(pkg: Package, out_dir: Path, dtype: str, keep_quantized: bool,
                    log: Callable[[str], None] = lambda _: None) -> Path:
    """The model directory for this stored form, imported once: dense in `dtype`, or quantized
    matrices kept packed with scales, biases and norms in `dtype`."""
    from batchsim.server.models.gguf.importer import KEEP
    from batchsim.server.models.imported import import_gguf

    marker = import_marker(pkg, dtype, keep_quantized)
    if is_imported(out_dir, marker):
        return out_dir
    source = gguf_path(pkg)
    form = f"quantized, {dtype} scales" if keep_quantized else f"dense {dtype}"
    log(f"importing real weights from {pkg.pip_spec} ({source.name}) into {out_dir} ({form})")
    return import_gguf(source, out_dir, KEEP if keep_quantized else dtype, dtype, marker, log)
