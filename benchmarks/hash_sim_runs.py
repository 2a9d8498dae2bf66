"""Hashes the records (steps.jsonl, requests.jsonl) of 10 simulated runs: dense and every layer
family, calibrated and catalog profiles, engines, quantized K/V, a cluster, preemption. A change
that must not move a float (a refactor of the cost model or the simulator) prints the same
lines before and after:

    python benchmarks/hash_sim_runs.py > before.txt  # then change the code, then:
    python benchmarks/hash_sim_runs.py | diff before.txt -

(an optional argument keeps the run directories there.)
"""

from __future__ import annotations

import hashlib
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
LOCAL = str(ROOT / "configs/devices/linux-x86_64-openblas-2core.yaml")
RUNS = {
    "dense-local": ["--model", "smollm2-135m", "--device-profile", LOCAL, "--num-prompts", "40"],
    "dense-local-tight": ["--model", "qwen2.5-0.5b", "--device-profile", LOCAL,
                          "--memory-gb", "2.1", "--input-len", "uniform:100:400",
                          "--num-prompts", "40", "--request-rate", "inf"],
    "dense-mac-prefill-first": ["--model", "llama-3.1-8b", "--quantize", "4", "--device-profile",
                                "M2 Max 38c", "--policy", "prefill-first", "--num-prompts", "60",
                                "--request-rate", "8"],
    "dense-mac-engine": ["--model", "llama-3.2-1b", "--quantize", "4", "--device-profile",
                         "M4 Max", "--engine", "mlx-lm-server", "--num-prompts", "60"],
    "dense-mac-kv4": ["--model", "qwen3-0.6b", "--kv-bits", "4", "--device-profile", "M1 Max",
                      "--num-prompts", "60", "--max-num-seqs", "64", "--request-rate", "inf"],
    "moe-mac": ["--model", "qwen3-30b-a3b", "--quantize", "4", "--device-profile", "M3 Ultra",
                "--num-prompts", "40"],
    "moe-local": ["--model", "tiny-moe", "--device-profile", LOCAL, "--num-prompts", "40"],
    "sliding-mac": ["--model", "gemma-3-27b", "--quantize", "4", "--device-profile", "M4 Max",
                    "--num-prompts", "30", "--input-len", "uniform:1000:3000"],
    "hybrid-local": ["--model", "tiny-hybrid", "--device-profile", LOCAL, "--num-prompts", "40"],
    "mla-local": ["--model", "tiny-mla", "--device-profile", LOCAL, "--num-prompts", "40",
                  "--policy", "prefill-first"],
}


def run_hash(name: str, args: list[str], out: Path) -> str:
    cmd = [sys.executable, "-m", "batchsim.scripts.cli", "run", "--executor", "sim", "--seed", "3",
           "--no-progress", "--no-timeline", "--json", "--out", str(out / name), *args]
    done = subprocess.run(cmd, check=False, capture_output=True, text=True, cwd=ROOT)
    if done.returncode != 0:
        return f"failed rc={done.returncode}: {done.stderr.strip().splitlines()[-1:]}"
    run_dir = next((out / name).iterdir())
    h = hashlib.sha256()
    for f in ("steps.jsonl", "requests.jsonl"):
        h.update((run_dir / f).read_bytes())
    return h.hexdigest()[:16]


def main() -> None:
    """Optional argument: a directory to keep the run directories in (to diff two sets)."""
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(sys.argv[1]) if len(sys.argv) > 1 else Path(tmp)
        for name, args in RUNS.items():
            print(f"{name:26s} {run_hash(name, args, out)}", flush=True)


if __name__ == "__main__":
    main()
