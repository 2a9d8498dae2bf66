"""`batchsim serve` against slow, stalled and oversized clients, and the OpenAI API details clients
rely on: header and body timeouts, prompt limits (413), tokenization off the event loop, `created`,
error params, sampling ranges, stream deltas, usage details, /v1/models/{id}, metrics."""

from __future__ import annotations

import asyncio
import json
import time

import pytest
from batchsim.scheduler.pool_geometry import PAGE_TOKENS

from tests.serve_process import ServerProcess, read_until_closed, stream_events, stream_text

PROMPT_LIMIT = 20_000
DISCONNECTS = "batchsim_http_client_disconnects_total"


@pytest.fixture(scope="module")
def srv(batchsim_home):
    s = ServerProcess(batchsim_home, "--memory-gb", "0.002", "--header-timeout-s", "0.5",
                      "--body-timeout-s", "0.5", "--max-prompt-bytes", str(PROMPT_LIMIT))
    yield s
    assert s.stop() == 0, "".join(s.stderr)
    assert not any("Traceback" in line for line in s.stderr), "".join(s.stderr)  # whole log


@pytest.mark.parametrize("sent", [b"", b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-"])
def test_a_connection_without_a_complete_head_is_closed(srv, sent):
    """Nothing, or half a head: the server closes it after --header-timeout-s (it waited
    forever)."""
    with srv.connect() as sock:
        sock.sendall(sent)
        assert read_until_closed(sock) == b""  # closed by the server, nothing answered


def test_a_stalled_body_gets_408_and_the_connection_closes(srv):
    head = (b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            b"Content-Length: 100\r\n\r\n")
    with srv.connect() as sock:
        sock.sendall(head + b'{"prompt":')
        reply = read_until_closed(sock)  # ends: the server closed the connection after answering
    status_line, _, rest = reply.partition(b"\r\n")
    assert b" 408 " in status_line
    error = json.loads(rest.split(b"\r\n\r\n", 1)[1])["error"]
    assert error["code"] == "request_timeout" and error["message"]


def test_a_client_that_leaves_mid_body_is_no_server_error(srv):
    """Half a body, then the client closes: the request is dropped quietly (aiohttp logged a
    ConnectionResetError traceback as a 500 'Error handling request'), the server serves on."""
    head = (b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            b"Content-Length: 100\r\n\r\n")
    logged, left = len(srv.stderr), srv.metrics()[DISCONNECTS]
    for _ in range(3):
        with srv.connect() as sock:
            sock.sendall(head + b'{"prompt":')
    # Counted before aiohttp would log its traceback, in the same task: once /metrics says 3,
    # that line (if any) was written (the module's teardown checks the whole log again).
    deadline = time.monotonic() + 20
    while srv.metrics()[DISCONNECTS] < left + 3 and time.monotonic() < deadline:
        time.sleep(0.02)
    assert srv.metrics()[DISCONNECTS] == left + 3
    assert srv.client.post("/v1/completions", json={"prompt": "hi", "max_tokens": 1}).is_success
    assert not any("Traceback" in line for line in srv.stderr[logged:]), "".join(srv.stderr)


def test_malformed_http_gets_an_openai_error_body(srv):
    with srv.connect() as sock:
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n"
                     b"\r\nzz\r\n{}\r\n0\r\n\r\n")
        reply = read_until_closed(sock)
    assert b" 400 " in reply.split(b"\r\n", 1)[0]
    assert json.loads(reply.split(b"\r\n\r\n", 1)[1])["error"]["type"] == "invalid_request_error"


@pytest.mark.parametrize("path,body,param", [
    ("/v1/completions", {"prompt": "x" * (PROMPT_LIMIT + 1)}, "prompt"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "é" * PROMPT_LIMIT}]},
     "messages"),  # 2 bytes a character: the limit is in bytes
])
def test_prompt_over_the_byte_limit_is_413(srv, path, body, param):
    r = srv.client.post(path, json=body)
    assert r.status_code == 413
    error = r.json()["error"]
    assert (error["param"], error["code"]) == (param, "prompt_too_large")
    assert str(PROMPT_LIMIT) in error["message"]


