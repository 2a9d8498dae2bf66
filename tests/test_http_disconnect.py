"""A client that goes away stops its generation: the real server on loopback (tiny model) and real
clients (httpx, the openai SDK, a raw socket) that close the connection mid-request. Each test
reads the server's generated-token counter while the request runs, closes, and bounds what the
server generated after that read: a few steps, not the rest of max_tokens."""

from __future__ import annotations

import asyncio
import json

import httpx
import pytest

from tests.cli_calls import last_json
from tests.serve_process import AUTH, KEY, ServerProcess

MAX_TOKENS = 3000  # what a request that is never aborted generates (ignore_eos)
# Tokens the server may generate between the test's counter read and the abort: the tiny model's
# steps take about 1 ms, so this leaves ~60 steps for the client's close and the server's turn
# while other processes hold the CPU (measured at load 4-5: 1 token for httpx/aiohttp, 7 for the
# openai SDK's close()).
AFTER_CLOSE_TOKENS = 64
TOKENS = "batchsim_generation_tokens_total"
ABORTED = 'batchsim_requests_total{status="aborted"}'
ABORTED_TOKENS = "batchsim_aborted_generation_tokens_total"
GONE = "batchsim_requests_client_gone_total"
BODY = {"prompt": "a long one", "max_tokens": MAX_TOKENS, "ignore_eos": True}


@pytest.fixture(scope="module")
def srv(batchsim_home):
    s = ServerProcess(batchsim_home, "--api-key", KEY)
    yield s
    assert s.stop() == 0, "".join(s.stderr)
    assert "Traceback" not in "".join(s.stderr), "".join(s.stderr)
    totals = last_json(s.proc.stdout.read())
    # every request these tests aborted was a client's that left, with some tokens generated
    assert totals["client_gone"] == totals["requests"]["aborted"] >= 1
    assert totals["aborted_generation_tokens"] >= totals["client_gone"]


def _generated_after(srv: ServerProcess, at_close: float, before: dict[str, float]) -> float:
    """Tokens generated since `at_close`, once the server is idle; checks the request was
    aborted as its client gone (not finished) with its tokens so far counted, and its KV
    freed."""
    after = srv.wait_idle()
    assert after[ABORTED] - before[ABORTED] == after[GONE] - before[GONE] == 1
    generated = after[TOKENS] - before[TOKENS]  # the only request since `before`
    kept = after[ABORTED_TOKENS] - before[ABORTED_TOKENS]  # its tokens so far
    # The step computing when it was aborted sampled one more row, which the scheduler drops
    # and no counter counts.
    assert kept > 0 and generated == kept
    assert after["batchsim_requests_running"] == 0
    assert after["batchsim_kv_bytes"] == after["batchsim_prefix_cache_bytes"]
    return after[TOKENS] - at_close


def test_httpx_stream_closed(srv):
    before = srv.wait_idle()
    with (httpx.Client(base_url=srv.url, timeout=60) as client,
          client.stream("POST", "/v1/completions", json={**BODY, "stream": True},
                        headers=AUTH) as r):
        lines = r.iter_lines()
        for _ in range(10):
            next(lines)
        at_close = srv.metrics()[TOKENS]
    assert _generated_after(srv, at_close, before) <= AFTER_CLOSE_TOKENS


def test_openai_stream_closed(srv):
    openai = pytest.importorskip("openai")
    before = srv.wait_idle()
    client = openai.OpenAI(base_url=f"{srv.url}/v1", api_key=KEY, max_retries=0)
    stream = client.completions.create(model="tiny", prompt="a long one", max_tokens=MAX_TOKENS,
                                       stream=True, extra_body={"ignore_eos": True})
    for i, _ in enumerate(stream):
        if i == 5:
            break
    at_close = srv.metrics()[TOKENS]
    stream.close()  # after `break` alone the connection stays open until the Stream is collected
    assert _generated_after(srv, at_close, before) <= AFTER_CLOSE_TOKENS
    client.close()


def test_non_streaming_client_closed(srv):
    """No write tells the server: only the closed connection does."""
    before = srv.wait_idle()
    body = json.dumps({**BODY, "stream": False}).encode()
    with srv.connect() as sock:
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json"
                     b"\r\nAuthorization: Bearer " + KEY.encode()
                     + b"\r\nContent-Length: %d\r\n\r\n" % len(body) + body)
        deadline_polls = 0
        while (at_close := srv.metrics()[TOKENS]) - before[TOKENS] < 20:
            deadline_polls += 1  # generating: at least 20 tokens so far
            assert deadline_polls < 2000, "the request never started generating"
    generated = _generated_after(srv, at_close, before)
    assert generated <= AFTER_CLOSE_TOKENS, f"{generated} tokens after the client closed"


def test_streams_dropped_from_a_batch(srv):
    """Twelve streams decode together; four drop after a few chunks. The dropped ones stop
    within the bound (all they generated against what their clients had read; each may have one
    row sampled at its abort that the scheduler dropped), and the other eight run to their
    max_tokens."""
    live_tokens, n, n_drop = 100, 12, 4
    before = srv.wait_idle()

    async def one(client: httpx.AsyncClient, drop: bool) -> int:
        body = {**BODY, "max_tokens": MAX_TOKENS if drop else live_tokens, "stream": True,
                "stream_options": {"include_usage": True, "continuous_usage_stats": True}}
        seen = 0
        async with client.stream("POST", "/v1/completions", json=body, headers=AUTH) as r:
            async for line in r.aiter_lines():
                if line.startswith("data: {"):
                    seen = json.loads(line[6:])["usage"]["completion_tokens"]
                if drop and seen >= 5:
                    break  # leaving the block closes the connection
        return seen

    async def all_at_once() -> list[int]:
        async with httpx.AsyncClient(base_url=srv.url, timeout=60) as client:
            return await asyncio.gather(*(one(client, i < n_drop) for i in range(n)))

    seen = asyncio.run(all_at_once())
    assert seen[n_drop:] == [live_tokens] * (n - n_drop)
    after = srv.wait_idle()
    assert after[GONE] - before[GONE] == after[ABORTED] - before[ABORTED] == n_drop
    generated = after[TOKENS] - before[TOKENS]
    dropped = generated - live_tokens * (n - n_drop)  # the dropped requests' tokens, all told
    assert dropped - n_drop <= after[ABORTED_TOKENS] - before[ABORTED_TOKENS] <= dropped
    assert dropped - sum(seen[:n_drop]) <= n_drop * AFTER_CLOSE_TOKENS
    assert after["batchsim_decode_batch_size_max"] >= 2
