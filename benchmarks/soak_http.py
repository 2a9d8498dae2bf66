"""Soak `batchsim serve`: thousands of requests with Poisson arrivals, some clients disconnecting
mid-stream and a few deliberately invalid, then check that the server answered nothing it should
not have, freed every KV byte its prefix cache does not keep (paged: nor its pool's spare blocks),
counted every token it generated, and kept its memory flat.

    .venv/bin/python benchmarks/soak_http.py --num-requests 2000 --rate 25

Not part of the test suite. The last stdout line is one JSON document."""

from __future__ import annotations

import argparse
import asyncio
import collections
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import aiohttp
import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from batchsim.scheduler.pool_geometry import block_slack
from batchsim.scheduler.prefix_cache import BLOCK_BOOKKEEPING_BYTES
from batchsim.server.http.prometheus import parse as parse_metrics
from batchsim.workloads.client.sse import SSEParser


def start_server(model: str, max_queue: int, prefix_cache: str | None = None,
                 kv_layout: str | None = None) -> tuple[subprocess.Popen, str]:
    """`batchsim serve` on a free loopback port (serve's own defaults where None), and its URL."""
    cmd = [sys.executable, "-m", "batchsim.scripts.cli", "serve", "--model", model, "--port", "0",
           "--max-queue", str(max_queue)]
    for flag, value in (("--prefix-cache", prefix_cache), ("--kv-layout", kv_layout)):
        cmd += [flag, value] if value is not None else []
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)
    for line in proc.stderr:
        if "listening on " in line:
            return proc, line.split("listening on ", 1)[1].strip()
    raise RuntimeError(f"server exited with {proc.wait()} before listening")


