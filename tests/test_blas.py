"""Choosing MLX's CBLAS on Linux: the OpenBLAS kernel fix-up and the user's overrides."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
from batchsim.server.platform import blas

AVX512 = {"avx512f", "avx512vl", "avx512bw", "avx512dq", "avx2", "fma"}


def test_coretype_from_cpu_flags():
    assert blas.coretype_for(AVX512 | {"avx512_bf16"}) == "Cooperlake"
    assert blas.coretype_for(AVX512) == "SkylakeX"
    assert blas.coretype_for({"avx2", "fma", "sse4_2"}) == "Haswell"
    assert blas.coretype_for({"avx512f", "avx2"}) is None  # no fma: not even Haswell is safe
    assert blas.coretype_for({"sse4_2"}) is None


def _choice_in_subprocess(**env: str) -> str:
    code = ("from batchsim.server.platform import blas; c = blas.preload(); "
            "print(c.name, '|', c.version, '|', c.note)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         env={**os.environ, **env}, cwd=os.path.dirname(os.path.dirname(__file__)))
    return out.stdout.strip()


needs_openblas = pytest.mark.skipif(not blas._openblas_paths() or sys.platform != "linux",
                                    reason="no system OpenBLAS")


@needs_openblas
def test_user_coretype_is_left_alone():
    line = _choice_in_subprocess(BATCHSIM_BLAS="openblas", OPENBLAS_CORETYPE="Haswell")
    name, version, note = (p.strip() for p in line.split("|"))
    assert name == "openblas" and "Haswell" in version and "OPENBLAS_CORETYPE" not in note


@needs_openblas
def test_openblas_never_runs_generic_kernels_on_a_modern_cpu():
    want = blas.coretype_for(blas._cpu_flags())
    if want is None:
        pytest.skip("CPU without AVX2/FMA")
    env = {k: v for k, v in os.environ.items() if k != "OPENBLAS_CORETYPE"}
    code = "from batchsim.server.platform import blas; print(blas.preload().version)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         env={**env, "BATCHSIM_BLAS": "openblas"},
                         cwd=os.path.dirname(os.path.dirname(__file__)))
    core = out.stdout.split()[-2].lower()  # "... DYNAMIC_ARCH NO_AFFINITY <core> MAX_THREADS=64"
    assert core not in blas._FALLBACK_CORES, out.stdout


def test_none_keeps_the_reference_blas():
    line = _choice_in_subprocess(BATCHSIM_BLAS="none")
    assert line.startswith(("reference", "metal"))


@needs_openblas
@pytest.mark.parametrize("user, want", [(None, 4), ("12", 12)])
def test_openblas_workers_sleep_right_after_a_call_unless_the_user_says_otherwise(user, want):
    """OpenBLAS reads OPENBLAS_THREAD_TIMEOUT once, when it loads: asked afterwards, the library
    itself must report batchsim's value (or the user's), not its spinning default of 28."""
    env = {k: v for k, v in os.environ.items() if k not in ("OPENBLAS_THREAD_TIMEOUT",
                                                            "GOTO_THREAD_TIMEOUT")}
    if user:
        env["OPENBLAS_THREAD_TIMEOUT"] = user
    code = ("import ctypes; from batchsim.server.platform import blas; c = blas.preload(); "
            "print(ctypes.CDLL(c.path).openblas_thread_timeout())")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         env={**env, "BATCHSIM_BLAS": "openblas"},
                         cwd=os.path.dirname(os.path.dirname(__file__)))
    assert int(out.stdout.split()[-1]) == want


def test_a_blas_the_user_names_that_does_not_load_is_one_line_not_a_traceback():
    """BATCHSIM_BLAS=garbage was a RuntimeError traceback from every command, --help included."""
    proc = subprocess.run([sys.executable, "-m", "batchsim.scripts.cli", "models", "--json"],
                          check=False, capture_output=True, text=True, timeout=120,
                          env={**os.environ, "BATCHSIM_BLAS": "/no/such/libblas.so"},
                          cwd=os.path.dirname(os.path.dirname(__file__)))
    assert proc.returncode == 2 and proc.stdout == "", proc.stderr
    line = proc.stderr.strip()
    assert "\n" not in line and "Traceback" not in line
    assert line.startswith("batchsim: BATCHSIM_BLAS=/no/such/libblas.so: could not load"), line


@needs_openblas
def test_the_kernel_question_asked_at_start_is_the_one_preload_reads(monkeypatch):
    """The batchsim program asks a fresh process which core its OpenBLAS picks while its modules
    load (start_probe); preload's check then reads that answer instead of asking again."""
    for name in ("OPENBLAS_CORETYPE", blas.ENV_VAR):
        monkeypatch.delenv(name, raising=False)
    if not blas._will_ask_corename("auto"):
        pytest.skip("preload would not ask here")
    monkeypatch.setattr(blas, "_choice", None)
    monkeypatch.setattr(blas, "_asked", None)
    asked = []
    ask = blas._ask_corename
    monkeypatch.setattr(blas, "_ask_corename", lambda path: asked.append(path) or ask(path))
    blas.start_probe()
    path = blas._listed_openblas_paths()[0]
    assert asked == [path]  # started, not waited for
    early = blas._openblas_corename(path)
    assert asked == [path] and blas._asked is None  # read, not asked twice
    assert early and early == blas._openblas_corename(path) and asked == [path, path]