# -- API conformance -----------------------------------------------------------------------------
def test_created_is_the_response_time(srv):
    card = srv.client.get("/v1/models/tiny").json()
    time.sleep(1.1)  # whole seconds: a response after the server's start has a later `created`
    before = int(time.time())
    full = srv.client.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2}).json()
    events = stream_events(srv, "/v1/completions", {"prompt": "hi", "max_tokens": 2})
    after = int(time.time())
    streamed = {e.json()["created"] for e in events if not e.is_done}
    assert len(streamed) == 1  # one time for every chunk of a stream
    for created in (full["created"], *streamed):
        assert card["created"] < before <= created <= after


def test_models_by_id(srv):
    card = srv.client.get("/v1/models/tiny").json()
    assert card == srv.client.get("/v1/models").json()["data"][0]
    r = srv.client.get("/v1/models/gpt-4")
    assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"


def test_chat_context_error_names_messages(srv):
    long = {"role": "user", "content": "a b " * 3000}  # > 4,096 tokens, < the byte limit
    r = srv.client.post("/v1/chat/completions", json={"messages": [long]})
    error = r.json()["error"]
    assert r.status_code == 400 and (error["param"], error["code"]) == (
        "messages", "context_length_exceeded")


def test_an_over_context_text_prompt_is_a_400_with_nothing_on_stderr(srv):
    """batchsim's own check answers it; transformers' "Token indices sequence length is longer
    than the specified maximum" warning is not repeated on the server's stderr."""
    r = srv.client.post("/v1/completions", json={"prompt": "a b " * 3000})
    assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded"
    time.sleep(0.3)  # the stderr reader thread: any line written before the response is read
    assert not [line for line in srv.stderr if "Token indices" in line], "".join(srv.stderr)


def test_null_max_completion_tokens_keeps_max_tokens(srv):
    body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 3,
            "max_completion_tokens": None, "ignore_eos": True}
    r = srv.client.post("/v1/chat/completions", json=body).json()
    assert r["usage"]["completion_tokens"] == 3
    assert srv.client.post("/v1/chat/completions", json={**body, "max_completion_tokens": 5}
                           ).json()["usage"]["completion_tokens"] == 5


def test_tiny_temperatures_are_greedy(srv):
    body = {"prompt": "Once upon", "max_tokens": 12, "ignore_eos": True}
    greedy = srv.client.post("/v1/completions", json=body).json()["choices"][0]["text"]
    for temperature in (1e-39, 1e-30, 1e-6):
        for seed in (1, 2, 3):
            r = srv.client.post("/v1/completions",
                                json={**body, "temperature": temperature, "seed": seed}).json()
            assert r["choices"][0]["text"] == greedy, (temperature, seed)


@pytest.mark.parametrize("field,value,ok", [
    ("top_p", 0, False), ("top_p", 1.5, False), ("top_p", -0.1, False), ("top_p", "x", False),
    ("top_p", True, False), ("top_k", -2, False), ("top_k", 1.5, False), ("top_k", "5", False),
    ("top_p", 1, True), ("top_p", 0.3, True), ("top_p", None, True), ("top_k", -1, True),
    ("top_k", 0, True), ("top_k", 40, True),
])
def test_top_p_and_top_k_ranges(srv, field, value, ok):
    r = srv.client.post("/v1/completions", json={"prompt": "hi", "max_tokens": 1, field: value})
    assert r.status_code == (200 if ok else 400), r.text
    if not ok:
        assert r.json()["error"]["param"] == field


