"""One streaming request to an OpenAI-compatible endpoint, timed from the client side: when it was
sent, when each content chunk arrived, when the stream ended, and what `usage` said."""

from __future__ import annotations

import asyncio
import dataclasses
import json
from typing import Any

import aiohttp
from batchsim.server.results.records import RequestRecord
from batchsim.workloads.client.sse import SSEParser
from batchsim.workloads.requests import RequestSpec


@dataclasses.dataclass(frozen=True)
class Endpoint:
    base: str  # .../v1
    url: str  # the generation endpoint
    chat: bool


def endpoint(target: str) -> Endpoint:
    url = target.rstrip("/")
    for suffix, chat in (("/chat/completions", True), ("/completions", False)):
        if url.endswith(suffix):
            return Endpoint(url[: -len(suffix)], url, chat)
    return Endpoint(url, f"{url}/completions", False)


@dataclasses.dataclass
class Outcome:
    """What the client saw of one request."""

    spec: RequestSpec
    sent_s: float = 0.0
    chunk_times_s: list[float] = dataclasses.field(default_factory=list)
    ended_s: float | None = None
    usage: dict[str, Any] | None = None
    finish_reason: str | None = None
    http_status: int | None = None
    error: str | None = None
    prompt_tokens_local: int | None = None

    complete: bool = False  # the stream ended as the protocol says ([DONE])

    def status(self, n_out: int) -> str:
        """The record status: "unfinished" for a request cut off by an interrupted run."""
        if self.http_status is not None and self.http_status != 200:
            return "rejected"
        if self.complete and not self.error and self.finish_reason != "abort" and n_out > 0:
            return "finished"
        return "aborted" if self.error or self.complete else "unfinished"

    def record(self) -> RequestRecord:
        chunks = self.chunk_times_s
        usage = self.usage or {}
        n_out = usage.get("completion_tokens", len(chunks))
        n_out = n_out if isinstance(n_out, int) and n_out >= 0 else len(chunks)
        status = self.status(n_out if chunks else 0)
        # Token times: each chunk's arrival; tokens beyond the chunks arrived with the last one.
        times = (chunks[:n_out] + chunks[-1:] * max(0, n_out - len(chunks))) if chunks else []
        if status != "finished":
            times = []
        n_prompt = usage.get("prompt_tokens") or self.prompt_tokens_local or self.spec.prompt_len
        return RequestRecord(
            request_id=self.spec.index, status=status, arrival_s=self.sent_s,
            first_scheduled_s=None, token_times_s=tuple(times), finished_s=self.ended_s,
            num_prompt_tokens=int(n_prompt), num_output_tokens=len(times),
            finish_reason=self.finish_reason or self.error,
        )


def _content(event: dict[str, Any], chat: bool) -> bool:
    """vLLM's rule: a chunk with choices is a token arrival; here it must also carry text."""
    choices = event.get("choices") or []
    if not choices or not isinstance(choices[0], dict):
        return False
    if chat:
        return isinstance((choices[0].get("delta") or {}).get("content"), str)
    return isinstance(choices[0].get("text"), str)


async def send(http: aiohttp.ClientSession, ep: Endpoint, payload: dict[str, Any],
               o: Outcome, t0: float) -> None:
    """POST one streaming request and fill `o`; errors are recorded, never raised."""
    loop = asyncio.get_running_loop()
    o.sent_s = loop.time() - t0
    try:
        async with http.post(ep.url, json=payload) as resp:
            o.http_status = resp.status
            if resp.status != 200:
                o.error = f"http {resp.status}: {(await resp.text())[:200]}"
                return
            await _read_stream(resp, ep.chat, o, t0)
    except (aiohttp.ClientError, asyncio.TimeoutError, json.JSONDecodeError, ValueError) as exc:
        o.error = f"{type(exc).__name__}: {exc}"[:200]
    finally:
        if o.ended_s is None:
            o.ended_s = loop.time() - t0


async def _read_stream(resp: aiohttp.ClientResponse, chat: bool, o: Outcome, t0: float) -> None:
    loop = asyncio.get_running_loop()
    parser = SSEParser()
    async for data in resp.content.iter_any():
        now = loop.time() - t0
        for event in parser.feed(data):
            if event.is_done:
                o.ended_s, o.complete = now, True
                return
            _take(event.json(), chat, now, o)
    now = loop.time() - t0
    for event in parser.close():
        if event.is_done:
            o.ended_s, o.complete = now, True
            return
        _take(event.json(), chat, now, o)
    # Ended without [DONE]: accept a stream that at least said why it finished.
    o.complete = o.finish_reason is not None
    if not o.complete:
        o.error = o.error or "stream ended without [DONE]"


def _take(event: dict[str, Any], chat: bool, now_s: float, o: Outcome) -> None:
    if "error" in event:
        o.error = json.dumps(event["error"])[:200]
    if _content(event, chat):
        o.chunk_times_s.append(now_s)
    choices = event.get("choices") or []
    if choices and isinstance(choices[0], dict) and choices[0].get("finish_reason"):
        o.finish_reason = choices[0]["finish_reason"]
    if isinstance(event.get("usage"), dict):
        o.usage = event["usage"]
