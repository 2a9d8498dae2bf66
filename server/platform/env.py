"""The environment every result is reported with: machine, OS, MLX backend and version, BLAS,
threads."""

from __future__ import annotations

import os
import platform
import sys
from functools import lru_cache
from typing import Any

from batchsim.server.platform import blas


def _cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def ram_bytes() -> int:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return 0


def _version(pkg: str) -> str | None:
    """`pkg`'s installed version (None: not installed): from the name of the directory a wheel
    installs, NAME-VERSION.dist-info (the binary distribution format's), in the first sys.path
    entry that has one; else importlib.metadata, which reads the version from the metadata file
    (20 ms on every run's start, the email package's import with it). An entry importlib would
    read first and this cannot (a zip, a NAME.egg-info, two versions side by side, a name without
    one) leaves it to importlib."""
    name = _normalized(pkg)
    for entry in sys.path:
        try:
            listed = os.listdir(entry or ".")
        except NotADirectoryError:  # a zip: importlib reads inside it
            break
        except OSError:  # gone, or unreadable: importlib skips it too
            continue
        found, egg = _info_dirs(listed, name)
        if egg:
            break
        if len(found) == 1 and len(found[0]) == 2:
            return found[0][1]
        if found:
            break
    from importlib import metadata

    try:
        return metadata.version(pkg)
    except metadata.PackageNotFoundError:
        return None


def _info_dirs(listed: list[str], name: str) -> tuple[list[list[str]], bool]:
    """In one pass over a directory's names: `name`'s NAME-VERSION.dist-info ones, each split
    [NAME, VERSION], and whether it has a NAME[-VERSION...].egg-info (setup.py develop's, older
    installs')."""
    found, egg = [], False
    for d in listed:
        if d.endswith((".dist-info", ".egg-info")):
            stem, _, kind = d.rpartition(".")
            parts = stem.split("-", 1)
            if _normalized(parts[0]) == name:
                if kind == "egg-info":
                    egg = True
                else:
                    found.append(parts)
    return found, egg


def _normalized(name: str) -> str:
    """A distribution name as the packaging specifications compare them."""
    return name.lower().replace("-", "_").replace(".", "_")


def backend() -> str:
    """`metal`, `cuda` or `cpu`: where MLX runs by default."""
    import mlx.core as mx

    if mx.metal.is_available():
        return "metal"
    cuda = getattr(mx, "cuda", None)
    if cuda is not None and cuda.is_available():
        return "cuda"
    return "cpu"


@lru_cache(maxsize=1)
def _static_environment() -> dict[str, Any]:
    import mlx.core as mx

    info: dict[str, Any] = {}
    try:
        info = dict(mx.device_info())
    except Exception:  # noqa: BLE001 - device_info is missing on some builds; the rest still stands
        info = {}
    choice = blas.current()
    return {
        "os": f"{platform.system()} {platform.release()}",
        "machine": platform.machine(),
        "cpu": _cpu_name(),
        "cores": os.cpu_count(),
        "ram_bytes": ram_bytes(),
        "python": platform.python_version(),
        "mlx": _version("mlx"),
        "mlx_lm": _version("mlx-lm"),
        "backend": backend(),
        "device_name": info.get("device_name"),
        "device_memory_bytes": info.get("memory_size"),
        "blas": choice.name,
        "blas_path": choice.path,
        "blas_version": choice.version,
        "blas_note": choice.note,
        "threads": {
            k: os.environ[k]
            for k in ("OPENBLAS_NUM_THREADS", "OPENBLAS_THREAD_TIMEOUT", "MKL_NUM_THREADS",
                      "OMP_NUM_THREADS")
            if k in os.environ
        },
    }


def environment(**settings: Any) -> dict[str, Any]:
    """The static environment plus the settings of this result (dtype, model, ...)."""
    return {**_static_environment(), **settings}


def default_dtype() -> str:
    """float32 on the CPU backend (the only dtype whose matmuls use BLAS there), float16 on GPUs."""
    return "float32" if backend() == "cpu" else "float16"


def release_mlx_streams() -> None:
    """Destroy the MLX streams the calling thread created, as MLX asks of every thread that used it
    before that thread or the process ends: left to teardown, they can abort the process
    ("terminate called without an active exception"). A no-op where MLX is not loaded."""
    clear = getattr(sys.modules.get("mlx.core"), "clear_streams", None)
    if clear is not None:
        clear()