@pytest.mark.parametrize("path,body", [
    ("/v1/completions", {"prompt": "Tell me", "max_tokens": 60}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Tell me"}],
                              "max_tokens": 60}),
])
def test_streams_send_no_empty_deltas_and_exact_usage(srv, path, body):
    body = {**body, "ignore_eos": True, "stream_options": {"include_usage": True}}
    chat = "messages" in body
    events = stream_events(srv, path, body)
    chunks = [e.json() for e in events if not e.is_done and e.json()["choices"]]
    texts = [c["choices"][0]["delta"].get("content") if chat else c["choices"][0]["text"]
             for c in chunks]
    assert all(texts[:-1])  # only the last one (with finish_reason) may be empty
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"
    usage = events[-2].json()["usage"]
    assert usage["completion_tokens"] == 60
    full = srv.client.post(path, json={k: v for k, v in body.items() if k != "stream_options"})
    resent = (usage["prompt_tokens"] - 2) // PAGE_TOKENS * PAGE_TOKENS  # its cached blocks
    assert full.json()["usage"] == {**usage, "prompt_tokens_details": {"cached_tokens": resent}}
    content = full.json()["choices"][0]["message"]["content"] if chat else (
        full.json()["choices"][0]["text"])
    assert stream_text(events, chat) == content


def test_a_disconnected_stream_is_counted(srv):
    ok = 'batchsim_http_responses_total{code="200"}'
    before = srv.wait_idle()[ok]
    body = {"prompt": "go", "max_tokens": 3000, "ignore_eos": True, "stream": True}
    with srv.client.stream("POST", "/v1/completions", json=body) as r:
        lines = r.iter_lines()
        for _ in range(6):
            next(lines)
    polls, after = 0, {}
    while not polls or after["batchsim_requests_running"] or (
            after["batchsim_kv_bytes"] != after["batchsim_prefix_cache_bytes"]):
        after, polls = srv.metrics(), polls + 1  # each poll counts one 200 in the next
    assert after[ok] - before == polls + 1  # the polls before the last, /metrics before, stream
    assert after["batchsim_memory_budget_bytes"] == int(0.002 * 2**30)
    assert after["process_resident_memory_peak_bytes"] >= after["process_resident_memory_bytes"]
    assert after["batchsim_mlx_peak_bytes"] > 0


# -- tokenization off the event loop (in process, fake executor) ---------------------------------
class GatedTokenizer:
    """The tiny model's tokenizer, except that a huge prompt's encode waits (on the tokenizer
    thread) until the test has seen `need` stream chunks arrive meanwhile, or 30 s pass."""

    def __init__(self, inner, need: int):
        self.inner, self.need = inner, need
        self.received = 0  # chunks of the concurrent stream, counted by the test
        self.received_while_encoding: int | None = None

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def encode(self, text: str):
        if len(text) < 100_000:
            return self.inner.encode(text)
        start, deadline = self.received, time.monotonic() + 30
        while self.received - start < self.need and time.monotonic() < deadline:
            time.sleep(0.005)
        self.received_while_encoding = self.received - start
        return self.inner.encode(text[:1000])


def test_a_large_prompt_does_not_stall_other_streams(tiny):
    """While a ~1 MB prompt is tokenized, a running stream keeps receiving chunks: the event loop
    is free. (On the loop, the tokenizer would wait its 30 s and see none.)"""
    import aiohttp
    from batchsim.scheduler.scheduler import Scheduler
    from batchsim.server.executors.fake_executor import FakeExecutor
    from batchsim.server.http.app import Server, serve
    from batchsim.server.http.options import ServeOptions

    from tests.drivers import config

    _, _, tokenizer = tiny
    gated = GatedTokenizer(tokenizer, need=20)
    vocab = tokenizer.vocab_size
    options = ServeOptions("tiny", max_body_bytes=4 << 20, max_prompt_bytes=2 << 20,
                           max_model_len=1 << 20, vocab_size=vocab, drain_timeout_s=0.1)
    server = Server(Scheduler(config(max_model_len=1 << 20)), FakeExecutor(vocab_size=vocab),
                    gated, options)

    async def main() -> None:
        stop, url = asyncio.Event(), asyncio.get_running_loop().create_future()
        task = asyncio.create_task(serve(server, "127.0.0.1", 0, url.set_result, stop))
        base = await url
        async with aiohttp.ClientSession() as http:
            body = {"prompt": [1, 2, 3], "max_tokens": 500_000, "ignore_eos": True,
                    "stream": True}
            async with http.post(f"{base}/v1/completions", json=body) as stream:
                await stream.content.readline()  # running
                big = asyncio.create_task(http.post(f"{base}/v1/completions", json={
                    "prompt": "word " * 200_000, "max_tokens": 1}))
                while not big.done():
                    await stream.content.readany()
                    gated.received += 1
                assert (await big).status == 200
        stop.set()
        await task

    asyncio.run(main())
    assert gated.received_while_encoding is not None
    assert gated.received_while_encoding >= gated.need


