"""Choose the CBLAS that MLX's CPU backend calls, before MLX is imported.

On Linux the `mlx-cpu` wheel links a bundled reference BLAS: float32 GEMM runs ~30x slower than an
optimized BLAS, so batched decode shows almost no gain. MLX resolves `cblas_sgemm` through the global
symbol scope, so loading an optimized library with RTLD_GLOBAL *before* the first `import mlx` makes
MLX use it (loading it afterwards does nothing). float16/bfloat16 matmuls never go through BLAS on the
CPU backend. On macOS nothing is done: MLX runs on Metal.

BATCHSIM_BLAS selects: `auto` (default: MKL from this environment, else a system OpenBLAS, else the
reference BLAS with a warning), `openblas`, `mkl`, `none` (keep the bundled reference BLAS), or a
path to any shared library exporting the CBLAS symbols.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import dataclasses
import os
import platform
import sys
from pathlib import Path

ENV_VAR = "BATCHSIM_BLAS"

_OPENBLAS_PATHS = (
    "/usr/lib/x86_64-linux-gnu/openblas-pthread/libopenblas.so.0",
    "/usr/lib/aarch64-linux-gnu/openblas-pthread/libopenblas.so.0",
    "/usr/lib/x86_64-linux-gnu/libopenblas.so.0",
    "/usr/lib/aarch64-linux-gnu/libopenblas.so.0",
    "/usr/lib64/libopenblas.so.0",
    "/usr/lib64/libopenblasp.so.0",
    "/usr/lib/libopenblas.so.0",
)

FIX_HINT = (
    "install an optimized BLAS: `sudo apt-get install libopenblas0-pthread` (Debian/Ubuntu), "
    "`sudo dnf install openblas` (Fedora), or without root `pip install 'batchsim[mkl]'`; "
    f"set {ENV_VAR}=none to keep the reference BLAS and silence this"
)


@dataclasses.dataclass(frozen=True)
class BlasChoice:
    """What was loaded for MLX's CPU backend, recorded with every result."""

    name: str  # "openblas" | "mkl" | "custom" | "reference" | "metal" (macOS: not used)
    path: str | None  # the shared library loaded with RTLD_GLOBAL, if any
    version: str | None
    note: str  # how it was chosen, or why nothing was loaded

    @property
    def optimized(self) -> bool:
        return self.name in ("openblas", "mkl", "custom", "metal")


_choice: BlasChoice | None = None


def _mkl_paths() -> list[str]:
    lib = Path(sys.prefix) / "lib"
    return [str(p) for p in sorted(lib.glob("libmkl_rt.so*"), reverse=True)]


def _openblas_paths() -> list[str]:
    found = ctypes.util.find_library("openblas")
    paths = [p for p in _OPENBLAS_PATHS if Path(p).exists()]
    return paths + ([found] if found else [])


def _version(lib: ctypes.CDLL, name: str) -> str | None:
    try:
        if name == "openblas":
            fn = lib.openblas_get_config
            fn.restype = ctypes.c_char_p
            return fn().decode()
        if name == "mkl":
            buf = ctypes.create_string_buffer(256)
            lib.MKL_Get_Version_String(buf, 256)
            return buf.value.decode().strip()
    except (AttributeError, OSError):
        return None
    return None


def _load(name: str, paths: list[str], note: str) -> BlasChoice | None:
    for path in paths:
        try:
            lib = ctypes.CDLL(path, mode=ctypes.RTLD_GLOBAL)
        except OSError:
            continue
        if not hasattr(lib, "cblas_sgemm"):
            continue
        return BlasChoice(name, path, _version(lib, name), note)
    return None


def preload(request: str | None = None) -> BlasChoice:
    """Load the chosen BLAS once, before `import mlx`; later calls return the first choice."""
    global _choice
    if _choice is not None:
        return _choice
    request = (request or os.environ.get(ENV_VAR) or "auto").strip()
    if platform.system() == "Darwin":
        _choice = BlasChoice("metal", None, None, "macOS: MLX runs matmuls on Metal")
        return _choice
    if "mlx.core" in sys.modules:
        _choice = BlasChoice("unknown", None, None, "mlx was imported before batchsim chose a BLAS")
        return _choice
    choice: BlasChoice | None = None
    if request in ("none", "reference"):
        choice = BlasChoice("reference", None, None, f"{ENV_VAR}={request}")
    elif request == "mkl":
        choice = _load("mkl", _mkl_paths(), f"{ENV_VAR}=mkl")
    elif request == "openblas":
        choice = _load("openblas", _openblas_paths(), f"{ENV_VAR}=openblas")
    elif request == "auto":
        choice = _load("mkl", _mkl_paths(), "auto: MKL installed in this environment") or _load(
            "openblas", _openblas_paths(), "auto: system OpenBLAS"
        )
        if choice is None:
            choice = BlasChoice("reference", None, None, "auto: no optimized BLAS found")
    else:
        choice = _load("custom", [request], f"{ENV_VAR}={request}")
    if choice is None:
        raise RuntimeError(f"{ENV_VAR}={request}: could not load a CBLAS library; {FIX_HINT}")
    _choice = choice
    return choice


def current() -> BlasChoice:
    return _choice if _choice is not None else preload()


def warning() -> str | None:
    """One line for stderr when float32 matmuls will run on the slow reference BLAS."""
    choice = current()
    if choice.name == "reference" and not choice.note.startswith(ENV_VAR):
        return (
            "batchsim: MLX's CPU backend is using the reference BLAS bundled with mlx-cpu "
            "(float32 GEMM ~30x slower, batching gains hidden); " + FIX_HINT
        )
    return None
