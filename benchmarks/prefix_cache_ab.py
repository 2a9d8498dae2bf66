"""The same workload with the prefix cache off and on, runs interleaved (off, on, off, on, ...) so
machine load hits both alike: hit rate, TTFT p50/p99, output tok/s (medians over the repeats) and
on/off ratios; on real compute, whether both sides produced the same tokens. The last stdout line
is one JSON document.

    python benchmarks/prefix_cache_ab.py --repeats 2 -- --workload shared-prompt --num-prompts 24
    python benchmarks/prefix_cache_ab.py -- --executor sim --device-profile "M2 Max" \\
        --model llama-3.1-8b --quantize 4 --workload shared-prompt
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile

KEYS = ("prefix_cache_hit_rate", "cached_prompt_tokens", "prefilled_prompt_tokens",
        "peak_prefix_cache_bytes", "p50_ttft_ms", "p99_ttft_ms", "output_throughput",
        "max_concurrent_requests", "num_preemptions", "kv_account_mismatches")


def run(args: list[str], mode: str, out: str) -> dict:
    cmd = [sys.executable, "-m", "batchsim.scripts.cli", "run", "--prefix-cache", mode, "--json",
           "--no-progress", "--no-timeline", "--out", out, *args]
    done = subprocess.run(cmd, check=False, capture_output=True, text=True)
    if done.returncode != 0:
        sys.exit(f"prefix_cache_ab: {' '.join(cmd)} failed: {done.stderr.strip()[-500:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--repeats", type=int, default=2, help="off/on pairs")
    p.add_argument("run_args", nargs=argparse.REMAINDER, help="-- then `batchsim run` flags")
    a = p.parse_args()
    args = [x for x in a.run_args if x != "--"]
    runs: dict[str, list[dict]] = {"off": [], "on": []}
    with tempfile.TemporaryDirectory() as out:
        for _ in range(a.repeats):
            for mode in ("off", "on"):
                runs[mode].append(run(args, mode, out))
    med = {m: {k: statistics.median(s.get(k) or 0 for s in rs) for k in KEYS}
           for m, rs in runs.items()}
    hashes = {s.get("output_tokens_sha256") for rs in runs.values() for s in rs}
    ratio = {k: med["on"][k] / med["off"][k] if med["off"][k] else None
             for k in ("p50_ttft_ms", "p99_ttft_ms", "output_throughput")}
    for mode in ("off", "on"):
        print(f"{mode:3s} " + " ".join(f"{k}={v:.4g}" for k, v in med[mode].items()),
              file=sys.stderr)
    print(json.dumps({"args": args, "repeats": a.repeats, "off": med["off"], "on": med["on"],
                      "on_over_off": ratio, "same_tokens": len(hashes) == 1 if None not in hashes
                      else None, "env": runs["on"][0].get("env")}))


if __name__ == "__main__":
    main()