class CountingTokenizer:
    """The tiny model's tokenizer, counting the reads of what serve needs from it once."""

    def __init__(self, inner):
        self.inner, self.reads = inner, {"all_special_ids": 0, "special_tokens_map": 0}

    def __getattr__(self, name):
        if name in self.reads:
            self.reads[name] += 1
        return getattr(self.inner, name)


def _answers(tokenizer, body: dict, times: int = 1) -> list[tuple[int, dict | None]]:
    """(status, error body) of `times` chat requests `body` to a server (fake executor) on
    `tokenizer`."""
    import aiohttp
    from batchsim.scheduler.scheduler import Scheduler
    from batchsim.server.executors.fake_executor import FakeExecutor
    from batchsim.server.http.app import Server, serve
    from batchsim.server.http.options import ServeOptions

    from tests.drivers import config

    vocab = tokenizer.vocab_size
    options = ServeOptions("tiny", max_body_bytes=1 << 20, max_prompt_bytes=1 << 16,
                           max_model_len=4096, vocab_size=vocab, drain_timeout_s=0.1)
    server = Server(Scheduler(config(max_model_len=4096)), FakeExecutor(vocab_size=vocab),
                    tokenizer, options)

    async def main() -> list[tuple[int, dict | None]]:
        stop, url = asyncio.Event(), asyncio.get_running_loop().create_future()
        task = asyncio.create_task(serve(server, "127.0.0.1", 0, url.set_result, stop))
        base, answers = await url, []
        async with aiohttp.ClientSession() as http:
            for _ in range(times):
                async with http.post(f"{base}/v1/chat/completions", json=body) as r:
                    answers.append((r.status, await r.json() if r.status != 200 else None))
        stop.set()
        await task
        return answers

    return asyncio.run(main())


def test_serve_reads_special_ids_and_template_names_once_per_tokenizer(tiny):
    """The chat template's reserved names and the special ids were read again for every request
    (chat_template_kwargs, skip_special_tokens); now once, when the server starts."""
    counting = CountingTokenizer(tiny[2])
    body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2,
            "chat_template_kwargs": {"enable_thinking": False}, "skip_special_tokens": True}
    assert _answers(counting, body, times=3) == [(200, None)] * 3
    assert counting.reads == {"all_special_ids": 1, "special_tokens_map": 1}


class NoSpecialIds:
    """The tiny model's tokenizer without all_special_ids (a tokenizer mlx-lm's wrapper is not)."""

    def __init__(self, inner):
        self.inner = inner

    def __getattr__(self, name):
        if name == "all_special_ids":
            raise AttributeError(name)
        return getattr(self.inner, name)


def test_skip_special_tokens_on_a_tokenizer_naming_no_special_ids_is_a_400_naming_it(tiny):
    """It was a 200 that kept the special tokens' text the client asked to drop (review r4)."""
    body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    [(status, error)] = _answers(NoSpecialIds(tiny[2]), {**body, "skip_special_tokens": True})
    assert status == 400 and error["error"]["param"] == "skip_special_tokens", error
    assert error["error"]["message"].startswith("skip_special_tokens: "), error
    assert _answers(NoSpecialIds(tiny[2]), body) == [(200, None)]  # not asked: as before
