"""`batchsim serve` end to end: the real server in a subprocess on loopback (tiny model), driven by
raw HTTP and by the official openai client. Stop strings in isolation: test_text_stream.py; the
queue limit and shutdown: test_http_shutdown.py; the server process: serve_process.py."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import httpx
import pytest
from batchsim.scheduler.pool_geometry import PAGE_TOKENS
from batchsim.server.http.prometheus import parse as parse_metrics

from tests.serve_process import (
    AUTH,
    KEY,
    MEMORY_GB,
    ServerProcess,
    post,
    stream_events,
    stream_text,
)


@pytest.fixture(scope="module")
def srv(batchsim_home):
    s = ServerProcess(batchsim_home, "--api-key", KEY, "--memory-gb", MEMORY_GB)
    yield s
    assert s.stop() == 0, "".join(s.stderr)


@pytest.fixture(scope="module")
def tokenizer(srv, batchsim_home):
    from batchsim.server.models.loader import resolve
    from batchsim.server.platform.env import default_dtype
    from mlx_lm.tokenizer_utils import load

    return load(resolve("tiny", default_dtype()).path)  # the build the server made



# -- the server ----------------------------------------------------------------------------------
def test_health_models_metrics(srv):
    assert srv.client.get("/health").json() == {"status": "ok"}
    models = srv.client.get("/v1/models", headers=AUTH).json()
    assert models["object"] == "list" and models["data"][0]["id"] == "tiny"
    r = srv.client.get("/metrics")
    assert r.headers["content-type"].startswith("text/plain; version=0.0.4")
    m = parse_metrics(r.text)
    for name in ("batchsim_requests_running", "batchsim_requests_waiting", "batchsim_kv_bytes",
                 "batchsim_kv_budget_bytes", "batchsim_preemptions_total",
                 "batchsim_generation_tokens_total", "batchsim_step_seconds_count",
                 'batchsim_step_seconds_bucket{le="+Inf"}'):
        assert name in m


def test_a_resent_prompt_reuses_its_cached_blocks(srv, tokenizer):
    prompt = " ".join(f"word{i}" for i in range(40))  # a prompt no other test sends
    body = {"model": "tiny", "prompt": prompt, "max_tokens": 2, "ignore_eos": True}
    before = srv.metrics()
    first, second = (post(srv, "/v1/completions", body).json()["usage"] for _ in range(2))
    n = len(tokenizer.encode(prompt))
    assert first["prompt_tokens_details"] == {"cached_tokens": 0}
    cached = (n - 2) // PAGE_TOKENS * PAGE_TOKENS  # whole blocks, the last two tokens computed
    assert cached > 0 and second["prompt_tokens_details"] == {"cached_tokens": cached}
    after = srv.metrics()
    hits = "batchsim_prefix_cache_hits_total"
    assert after[hits] - before[hits] == cached
    queries = "batchsim_prefix_cache_queries_total"
    assert after[queries] - before[queries] == 2 * n


def test_completions_stream_and_not(srv, tokenizer):
    prompt = "The quick brown fox"
    body = {"model": "tiny", "prompt": prompt, "max_tokens": 9, "ignore_eos": True}
    full = post(srv, "/v1/completions", body).json()
    n_prompt = len(tokenizer.encode(prompt))
    assert full["object"] == "text_completion"
    assert full["choices"][0]["finish_reason"] == "length"
    assert full["usage"] == {"prompt_tokens": n_prompt, "completion_tokens": 9,
                             "total_tokens": n_prompt + 9,
                             "prompt_tokens_details": {"cached_tokens": 0}}
    events = stream_events(srv, "/v1/completions",
                           {**body, "stream_options": {"include_usage": True}})
    assert events[-1].is_done
    usage_chunk = events[-2].json()
    resent = (n_prompt - 2) // PAGE_TOKENS * PAGE_TOKENS  # the prompt's blocks are cached now
    assert usage_chunk["choices"] == [] and usage_chunk["usage"] == {
        **full["usage"], "prompt_tokens_details": {"cached_tokens": resent}}
    token_chunks = [e.json() for e in events[:-2]]
    assert 1 <= len(token_chunks) <= 9  # at most one chunk per token; none with empty text
    assert all(c["choices"][0]["text"] for c in token_chunks[:-1])
    finishes = [c["choices"][0]["finish_reason"] for c in token_chunks]
    assert finishes == [None] * (len(token_chunks) - 1) + ["length"]
    assert stream_text(events, chat=False) == full["choices"][0]["text"]  # greedy: same text
    ids = post(srv, "/v1/completions", {**body, "prompt": [5, 6, 7, 8]}).json()
    assert ids["usage"]["prompt_tokens"] == 4


def test_chat_stream_and_not(srv, tokenizer):
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi!"}]
    body = {"model": "tiny", "messages": messages, "max_tokens": 6, "ignore_eos": True}
    full = post(srv, "/v1/chat/completions", body).json()
    n_prompt = len(tokenizer.apply_chat_template(messages, add_generation_prompt=True))
    assert full["object"] == "chat.completion"
    assert full["choices"][0]["message"]["role"] == "assistant"
    assert full["usage"]["prompt_tokens"] == n_prompt
    assert full["usage"]["completion_tokens"] == 6
    events = stream_events(srv, "/v1/chat/completions", body)  # no include_usage: no usage chunk
    assert events[-1].is_done and 2 <= len(events) <= 7
    chunks = [e.json() for e in events[:-1]]
    assert chunks[0]["object"] == "chat.completion.chunk"
    assert chunks[0]["choices"][0]["delta"]["role"] == "assistant"
    assert all("usage" not in c for c in chunks)
    assert stream_text(events, chat=True) == full["choices"][0]["message"]["content"]


def _stop_case(srv: ServerProcess) -> tuple[dict, str, str]:
    """A body, a stop string found in the middle of its greedy text, and the text before it."""
    body = {"prompt": "Once upon a time", "max_tokens": 24, "ignore_eos": True}
    text = post(srv, "/v1/completions", body).json()["choices"][0]["text"]
    stop = next(text[i:i + 2] for i in range(3, len(text) - 2) if text.find(text[i:i + 2]) > 0)
    return body, stop, text[: text.find(stop)]


def test_stop_strings_and_seed(srv):
    body, stop, expected = _stop_case(srv)
    stopped = post(srv, "/v1/completions", {**body, "stop": [stop, "never matches"]}).json()
    assert stopped["choices"][0] == {**stopped["choices"][0], "text": expected,
                                     "finish_reason": "stop"}
    assert stopped["usage"]["completion_tokens"] < 24
    assert stream_text(stream_events(srv, "/v1/completions", {**body, "stop": stop}),
                       chat=False) == expected
    sampled = {**body, "temperature": 1.0, "seed": 7}
    a, b = (post(srv, "/v1/completions", sampled).json()["choices"][0]["text"] for _ in range(2))
    c = post(srv, "/v1/completions", {**sampled, "seed": 8}).json()["choices"][0]["text"]
    assert a == b != c
    negative = post(srv, "/v1/completions", {**sampled, "seed": -5, "temperature": None})
    assert negative.status_code == 200  # any 64-bit seed; null means the default


def test_stop_string_finishes_the_request_in_the_scheduler(srv):
    """A stop string ends the request as finished ("stop"), not aborted, in the step that completed
    it: no token is computed past it, and its KV is freed."""
    body, stop, expected = _stop_case(srv)
    before = srv.wait_idle()
    events = stream_events(srv, "/v1/completions", {**body, "stop": stop})
    assert stream_text(events, chat=False) == expected
    assert events[-2].json()["choices"][0]["finish_reason"] == "stop"
    full = post(srv, "/v1/completions", {**body, "stop": stop}).json()
    assert (full["choices"][0]["text"], full["choices"][0]["finish_reason"]) == (expected, "stop")
    n = full["usage"]["completion_tokens"]
    assert n < body["max_tokens"] and len(events) - 1 <= n  # a chunk per token at most, [DONE]
    after = srv.wait_idle()
    delta = {k: v - before.get(k, 0) for k, v in after.items()}
    assert delta['batchsim_requests_total{status="finished"}'] == 2
    assert delta['batchsim_requests_total{status="aborted"}'] == 0
    assert delta["batchsim_generation_tokens_total"] == 2 * n
    # what stays held is the prompt's cached blocks
    cached, blocks = after["batchsim_prefix_cache_bytes"], after["batchsim_prefix_cache_blocks"]
    assert after["batchsim_kv_bytes"] == after["batchsim_kv_bytes_measured"] == cached
    assert blocks > 0 and cached % blocks == 0  # as many blocks as it holds, of equal bytes


def test_concurrent_requests_share_decode_steps(srv):
    before = srv.metrics()

    async def one(client: httpx.AsyncClient, i: int) -> dict:
        body = {"prompt": f"request {i}", "max_tokens": 40, "ignore_eos": True}
        return (await client.post("/v1/completions", json=body, headers=AUTH)).json()

    async def all_at_once() -> list[dict]:
        async with httpx.AsyncClient(base_url=srv.url, timeout=60) as client:
            return await asyncio.gather(*(one(client, i) for i in range(6)))

    results = asyncio.run(all_at_once())
    assert all(r["usage"]["completion_tokens"] == 40 for r in results)
    after = srv.wait_idle()
    hist = "batchsim_decode_batch_size_steps"
    steps = after[f"{hist}_count"] - before[f"{hist}_count"]
    rows = after[f"{hist}_sum"] - before[f"{hist}_sum"]
    assert after["batchsim_decode_batch_size_max"] >= 2
    assert rows / steps > 2  # six requests of 40 tokens took far fewer than 240 decode steps
    held = after["batchsim_prefix_cache_bytes"]  # cached prompt blocks stay
    assert after["batchsim_kv_bytes"] == after["batchsim_kv_bytes_measured"] == held


def _bad_requests() -> list[tuple[str, object, int, str | None]]:
    ok = {"prompt": "hi", "max_tokens": 4}
    return [  # (path, body (raw bytes or JSON), status, param or code)
        ("/v1/completions", b"{not json", 400, None),
        ("/v1/completions", b"[1, 2]", 400, None),
        ("/v1/completions", {"max_tokens": 4}, 400, "prompt"),
        ("/v1/completions", {"prompt": 42}, 400, "prompt"),
        ("/v1/completions", {"prompt": ["a", "b"]}, 400, "prompt"),
        ("/v1/completions", {"prompt": [600]}, 400, "prompt"),
        ("/v1/completions", {**ok, "max_tokens": -1}, 400, "max_tokens"),
        ("/v1/completions", {**ok, "max_tokens": 0}, 400, "max_tokens"),
        ("/v1/completions", {**ok, "max_tokens": "10"}, 400, "max_tokens"),
        ("/v1/completions", {**ok, "max_tokens": 2.5}, 400, "max_tokens"),
        ("/v1/completions", {**ok, "max_tokens": True}, 400, "max_tokens"),
        ("/v1/completions", {**ok, "max_tokens": 10**9}, 400, "context_length_exceeded"),
        ("/v1/completions", {**ok, "temperature": -1}, 400, "temperature"),
        ("/v1/completions", {**ok, "temperature": "hot"}, 400, "temperature"),
        ("/v1/completions", {**ok, "seed": "x"}, 400, "seed"),
        ("/v1/completions", {**ok, "seed": 2**64}, 400, "seed"),
        ("/v1/completions", {**ok, "stop": 5}, 400, "stop"),
        ("/v1/completions", {**ok, "stop": [""]}, 400, "stop"),
        ("/v1/completions", {**ok, "ignore_eos": "yes"}, 400, "ignore_eos"),
        ("/v1/completions", {**ok, "stream": "yes"}, 400, "stream"),
        ("/v1/completions", {**ok, "n": 2}, 400, "n"),
        ("/v1/completions", {**ok, "stream_options": {"include_usage": True}}, 400,
         "stream_options"),
        ("/v1/completions", {"prompt": [7] * 5000}, 400, "context_length_exceeded"),
        ("/v1/completions", {"prompt": [7] * 3400, "max_tokens": 10}, 400, "kv_budget_exceeded"),
        ("/v1/completions", {**ok, "model": "gpt-4"}, 404, "model_not_found"),
        ("/v1/completions", {**ok, "model": 3}, 400, "model"),
        ("/v1/chat/completions", {"max_tokens": 4}, 400, "messages"),
        ("/v1/chat/completions", {"messages": [{"role": "wizard", "content": "x"}]}, 400,
         "messages[0]"),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": 5}]}, 400,
         "messages[0].content"),
        ("/v1/completions", {"prompt": "x" * (2 << 20)}, 413, "request_too_large"),
        # These were 500s: RecursionError in json.loads, lone surrogates reaching the tokenizer.
        # (bytearray: a short test id, not the body's 300 KB)
        ("/v1/completions", bytearray(b'{"prompt":' + b"[" * 50_000 + b"]" * 50_000 + b"}"),
         400, None),
        ("/v1/chat/completions",
         bytearray(b'{"messages":' + b'{"a":' * 50_000 + b"1" + b"}" * 50_001), 400, None),
        ("/v1/completions", b'{"prompt": "\\ud800", "max_tokens": 4}', 400, None),
        ("/v1/completions", b'{"prompt": "hi", "stop": ["\\udfff"], "max_tokens": 4}', 400, None),
        ("/v1/chat/completions", b'{"messages": [{"role": "user", "content": "\\ud800"}]}', 400,
         None),
        ("/v1/completions", b'{"prompt": "\xed\xa0\x80"}', 400, None),  # a surrogate in UTF-8
        ("/v1/completions", b'{"prompt": "\xff\xfe"}', 400, None),  # not UTF-8 at all
        ("/v1/nowhere", ok, 404, None),
    ]


@pytest.mark.parametrize("path,body,status,what", _bad_requests())
def test_bad_input_gets_openai_error(srv, path, body, status, what):
    raw = bytes(body) if isinstance(body, (bytes, bytearray)) else json.dumps(body).encode()
    r = srv.client.post(path, content=raw, headers={**AUTH, "Content-Type": "application/json"})
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"]
    if what is not None:
        assert what in (error["param"], error["code"]), error
    if body == {"prompt": [7] * 3400, "max_tokens": 10}:
        assert "KV budget" in error["message"]


def test_auth_method_and_health_after_bad_input(srv):
    body = {"prompt": "hi", "max_tokens": 3}
    for headers in ({}, {"Authorization": "Bearer wrong"}):
        r = srv.client.post("/v1/completions", json=body, headers=headers)
        assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
    assert srv.client.get("/v1/completions", headers=AUTH).status_code == 405
    assert srv.client.get("/health").status_code == 200  # /health and /metrics need no key
    assert post(srv, "/v1/completions", body).json()["usage"]["completion_tokens"] >= 1
    m = srv.wait_idle()
    assert m['batchsim_http_responses_total{code="400"}'] >= 20


def test_client_disconnect_frees_kv(srv):
    before = srv.metrics()
    body = {"prompt": "a long one", "max_tokens": 3000, "ignore_eos": True, "stream": True}
    with (httpx.Client(base_url=srv.url, timeout=60) as client,
          client.stream("POST", "/v1/completions", json=body, headers=AUTH) as r):
        lines = r.iter_lines()
        for _ in range(10):
            next(lines)
        m = srv.metrics()
        assert m["batchsim_kv_bytes"] > m["batchsim_prefix_cache_bytes"]  # its own KV
    # a non-streaming client that gives up
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(f"{srv.url}/v1/completions", json={**body, "stream": False}, headers=AUTH,
                   timeout=httpx.Timeout(60, read=0.5))
    after = srv.wait_idle()
    held = after["batchsim_prefix_cache_bytes"]  # cached prompt blocks stay
    assert after["batchsim_kv_bytes"] == after["batchsim_kv_bytes_measured"] == held
    assert after["batchsim_requests_running"] == 0
    aborted = 'batchsim_requests_total{status="aborted"}'
    assert after[aborted] - before[aborted] == 2
    tokens = "batchsim_generation_tokens_total"
    generated = after[tokens] - before[tokens]
    assert generated < 3000  # both stopped long before their max_tokens


def test_openai_client(srv):
    openai = pytest.importorskip("openai")
    client = openai.OpenAI(base_url=f"{srv.url}/v1", api_key=KEY, max_retries=0)
    extra = {"ignore_eos": True}
    c = client.completions.create(model="tiny", prompt="Hello", max_tokens=5, extra_body=extra)
    assert c.usage.completion_tokens == 5 and c.choices[0].finish_reason == "length"
    chunks = list(client.completions.create(model="tiny", prompt="Hello", max_tokens=5, stream=True,
                                            stream_options={"include_usage": True},
                                            extra_body=extra))
    assert "".join(ch.choices[0].text for ch in chunks if ch.choices) == c.choices[0].text
    assert chunks[-1].usage.completion_tokens == 5
    messages = [{"role": "user", "content": "Hello"}]
    chat = client.chat.completions.create(model="tiny", messages=messages, max_tokens=4,
                                          extra_body=extra)
    assert chat.usage.completion_tokens == 4 and chat.choices[0].message.role == "assistant"
    parts = list(client.chat.completions.create(model="tiny", messages=messages, max_tokens=4,
                                                stream=True, stream_options={"include_usage": True},
                                                extra_body=extra))
    text = "".join(p.choices[0].delta.content or "" for p in parts if p.choices)
    assert text == chat.choices[0].message.content
    assert parts[-1].usage.completion_tokens == 4
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="nope", prompt="Hello", max_tokens=2)


# -- the load generator against the server -------------------------------------------------------
def test_run_target_reports_like_in_process(srv, tmp_path, monkeypatch):
    import dataclasses

    from batchsim.scripts.run_cmd import run_over_http
    from batchsim.server.engine.run_config import RunConfig
    from batchsim.workloads.lengths import parse_length
    from batchsim.workloads.spec import WorkloadSpec

    monkeypatch.setenv("OPENAI_API_KEY", KEY)
    spec = WorkloadSpec(name="t", num_prompts=6, request_rate=float("inf"),
                        input_len=parse_length("uniform:8:40"), output_len=parse_length("12"))
    cfg = dataclasses.replace(RunConfig(model="tiny", workload=spec), target=f"{srv.url}/v1")
    summary = run_over_http(cfg, tmp_path, progress=False)
    assert summary["completed"] == 6 and summary["failed"] == 0
    assert summary["total_output_tokens"] == 6 * 12
    assert summary["mean_ttft_ms"] > 0 and summary["mean_tpot_ms"] > 0
    assert summary["max_batch_size"] >= 2 and summary["batch_view_source"] == "server /metrics"
    # what the client cannot see is unknown, not 0 (the table printed "Peak KV 0", "Queue 0")
    assert summary["peak_kv_bytes"] is None and summary["mean_queue_ms"] is None
    assert summary["prompt_tps"] is None and summary["generation_tps"] is None
    rows = [json.loads(line)
            for line in Path(summary["run_dir"], "requests.jsonl").read_text().splitlines()]
    assert [r["num_output_tokens"] for r in rows] == [12] * 6
    assert all(r["num_prompt_tokens"] == r["prompt_tokens_local"] for r in rows)
    chat = run_over_http(dataclasses.replace(cfg, target=f"{srv.url}/v1/chat/completions"),
                         tmp_path,
                         progress=False)
    assert chat["completed"] == 6
    assert chat["total_input_tokens"] > summary["total_input_tokens"]  # the chat template's tokens
