"""`batchsim run --target URL`: send a workload to any OpenAI-compatible server (batchsim's own,
mlx_lm.server, llama.cpp, vLLM) over streaming HTTP and measure it from the client side with the
definitions and JSON keys of the in-process run, so one report format covers both.

Measured as `vllm bench serve` does: a request starts when it is sent; TTFT ends at the first
chunk carrying content; each content chunk is a token arrival (a chunk may carry several tokens,
so ITL is pooled over chunk gaps, as vLLM's); E2EL ends with the stream. Output tokens come from
the server's `usage` (asked for with stream_options.include_usage), or are the content chunks
when it sends none; prompt tokens likewise (servers apply chat templates).

`--target http://HOST:PORT/v1` uses /v1/completions; a target ending in /chat/completions or
/completions uses that endpoint. OPENAI_API_KEY, if set, is sent as a bearer token."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import aiohttp
import numpy as np
import yaml
from batchsim.server.engine.run_config import RunConfig
from batchsim.server.http.prometheus import parse as parse_metrics
from batchsim.server.results.json_text import jsonable
from batchsim.server.results.jsonio import new_run_dir, write_jsonl
from batchsim.server.results.metrics import distribution, summarize
from batchsim.server.results.records import RequestRecord
from batchsim.workloads.chat import prompt_text
from batchsim.workloads.client.prompts import PromptMaker
from batchsim.workloads.client.stream import Endpoint, Outcome, endpoint, send
from batchsim.workloads.driver import drive_interruptibly
from batchsim.workloads.requests import RequestSpec, build_requests, sampling_seed

_TIMEOUT = aiohttp.ClientTimeout(total=6 * 60 * 60)  # vLLM bench's limit per request
_MS = 1000.0


async def _model_id(http: aiohttp.ClientSession, base: str, wanted: str,
                    local_path: str | None) -> str | None:
    """The name to send: the configured model if the server lists it, else the one it serves
    (mlx_lm.server lists its model by resolved path). None (send no `model`, so the server uses
    its default) when the listing fails, as mlx_lm.server's does without a Hugging Face cache."""
    try:
        async with http.get(f"{base}/models") as resp:
            ids = [m["id"] for m in (await resp.json(content_type=None)).get("data", [])]
    except (aiohttp.ClientError, ValueError, KeyError, TypeError, AttributeError):
        return None
    for candidate in (wanted, local_path):
        if candidate in ids:
            return candidate
    return ids[-1] if ids else None


async def _scrape(http: aiohttp.ClientSession, base: str) -> dict[str, float] | None:
    """batchsim's /metrics, if the target is a batchsim server."""
    root = base.removesuffix("/v1")
    try:
        async with http.get(f"{root}/metrics") as resp:
            text = await resp.text() if resp.status == 200 else ""
    except aiohttp.ClientError:
        return None
    samples = parse_metrics(text) if "batchsim_steps_total" in text else {}
    return samples or None