def test_the_program_asks_at_start_and_a_test_importing_cli_does_not():
    code = ("import sys; sys.argv[0] = {!r}; from batchsim.server.platform import blas; "
            "import batchsim.scripts.cli; print(blas._asked is not None)")
    asks = (bool(blas._listed_openblas_paths())
            and blas._will_ask_corename((os.environ.get(blas.ENV_VAR) or "auto").strip()))
    for argv0, wanted in (("batchsim", asks), ("pytest", False)):
        out = subprocess.run([sys.executable, "-c", code.format(argv0)], capture_output=True,
                             text=True, check=True, timeout=60)
        assert out.stdout.strip() == str(wanted), argv0


@pytest.mark.parametrize("asks", [True, False])
def test_start_probe_and_preload_ask_by_one_rule(monkeypatch, asks):
    """start_probe asks ahead exactly where preload's OpenBLAS check will ask (_will_ask_corename,
    the rule both read; start_probe restated preload's conditions)."""
    monkeypatch.setattr(blas, "_will_ask_corename", lambda request: asks)
    monkeypatch.setattr(blas, "_listed_openblas_paths", lambda: ["/no/libopenblas.so.0"])
    monkeypatch.setattr(blas, "_choice", None)
    monkeypatch.setattr(blas, "_asked", None)
    asked: list[str] = []
    monkeypatch.setattr(blas, "_ask_corename", lambda path: asked.append(path))  # None: no child
    blas.start_probe()
    assert asked == (["/no/libopenblas.so.0"] if asks else [])
    asked.clear()
    assert blas._fix_openblas_coretype(["/no/libopenblas.so.0"]) == ""
    assert asked == (["/no/libopenblas.so.0"] if asks else [])


def _numpy_openblas() -> str | None:
    """numpy's own OpenBLAS (its wheels bundle one on Linux), or None."""
    import glob

    import numpy

    libs = os.path.join(os.path.dirname(os.path.dirname(numpy.__file__)), "numpy.libs")
    found = glob.glob(os.path.join(libs, "libscipy_openblas*.so"))
    return found[0] if found else None


@pytest.mark.skipif(_numpy_openblas() is None, reason="numpy bundles no OpenBLAS here")
def test_the_program_quiets_numpys_openblas_workers_before_numpy_loads(monkeypatch):
    """numpy's own OpenBLAS loads with the program's first modules, before blas.preload: its
    worker spun 0.1 s of CPU after the import (main process and drawing child each) until the
    program set OPENBLAS_THREAD_TIMEOUT at its start."""
    env = {k: v for k, v in os.environ.items() if k not in ("OPENBLAS_THREAD_TIMEOUT",
                                                            "GOTO_THREAD_TIMEOUT")}
    code = ("import sys, ctypes; sys.argv = ['batchsim', '--help']; import batchsim.scripts.cli; "
            "import numpy; print(ctypes.CDLL(LIB).openblas_thread_timeout())"
            ).replace("LIB", repr(_numpy_openblas()))
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         env=env, cwd=os.path.dirname(os.path.dirname(__file__)))
    assert int(out.stdout.split()[-1]) == int(blas.THREAD_TIMEOUT)
    for name in ("OPENBLAS_THREAD_TIMEOUT", "GOTO_THREAD_TIMEOUT"):
        monkeypatch.setenv(name, "12")
        monkeypatch.delenv(name)
    monkeypatch.setattr(blas, "_timeout_set_here", False)
    note = blas.quiet_openblas_workers()
    assert note and blas.quiet_openblas_workers() == note  # preload's note, whoever set it first
    monkeypatch.setattr(blas, "_timeout_set_here", False)
    monkeypatch.setenv("OPENBLAS_THREAD_TIMEOUT", "12")  # the user's: kept, no note
    assert blas.quiet_openblas_workers() == "" and os.environ["OPENBLAS_THREAD_TIMEOUT"] == "12"
