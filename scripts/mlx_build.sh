#!/usr/bin/env bash
# Which MLX build scripts/setup.sh installs; prints one word: cpu, cuda12 or cuda13 (Linux), metal
# (macOS), and on stderr why. BATCHSIM_MLX=cpu|cuda12|cuda13 overrides; otherwise an NVIDIA driver
# (nvidia-smi's "CUDA Version", else /proc/driver/nvidia/version's driver number) picks the CUDA
# build of its CUDA major version, and no driver means the CPU build.
set -euo pipefail
proc=${BATCHSIM_NVIDIA_PROC:-/proc/driver/nvidia/version}  # tests point it elsewhere

if [ "$(uname -s)" = Darwin ]; then echo metal; exit 0; fi
case "${BATCHSIM_MLX:-}" in
  cpu|cuda12|cuda13) echo "batchsim setup: BATCHSIM_MLX=$BATCHSIM_MLX" >&2; echo "$BATCHSIM_MLX"; exit 0 ;;
  "") ;;
  *) echo "batchsim setup: BATCHSIM_MLX must be cpu, cuda12 or cuda13, got '$BATCHSIM_MLX'" >&2; exit 2 ;;
esac

cuda="" how=""
if command -v nvidia-smi >/dev/null 2>&1; then
  cuda=$(nvidia-smi 2>/dev/null | sed -n 's/.*CUDA Version: *\([0-9][0-9]*\).*/\1/p' | head -n1 || true)
  how="nvidia-smi: CUDA $cuda"
fi
if [ -z "$cuda" ] && [ -r "$proc" ]; then
  driver=$(sed -n 's/.*Kernel Module[^0-9]*\([0-9][0-9]*\)\..*/\1/p' "$proc" | head -n1 || true)
  # NVIDIA's minimum Linux drivers: CUDA 13.x from 580, CUDA 12.x from 525.
  if [ -n "$driver" ]; then
    if [ "$driver" -ge 580 ]; then cuda=13; elif [ "$driver" -ge 525 ]; then cuda=12; else cuda=old; fi
    how="driver $driver ($proc)"
  fi
fi
# A driver runs every CUDA up to its own: the newest MLX build it can (13 from 13 on).
[ -n "$cuda" ] && [ "$cuda" != old ] && [ "$cuda" -gt 13 ] && cuda=13
case "$cuda" in
  "") echo cpu ;;
  12|13) echo "batchsim setup: NVIDIA $how: MLX's CUDA build mlx[cuda$cuda] (BATCHSIM_MLX=cpu keeps the CPU backend)" >&2
         echo "cuda$cuda" ;;
  *) echo "batchsim setup: NVIDIA $how: too old for MLX's CUDA builds (CUDA 12 or 13); the CPU build" >&2
     echo cpu ;;
esac
