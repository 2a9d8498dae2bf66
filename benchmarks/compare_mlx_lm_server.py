"""The same workload through `batchsim serve` and `mlx_lm.server` on the same model, measured by
`batchsim run --target` from the client side, side by side.

    .venv/bin/python benchmarks/compare_mlx_lm_server.py --model tiny --num-prompts 20

mlx_lm.server does not know `ignore_eos` (requests may end early at EOS; the table shows the
tokens each really generated) and sends no `usage` in streamed completions unless asked (both
are asked). Not part of the test suite; the last stdout line is one JSON document."""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
ROWS = [  # (label, summary key)
    ("completed", "completed"), ("failed", "failed"), ("duration (s)", "duration"),
    ("input tokens", "total_input_tokens"), ("output tokens", "total_output_tokens"),
    ("request throughput (req/s)", "request_throughput"),
    ("output throughput (tok/s)", "output_throughput"),
    ("mean TTFT (ms)", "mean_ttft_ms"), ("p99 TTFT (ms)", "p99_ttft_ms"),
    ("mean TPOT (ms)", "mean_tpot_ms"), ("p99 TPOT (ms)", "p99_tpot_ms"),
    ("mean ITL (ms)", "mean_itl_ms"), ("mean E2EL (ms)", "mean_e2el_ms"),
    ("p99 E2EL (ms)", "p99_e2el_ms"), ("mean decode batch (server)", "mean_batch_size"),
]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_healthy(url: str, proc: subprocess.Popen, timeout_s: float = 120) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{url}: server exited with {proc.returncode}")
        try:
            with urllib.request.urlopen(f"{url}/health", timeout=2) as r:
                if r.status == 200:
                    return
        except OSError:
            time.sleep(0.3)
    raise RuntimeError(f"{url}: not healthy after {timeout_s} s")


def model_dir(model: str) -> Path:
    sys.path.insert(0, str(ROOT))
    from batchsim.server.models.loader import resolve
    from batchsim.server.platform.env import default_dtype

    return resolve(model, default_dtype()).path


def load(url: str, args: argparse.Namespace, endpoint: str) -> dict:
    target = f"{url}/v1" + ("/chat/completions" if endpoint == "chat" else "")
    cmd = [sys.executable, "-m", "batchsim.scripts.cli", "run", "--target", target,
           "--model", args.model,
           "--workload", args.workload, "--num-prompts", str(args.num_prompts),
           "--no-progress", "--out", args.out]
    if args.request_rate:
        cmd += ["--request-rate", str(args.request_rate)]
    done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, check=True)
    return json.loads(done.stdout.strip().splitlines()[-1])


def start(name: str, args: argparse.Namespace) -> tuple[subprocess.Popen, str]:
    port = free_port()
    if name == "batchsim":
        cmd = [sys.executable, "-m", "batchsim.scripts.cli", "serve", "--model", args.model,
               "--port", str(port)]
    else:
        cmd = [sys.executable, "-m", "mlx_lm", "server", "--model", str(model_dir(args.model)),
               "--port", str(port), "--log-level", "WARNING"]
    # mlx_lm.server's /v1/models fails without a Hugging Face cache directory; give it an empty one.
    hf_cache = Path(args.out) / "hf-cache"
    hf_cache.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "HF_HUB_CACHE": str(hf_cache), "HF_HUB_OFFLINE": "1"}
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    wait_healthy(url, proc)
    return proc, url


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="tiny")
    p.add_argument("--workload", default="default")
    p.add_argument("--num-prompts", type=int, default=20)
    p.add_argument("--request-rate", type=float)
    p.add_argument("--endpoints", default="completions", help="completions,chat")
    p.add_argument("--out", default="/tmp/batchsim-compare-runs")
    args = p.parse_args()
    os.environ.setdefault("BATCHSIM_HOME", "/tmp/bshome")
    results: dict[str, dict] = {}
    for server in ("batchsim", "mlx_lm"):  # one at a time: they would share the CPU cores
        proc, url = start(server, args)
        try:
            for endpoint in args.endpoints.split(","):
                results[f"{server} {endpoint}"] = load(url, args, endpoint)
        finally:
            proc.send_signal(signal.SIGINT)
            proc.wait(30)
    names = list(results)
    print(f"{'metric':<30}" + "".join(f"{n:>22}" for n in names))
    for label, key in ROWS:
        cells = []
        for n in names:
            v = results[n].get(key)
            cells.append(f"{v:>22.2f}" if isinstance(v, float) else f"{v!s:>22}")
        print(f"{label:<30}" + "".join(cells))
    print(json.dumps({n: {k: results[n].get(k) for _, k in ROWS} | {
        "run_dir": results[n].get("run_dir"), "model_sent": results[n].get("model_sent"),
        "http_statuses": results[n].get("http_statuses")} for n in names}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