class _HttpRun:
    def __init__(self, cfg: RunConfig, prompts: PromptMaker, on_answer: Callable[[int], None]):
        self.cfg = cfg
        self.ep = endpoint(cfg.target or "")
        self.chat = cfg.workload.chat  # real-text chat traffic: messages to the chat endpoint
        if self.chat is not None and not self.ep.chat:
            self.ep = Endpoint(self.ep.base, f"{self.ep.base}/chat/completions", True)
        self.prompts = prompts
        self.on_answer = on_answer  # called with 1 as each request is answered
        self.requests = build_requests(cfg.workload)
        self.outcomes: list[Outcome] = []
        self.model_sent: str | None = cfg.model
        self.metrics_before: dict[str, float] | None = None
        self.metrics_after: dict[str, float] | None = None
        self.interrupted: str | None = None  # the signal that stopped the sending

    def payload(self, rs: RequestSpec, o: Outcome) -> dict[str, Any]:
        if self.chat is not None:
            return self._chat_payload(rs)
        text, o.prompt_tokens_local = self.prompts.make(rs)
        body: dict[str, Any] = {
            "max_tokens": rs.output_len, "temperature": 0.0,
            "stream": True, "stream_options": {"include_usage": True},
        }
        if self.model_sent is not None:
            body["model"] = self.model_sent
        if self.cfg.ignore_eos:
            body["ignore_eos"] = True  # a server that does not know it ignores it
        if self.ep.chat:
            body["messages"] = [{"role": "user", "content": text}]
        else:
            body["prompt"] = text
        return body

    def _chat_payload(self, rs: RequestSpec) -> dict[str, Any]:
        """A chat client's request: the prompt text, its sampling, EOS honoured."""
        assert self.chat is not None
        body: dict[str, Any] = {
            "messages": [{"role": "user", "content": prompt_text(self.chat, rs.index)}],
            "max_tokens": self.chat.max_tokens, "temperature": self.chat.temperature,
            "seed": sampling_seed(self.cfg.workload.seed, rs.index),
            "stream": True, "stream_options": {"include_usage": True},
        }
        if self.model_sent is not None:
            body["model"] = self.model_sent
        return body

    async def main(self) -> float:
        headers = {}
        if os.environ.get("OPENAI_API_KEY"):
            headers["Authorization"] = f"Bearer {os.environ['OPENAI_API_KEY']}"
        connector = aiohttp.TCPConnector(limit=0)
        async with aiohttp.ClientSession(timeout=_TIMEOUT, connector=connector,
                                         headers=headers) as http:
            self.model_sent = await _model_id(http, self.ep.base, self.cfg.model,
                                              self.prompts.local_path)
            self.metrics_before = await _scrape(http, self.ep.base)
            loop = asyncio.get_running_loop()
            t0 = loop.time()

            async def submit(rs: RequestSpec) -> None:
                o = Outcome(rs)
                self.outcomes.append(o)
                await send(http, self.ep, self.payload(rs, o), o, t0)
                self.on_answer(1)

            self.interrupted = await drive_interruptibly(self.cfg.workload, self.requests, submit)
            duration = loop.time() - t0
            self.metrics_after = await _scrape(http, self.ep.base)
        return duration


def run_http(cfg: RunConfig, out_dir: Path, prompts: PromptMaker,
             on_answer: Callable[[int], None] = lambda n: None) -> dict:
    """Send cfg's workload to cfg.target; leave a run directory and return its summary."""
    spec = cfg.workload
    ep = endpoint(cfg.target or "")
    run = _HttpRun(cfg, prompts, on_answer)
    duration = asyncio.run(run.main())
    outcomes = sorted(run.outcomes, key=lambda o: o.spec.index)
    records = [o.record() for o in outcomes]
    summary = summarize(records, [], duration_s=duration, percentiles=cfg.percentiles,
                        goodput_slo_ms=cfg.goodput)
    done = [o for o, r in zip(outcomes, records) if r.status == "finished"]
    gaps = [b - a for o in done for a, b in zip(o.chunk_times_s, o.chunk_times_s[1:])]
    # ITL over chunk gaps pooled over requests, as vLLM's (a per-token ITL would add zero gaps for
    # chunks that carried several tokens); the rest of the summary is per token.
    summary.update(distribution("itl", gaps, cfg.percentiles))
    summary.update(_server_view(run.metrics_before, run.metrics_after))
    # What a client cannot see of the server (its KV, its prefill/decode time, when a request was
    # first scheduled): unknown, printed "-", not the 0 that summarize gives a run without steps.
    summary.update(dict.fromkeys(["peak_kv_bytes", "prompt_tps", "generation_tps",
                                  *(k for k in summary if k.endswith("_queue_ms"))]))
    codes: dict[str, int] = {}
    for o in outcomes:
        codes[_status(o)] = codes.get(_status(o), 0) + 1
    # As in-process: how late each request went out against its schedule (none in closed loop).
    lateness = [0.0 if spec.closed_loop else max(0.0, o.sent_s - o.spec.arrival_s)
                for o in outcomes]
    summary.update({"target": cfg.target, "endpoint": ep.url, "model": cfg.model,
                    "model_sent": run.model_sent, "executor": "http", "workload": spec.name,
                    "http_statuses": codes, "prompt_source": prompts.describe(),
                    "mean_arrival_lateness_ms": _MS * float(np.mean(lateness)) if lateness else 0.0,
                    "interrupted": run.interrupted is not None})
    if run.interrupted:  # as an in-process run's summary names it
        summary["interrupt_reason"] = run.interrupted
    run_dir = _write_run_dir(out_dir, cfg, outcomes, records, summary, run.model_sent)
    summary["run_dir"] = str(run_dir)
    (run_dir / "summary.json").write_text(json.dumps(jsonable(summary), indent=1))
    return summary


