"""Tokens `batchsim serve` generates for clients that have left: N concurrent streams, D of which
stop after a few tokens, the way a client of each kind stops:

  aiohttp-close  aiohttp's resp.close()
  openai-close   the openai SDK's stream.close() after a break
  openai-break   a break out of the openai SDK's stream, nothing more (the thread then returns)

    .venv/bin/python benchmarks/disconnect_tokens.py --mode openai-break --model tiny

Tokens after the drop = everything generated - the finishing streams' max_tokens - what the
dropped clients had read. Not part of the test suite. The last stdout line is one JSON document."""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import sys
import threading
import time
from pathlib import Path

import aiohttp

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

from batchsim.server.http.prometheus import parse as parse_metrics
from soak_http import start_server

STREAM_OPTIONS = {"include_usage": True, "continuous_usage_stats": True}


async def _aiohttp_one(url: str, body: dict, cut: int | None) -> int:
    seen = 0
    async with aiohttp.ClientSession() as http, http.post(f"{url}/v1/completions",
                                                         json=body) as resp:
        async for line in resp.content:
            if line.startswith(b"data: {"):
                seen = json.loads(line[6:])["usage"]["completion_tokens"]
            if cut is not None and seen >= cut:
                resp.close()
                break
    return seen


def _openai_one(url: str, body: dict, cut: int | None, close: bool, seen: list, i: int) -> None:
    import openai

    client = openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0)
    stream = client.completions.create(model=body["model"], prompt=body["prompt"],
                                       max_tokens=body["max_tokens"], stream=True,
                                       stream_options=STREAM_OPTIONS,
                                       extra_body={"ignore_eos": True})
    for chunk in stream:
        seen[i] = chunk.usage.completion_tokens if chunk.usage else seen[i]
        if cut is not None and seen[i] >= cut:
            break
    if close:
        stream.close()


def run_clients(args: argparse.Namespace, url: str) -> list[int]:
    body = {"model": args.model, "prompt": "hello there", "max_tokens": args.max_tokens,
            "ignore_eos": True, "stream": True, "stream_options": STREAM_OPTIONS}
    cuts = [args.cut if i < args.drop else None for i in range(args.num_streams)]
    if args.mode == "aiohttp-close":
        async def all_at_once() -> list[int]:
            return await asyncio.gather(*(_aiohttp_one(url, body, c) for c in cuts))
        return asyncio.run(all_at_once())
    seen = [0] * args.num_streams
    threads = [threading.Thread(target=_openai_one, args=(url, body, c,
                                                          args.mode == "openai-close", seen, i))
               for i, c in enumerate(cuts)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return seen


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--mode", choices=("aiohttp-close", "openai-close", "openai-break"),
                   default="aiohttp-close")
    p.add_argument("--model", default="tiny")
    p.add_argument("--num-streams", type=int, default=32)
    p.add_argument("--drop", type=int, default=8, help="streams that stop early")
    p.add_argument("--cut", type=int, default=5, help="tokens a dropping client reads")
    p.add_argument("--max-tokens", type=int, default=300)
    args = p.parse_args()
    os.environ.setdefault("BATCHSIM_HOME", "/tmp/bshome")
    proc, url = start_server(args.model, max_queue=512)
    try:
        import httpx

        metrics = lambda: parse_metrics(httpx.get(f"{url}/metrics").text)
        before = metrics()
        seen = run_clients(args, url)
        after = metrics()
        while after["batchsim_requests_running"] or after["batchsim_requests_waiting"]:
            time.sleep(0.05)
            after = metrics()
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(60)
    count = lambda name: after[name] - before[name]
    generated = count("batchsim_generation_tokens_total")
    finishing = args.num_streams - args.drop
    after_drop = generated - finishing * args.max_tokens - sum(seen[:args.drop])
    result = {**vars(args), "generated_tokens": generated,
              "dropped_clients_read_tokens": sum(seen[:args.drop]),
              "tokens_after_drop": after_drop, "tokens_after_drop_per_drop": after_drop / args.drop,
              "client_gone": count("batchsim_requests_client_gone_total"),
              "aborted": count('batchsim_requests_total{status="aborted"}')}
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
