"""Choose the CBLAS that MLX's CPU backend calls, before MLX is imported.

On Linux the `mlx-cpu` wheel links a bundled reference BLAS: float32 GEMM runs ~30x slower than an
optimized BLAS, so batched decode shows almost no gain. MLX resolves `cblas_sgemm` through the
global symbol scope, so loading an optimized library with RTLD_GLOBAL *before* the first `import
mlx` makes MLX use it (loading it afterwards does nothing). float16/bfloat16 matmuls never go
through BLAS on the CPU backend. On macOS nothing is done: MLX runs on Metal.

BATCHSIM_BLAS selects: `auto` (default: MKL from this environment, else a system OpenBLAS, else the
reference BLAS with a warning), `openblas`, `mkl`, `none` (keep the bundled reference BLAS), or a
path to any shared library exporting the CBLAS symbols.

OpenBLAS picks its kernels from the CPU model at load time; a CPU newer than the OpenBLAS build
(e.g. an Emerald Rapids Xeon under Debian 12's 0.3.21) falls back to the generic "Prescott" SSE3
kernels, three times slower at sgemm. batchsim checks which core a fresh process gets and, when
it is such a fallback, sets OPENBLAS_CORETYPE from the CPU's own flags (AVX-512 or AVX2) before
loading. A user-set OPENBLAS_CORETYPE is left alone.

OpenBLAS's worker threads spin after each threaded call (2^28 cycles by default, a tenth of a
second) before they sleep, and MLX runs its ops on a thread of its own: on a 2-core machine the
spinning worker took the core MLX's thread needed, and a 4-layer MoE model decoded at batch 1
1.2-1.7x slower than with the workers asleep right after each call
(docs/measured.md: "BLAS matters as much as batching"). batchsim sets OPENBLAS_THREAD_TIMEOUT=4
(2^4 cycles, the least OpenBLAS takes) unless it is set already.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import dataclasses
import functools
import os
import platform
import subprocess
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


def _listed_openblas_paths() -> list[str]:
    return [p for p in _OPENBLAS_PATHS if Path(p).exists()]


def _openblas_paths() -> list[str]:
    found = ctypes.util.find_library("openblas")  # runs ldconfig: 2-20 ms (here, load 9)
    return _listed_openblas_paths() + ([found] if found else [])


def optimized_paths() -> list[str]:
    """The optimized BLAS libraries `auto` would try here (MKL, then a system OpenBLAS)."""
    return _mkl_paths() + _openblas_paths()


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


# Cores OpenBLAS falls back to when it does not know the CPU model (generic SSE-era kernels).
_FALLBACK_CORES = {"prescott", "core2", "penryn", "dunnington", "nehalem", "katmai", "coppermine",
                   "northwood", "banias", "atom", "unknown"}


@functools.cache  # start_probe and preload both ask (preload twice): /proc/cpuinfo read once
def _cpu_flags() -> frozenset[str]:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return frozenset(line.split(":", 1)[1].split())
    except OSError:
        pass
    return frozenset()


def coretype_for(flags: frozenset[str] | set[str]) -> str | None:
    """The best OpenBLAS x86-64 kernel set these CPU flags can run, or None."""
    if {"avx512f", "avx512vl", "avx512bw", "avx512dq"} <= flags:
        return "Cooperlake" if "avx512_bf16" in flags else "SkylakeX"
    if {"avx2", "fma"} <= flags:
        return "Haswell"
    return None


_CORENAME = ("import ctypes,sys; f=ctypes.CDLL(sys.argv[1]).openblas_get_corename; "
             "f.restype=ctypes.c_char_p; print(f().decode())")
_asked: tuple[str, subprocess.Popen] | None = None  # start_probe's (path, process)


def _ask_corename(path: str) -> subprocess.Popen | None:
    """A fresh Python (-I -S: no site, half the start) that prints the core its OpenBLAS picks."""
    try:
        return subprocess.Popen([sys.executable or "python3", "-I", "-S", "-c", _CORENAME, path],
                                stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
                                env={**os.environ, "OPENBLAS_NUM_THREADS": "1"})
    except OSError:
        return None


def _will_ask_corename(request: str) -> bool:
    """Whether preload(`request`) asks a fresh process which core OpenBLAS picks: OpenBLAS is to
    load (asked for, or `auto` with no MKL here; not on macOS), on an x86-64 whose CPU flags name
    a better core than OpenBLAS's fallbacks, with no OPENBLAS_CORETYPE set."""
    return (platform.system() != "Darwin" and request in ("auto", "openblas")
            and not (request == "auto" and _mkl_paths())
            and not os.environ.get("OPENBLAS_CORETYPE")
            and platform.machine() in ("x86_64", "AMD64")
            and coretype_for(_cpu_flags()) is not None)