def _status(o: Outcome) -> str:
    """The HTTP status, or what stood in for one (a refused connection has none)."""
    if o.http_status is not None:
        return str(o.http_status)
    return "connection refused" if (o.error or "").startswith("ClientConnector") else "no response"


def _server_view(before: dict[str, float] | None, after: dict[str, float] | None) -> dict:
    """The batch view from a batchsim target's /metrics (deltas over the run), so an HTTP run still
    reports batching; for other servers these keys are None."""
    if not before or not after:  # not a batchsim server: the client cannot see its batches
        return {"mean_batch_size": None, "max_batch_size": None, "num_engine_steps": None,
                "num_preemptions": None, "prompt_tokens": None, "generation_tokens": None,
                "batch_view_source": None}

    def delta(name: str) -> float:
        return after.get(name, 0.0) - before.get(name, 0.0)

    batch_sum = delta("batchsim_decode_batch_size_steps_sum")
    batch_steps = delta("batchsim_decode_batch_size_steps_count")
    return {
        "mean_batch_size": batch_sum / batch_steps if batch_steps else 0.0,
        "max_batch_size": int(after.get("batchsim_decode_batch_size_max", 0)),  # since start
        "num_engine_steps": int(delta("batchsim_steps_total")),
        "num_preemptions": int(delta("batchsim_preemptions_total")),
        "prompt_tokens": int(delta("batchsim_prompt_tokens_total")),
        "generation_tokens": int(delta("batchsim_generation_tokens_total")),
        "kv_budget_bytes": int(after.get("batchsim_kv_budget_bytes", 0)),
        "batch_view_source": "server /metrics",
    }


def _write_run_dir(out_dir: Path, cfg: RunConfig, outcomes: list[Outcome],
                   records: list[RequestRecord], summary: dict, model_sent: str | None) -> Path:
    host = endpoint(cfg.target or "").base.split("//", 1)[-1].split("/", 1)[0].replace(":", "-")
    run_dir = new_run_dir(out_dir, f"http-{host}-{cfg.workload.name}")
    resolved = {"config": dataclasses.asdict(cfg),  # its workload: run_dir.write_config's one
                "resolved": {"target": cfg.target, "endpoint": summary["endpoint"],
                             "model_sent": model_sent, "prompt_source": summary["prompt_source"]}}
    (run_dir / "config.yaml").write_text(yaml.safe_dump(jsonable(resolved), sort_keys=False))
    rows = []
    for o, r in zip(outcomes, records):
        rows.append({**r.to_json(), "http_status": o.http_status, "error": o.error,
                     "chunk_times_s": o.chunk_times_s, "usage": o.usage,
                     "prompt_tokens_local": o.prompt_tokens_local})
    write_jsonl(run_dir / "requests.jsonl", rows)
    write_jsonl(run_dir / "steps.jsonl", [])
    return run_dir