def rss_bytes(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    return 0


class Soak:
    def __init__(self, args: argparse.Namespace, url: str, pid: int):
        self.args, self.url, self.pid = args, url, pid
        self.rng = np.random.default_rng(args.seed)
        self.statuses: collections.Counter[str] = collections.Counter()
        self.unexpected: list[str] = []
        self.rss: list[tuple[float, int, int]] = []  # (elapsed s, requests sent, RSS bytes)
        # (requests sent, MLX active, MLX cache, prefix cache bytes, prefix cache blocks)
        self.mlx: list[tuple[int, float, float, float, float]] = []
        self.sent = 0
        self.completed, self.completed_tokens = 0, 0  # streams read to [DONE], their tokens

    async def one(self, http: aiohttp.ClientSession, kind: str, body: dict, cut: int) -> None:
        try:
            async with http.post(f"{self.url}/v1/completions", json=body) as resp:
                expected = 400 if kind == "invalid" else 200
                self.statuses[f"{kind}:{resp.status}"] += 1
                if resp.status != expected:
                    self.unexpected.append(f"{kind}: http {resp.status} {await resp.text()}")
                    return
                if kind == "invalid":
                    return
                parser, chunks, done, tokens = SSEParser(), 0, False, None
                async for data in resp.content.iter_any():
                    for event in parser.feed(data):
                        done = done or event.is_done
                        chunks += not event.is_done and bool(event.json().get("choices"))
                        if not event.is_done and event.json().get("usage"):
                            tokens = event.json()["usage"]["completion_tokens"]
                    if kind == "disconnect" and chunks >= cut:
                        resp.close()  # drop the connection mid-stream
                        return
                # A chunk carries one token or more (text held back until it is complete).
                if not done or tokens != body["max_tokens"] or not 1 <= chunks <= tokens:
                    self.unexpected.append(f"{kind}: {chunks} chunks, {tokens} tokens, "
                                           f"done={done}")
                    return
                self.completed += 1
                self.completed_tokens += tokens
        except (aiohttp.ClientError, asyncio.TimeoutError) as exc:
            self.unexpected.append(f"{kind}: {type(exc).__name__} {exc}")

    def request(self) -> tuple[str, dict, int]:
        a, rng = self.args, self.rng
        body = {"model": a.model, "prompt": rng.integers(3, 500, rng.integers(16, 129)).tolist(),
                "max_tokens": int(rng.integers(16, 49)), "ignore_eos": True, "stream": True,
                "stream_options": {"include_usage": True}}
        u = rng.random()
        if u < a.invalid_frac:
            return "invalid", {**body, "max_tokens": -1}, 0
        if u < a.invalid_frac + a.disconnect_frac:
            return "disconnect", body, int(rng.integers(1, body["max_tokens"] // 2))
        return "ok", body, 0

    async def sample_memory(self, http: aiohttp.ClientSession, t0: float) -> None:
        while True:
            self.rss.append((time.monotonic() - t0, self.sent, rss_bytes(self.pid)))
            async with http.get(f"{self.url}/metrics") as resp:
                m = parse_metrics(await resp.text())
            self.mlx.append((self.sent, m["batchsim_mlx_active_bytes"],
                             m["batchsim_mlx_cache_bytes"], m["batchsim_prefix_cache_bytes"],
                             m["batchsim_prefix_cache_blocks"]))
            await asyncio.sleep(0.5)

    async def run(self) -> float:
        gaps = self.rng.exponential(1.0 / self.args.rate, self.args.num_requests)
        connector = aiohttp.TCPConnector(limit=0)
        async with aiohttp.ClientSession(connector=connector,
                                         timeout=aiohttp.ClientTimeout(total=600)) as http:
            t0 = time.monotonic()
            sampler = asyncio.create_task(self.sample_memory(http, t0))
            tasks, due = [], t0
            for gap in gaps:
                due += gap
                await asyncio.sleep(max(0.0, due - time.monotonic()))
                tasks.append(asyncio.create_task(self.one(http, *self.request())))
                self.sent += 1
            await asyncio.gather(*tasks)
            elapsed = time.monotonic() - t0
            await asyncio.sleep(1.0)  # let the server free the last disconnects' KV
            sampler.cancel()
            self.rss.append((time.monotonic() - t0, self.sent, rss_bytes(self.pid)))
            async with http.get(f"{self.url}/metrics") as resp:
                self.metrics = parse_metrics(await resp.text())
        return elapsed


def rss_report(samples: list[tuple[float, int, int]], warmup_requests: int) -> dict:
    after = [(t, r) for t, sent, r in samples if sent >= warmup_requests]
    start, end = after[0][1], after[-1][1]
    slope = np.polyfit([t for t, _ in after], [r for _, r in after], 1)[0] if len(after) > 2 else 0
    peak = max(r for _, r in after)
    return {"rss_start_mb": samples[0][2] / 2**20, "rss_after_warmup_mb": start / 2**20,
            "rss_end_mb": end / 2**20, "rss_peak_after_warmup_mb": peak / 2**20,
            "rss_growth_after_warmup": (end - start) / start,
            "rss_peak_growth_after_warmup": (peak - start) / start,
            "rss_slope_mb_per_min": float(slope) * 60 / 2**20, "rss_samples": len(samples)}


def mlx_report(samples: list[tuple[int, float, float, float, float]], end: dict[str, float],
               warmup_requests: int) -> dict:
    """MLX's active memory and buffer cache after warm-up and at the end: RSS growth that is
    cache (freed buffers kept for reuse, bounded by MLX's cache limit) is not a leak; nor are
    the prefix cache's blocks (bounded by the KV budget, evicted when a request needs room), nor
    their bookkeeping (at most BLOCK_BOOKKEEPING_BYTES a block beside the bytes MLX counts)."""
    after = [s for s in samples if s[0] >= warmup_requests] or samples
    return {"mlx_active_after_warmup_mb": after[0][1] / 2**20,
            "mlx_active_end_mb": end["batchsim_mlx_active_bytes"] / 2**20,
            "mlx_cache_after_warmup_mb": after[0][2] / 2**20,
            "mlx_cache_end_mb": end["batchsim_mlx_cache_bytes"] / 2**20,
            "mlx_peak_mb": end["batchsim_mlx_peak_bytes"] / 2**20,
            "prefix_cache_after_warmup_mb": after[0][3] / 2**20,
            "prefix_cache_end_mb": end["batchsim_prefix_cache_bytes"] / 2**20,
            "prefix_blocks_after_warmup": after[0][4],
            "prefix_blocks_end": end["batchsim_prefix_cache_blocks"]}


def rss_growth_net(result: dict) -> float:
    """RSS growth from warm-up to the end less the growth of the two caches mlx_report names and
    the prefix blocks' bookkeeping bound (what the pass rule judges)."""
    grown_mb = result["rss_end_mb"] - result["rss_after_warmup_mb"]
    cached_mb = sum(result[f"{c}_end_mb"] - result[f"{c}_after_warmup_mb"]
                    for c in ("prefix_cache", "mlx_cache"))
    blocks = result["prefix_blocks_end"] - result["prefix_blocks_after_warmup"]
    return (grown_mb - cached_mb - blocks * BLOCK_BOOKKEEPING_BYTES / 2**20) / result[
        "rss_after_warmup_mb"]


def kv_held_ok(kv_bytes: float, cache_bytes: float, cache_blocks: float, layout: str) -> bool:
    """KV held once every request is done: the prefix cache's blocks; paged, in a pool that may
    keep spare blocks beside them (resized only past twice block_slack of what it needs)."""
    if layout == "padded" or not cache_blocks:
        return kv_bytes == cache_bytes
    spare = kv_bytes - cache_bytes
    return 0 <= spare <= 2 * block_slack(int(cache_blocks)) * cache_bytes / cache_blocks


def token_account(soak: Soak, m: dict[str, float]) -> dict:
    """The server's generated tokens against what the clients read: the finished requests' tokens
    (generated less the aborted requests') are exactly those of the streams read to the end,
    unless a disconnecting client's request finished before its close reached the server (then
    each such request adds at least one token)."""
    finished_tokens = m["batchsim_generation_tokens_total"] - m[
        "batchsim_aborted_generation_tokens_total"]
    unread = m.get('batchsim_requests_total{status="finished"}', 0) - soak.completed
    extra = finished_tokens - soak.completed_tokens
    return {"completed_streams": soak.completed, "completed_tokens": soak.completed_tokens,
            "finished_unread": unread, "finished_tokens_unread": extra,
            "token_account_ok": bool(extra == 0 if unread == 0 else extra >= unread > 0)}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="tiny")
    p.add_argument("--num-requests", type=int, default=2000)
    p.add_argument("--rate", type=float, default=25.0, help="Poisson arrivals per second")
    p.add_argument("--disconnect-frac", type=float, default=0.10)
    p.add_argument("--invalid-frac", type=float, default=0.01)
    p.add_argument("--warmup-frac", type=float, default=0.2, help="requests before RSS is judged")
    p.add_argument("--rss-tolerance", type=float, default=0.05)
    p.add_argument("--max-queue", type=int, default=512)
    p.add_argument("--prefix-cache", choices=("on", "off"), default="on", help="serve's")
    p.add_argument("--kv-layout", choices=("padded", "paged"), default="padded", help="serve's")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()
    os.environ.setdefault("BATCHSIM_HOME", "/tmp/bshome")
    proc, url = start_server(args.model, args.max_queue, args.prefix_cache, args.kv_layout)
    try:
        soak = Soak(args, url, proc.pid)
        elapsed = asyncio.run(soak.run())
    finally:
        proc.send_signal(signal.SIGTERM)
        exit_code = proc.wait(60)
    m = soak.metrics
    result = {
        "num_requests": args.num_requests, "rate": args.rate, "elapsed_s": elapsed,
        "statuses": dict(sorted(soak.statuses.items())), "unexpected": len(soak.unexpected),
        "unexpected_examples": soak.unexpected[:5],
        "kv_bytes_end": m["batchsim_kv_bytes"],
        # with the prefix cache on, the blocks it keeps stay held once every request is done
        "prefix_cache_bytes_end": m["batchsim_prefix_cache_bytes"],
        "kv_held_ok": kv_held_ok(m["batchsim_kv_bytes"], m["batchsim_prefix_cache_bytes"],
                                 m["batchsim_prefix_cache_blocks"], args.kv_layout),
        "kv_bytes_measured_end": m["batchsim_kv_bytes_measured"],
        "running_end": m["batchsim_requests_running"],
        "waiting_end": m["batchsim_requests_waiting"],
        "requests_total": {k.split('"')[1]: v for k, v in m.items()
                           if k.startswith("batchsim_requests_total")},
        "max_batch_size": m["batchsim_decode_batch_size_max"],
        "mean_batch_size": m["batchsim_decode_batch_size_steps_sum"]
        / max(1.0, m["batchsim_decode_batch_size_steps_count"]),
        "generation_tokens": m["batchsim_generation_tokens_total"],
        # the disconnecting clients' requests: how many, and the tokens they had when aborted
        "client_gone": m["batchsim_requests_client_gone_total"],
        "aborted_generation_tokens": m["batchsim_aborted_generation_tokens_total"],
        **token_account(soak, m),
        "server_exit_code": exit_code,
        **rss_report(soak.rss, int(args.warmup_frac * args.num_requests)),
        **mlx_report(soak.mlx, m, int(args.warmup_frac * args.num_requests)),
    }
    result["rss_growth_net_of_caches"] = rss_growth_net(result)
    result["ok"] = bool(
        result["unexpected"] == 0 and result["token_account_ok"]
        and result["kv_held_ok"]
        and result["kv_bytes_measured_end"] == result["kv_bytes_end"] and result["running_end"] == 0
        and abs(result["rss_growth_net_of_caches"]) <= args.rss_tolerance and exit_code == 0)
    for key, value in result.items():
        print(f"{key:>30}: {value}")
    print(json.dumps(result))
    return 0 if result["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