def start_probe() -> None:
    """Ask now, in another process, what preload will ask: the program's imports run meanwhile
    (the answer takes 60-120 ms; starting the process, 15-27 ms of the program's start). No-op
    where preload will not ask."""
    global _asked
    request = (os.environ.get(ENV_VAR) or "auto").strip()
    if _asked is not None or _choice is not None or not _will_ask_corename(request):
        return
    listed = _listed_openblas_paths()
    child = _ask_corename(listed[0]) if listed else None
    if child is not None:
        _asked = (listed[0], child)


def _openblas_corename(path: str) -> str | None:
    """The core a fresh process's OpenBLAS picks (its choice is fixed once loaded, so ask another
    process rather than this one); start_probe's answer if it asked about `path`."""
    global _asked
    asked, _asked = _asked, None
    child = asked[1] if asked is not None and asked[0] == path else _ask_corename(path)
    if asked is not None and child is not asked[1]:
        asked[1].kill()
        asked[1].wait()
    if child is None:
        return None
    try:
        out = child.communicate(timeout=30)[0]
    except subprocess.TimeoutExpired:
        child.kill()
        child.wait()
        return None
    if child.returncode != 0:
        return None
    return out.strip() or None


def _fix_openblas_coretype(paths: list[str]) -> str:
    """Sets OPENBLAS_CORETYPE when OpenBLAS would fall back to generic kernels; returns a note."""
    if not paths or not _will_ask_corename("openblas"):  # OpenBLAS loads next: MKL did not
        return ""
    want = coretype_for(_cpu_flags())
    detected = _openblas_corename(paths[0])
    if not want or not detected or detected.lower() not in _FALLBACK_CORES:
        return ""
    os.environ["OPENBLAS_CORETYPE"] = want
    return (f"; OpenBLAS did not know this CPU and chose {detected} kernels, so "
            f"OPENBLAS_CORETYPE={want} was set from the CPU flags")


THREAD_TIMEOUT = "4"  # OPENBLAS_THREAD_TIMEOUT: workers sleep 2^4 cycles after a call


_timeout_set_here = False  # quiet_openblas_workers set OPENBLAS_THREAD_TIMEOUT (not the user)


def quiet_openblas_workers() -> str:
    """Sets OPENBLAS_THREAD_TIMEOUT (read when an OpenBLAS loads) unless the user did; returns a
    note (the same on every call). The program calls it at its start, before numpy loads its own
    OpenBLAS: that one's worker spun 0.1 s of CPU after numpy's import (main process and
    drawing child each), with batchsim's setting 0.01-0.03 s; children inherit it."""
    global _timeout_set_here
    if not _timeout_set_here and (os.environ.get("OPENBLAS_THREAD_TIMEOUT")
                                  or os.environ.get("GOTO_THREAD_TIMEOUT")):
        return ""
    os.environ["OPENBLAS_THREAD_TIMEOUT"] = THREAD_TIMEOUT
    _timeout_set_here = True
    return f"; OPENBLAS_THREAD_TIMEOUT={THREAD_TIMEOUT} (workers sleep after each call)"


def _load_openblas(note: str) -> BlasChoice | None:
    """The system OpenBLAS, its kernels and worker threads set up before it loads (the listed
    paths first: the linker's search, which runs ldconfig, only when none of them loads)."""
    listed = _listed_openblas_paths()
    note += _fix_openblas_coretype(listed or _openblas_paths()) + quiet_openblas_workers()
    choice = _load("openblas", listed, note)
    return choice or _load("openblas", _openblas_paths()[len(listed):], note)


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
        choice = _load_openblas(f"{ENV_VAR}=openblas")
    elif request == "auto":
        choice = _load("mkl", _mkl_paths(), "auto: MKL installed in this environment")
        if choice is None:
            choice = _load_openblas("auto: system OpenBLAS")
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
