"""Fuzzing `batchsim serve` (the real server, tiny model, on loopback): over 1,000 malformed or
hostile requests per run (JSON of every type and nesting, any Unicode, raw bytes, wrong encodings
and content types, odd methods, paths and headers, and broken HTTP framing on raw sockets). Not
one may be answered >= 500, every 4xx carries the OpenAI error body, and afterwards the server
still completes a normal request."""

from __future__ import annotations

import json
import socket

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.serve_process import ServerProcess, read_until_closed

KEY = "sk-fuzz"
# Examples per test; each sends BATCH requests (hypothesis spends less per request that way).
EXAMPLES = {"json": 120, "bytes": 60, "route": 50, "framing": 50}
BATCH = 4  # 280 examples x 4 = 1,120 requests
MAX_BODY = 65536


def _settings(kind: str):
    return settings(max_examples=EXAMPLES[kind], deadline=None, database=None,
                    suppress_health_check=list(HealthCheck))


def batch(*strategies):
    return st.lists(st.tuples(*strategies), min_size=BATCH, max_size=BATCH)


@pytest.fixture(scope="module")
def srv(batchsim_home):
    s = ServerProcess(batchsim_home, "--api-key", KEY, "--memory-gb", "0.002",
                      "--header-timeout-s", "2", "--body-timeout-s", "2",
                      "--max-body-bytes", str(MAX_BODY))
    s.sent = 0
    yield s
    assert s.stop() == 0, "".join(s.stderr)


def check_reply(status: int, body: bytes, method: str = "POST") -> None:
    assert status < 500, body[:300]
    if 400 <= status < 500 and method != "HEAD":
        error = json.loads(body)["error"]
        assert set(error) == {"message", "type", "param", "code"}, error
        assert isinstance(error["message"], str) and error["message"]


# -- strategies ----------------------------------------------------------------------------------
text = st.text(st.characters(codec=None), max_size=40)  # any code point, lone surrogates too
scalars = st.one_of(st.none(), st.booleans(), st.integers(), st.floats(), text)
values = st.recursive(scalars, lambda inner: st.one_of(
    st.lists(inner, max_size=4), st.dictionaries(text, inner, max_size=4)), max_leaves=8)
# Valid lengths are short, so a request that does run ends in a few steps.
lengths = st.one_of(st.integers(-3, 6), st.integers(min_value=5000), st.integers(max_value=-1),
                    values)
FIELDS = {
    "prompt": st.one_of(text, st.lists(st.integers(-2, 600), max_size=6),
                        st.lists(text, max_size=3),
                        values),
    "messages": st.one_of(st.lists(st.fixed_dictionaries(
        {"role": st.sampled_from(["user", "system", "assistant", "tool", "wizard", ""]),
         "content": st.one_of(text, st.lists(st.fixed_dictionaries(
             {"type": st.sampled_from(["text", "image_url"]), "text": values}), max_size=2),
             values)}), max_size=3), values),
    "max_tokens": lengths, "max_completion_tokens": lengths,
    "temperature": st.one_of(st.floats(), values), "top_p": st.one_of(st.floats(), values),
    "top_k": st.one_of(st.integers(), values), "seed": st.one_of(st.integers(), values),
    "stop": st.one_of(text, st.lists(text, max_size=20), values),
    "stream": st.one_of(st.booleans(), values), "ignore_eos": st.one_of(st.booleans(), values),
    "stream_options": st.one_of(st.fixed_dictionaries({"include_usage": values}), values),
    "model": st.one_of(st.just("tiny"), text, values), "n": values, "logprobs": values,
    "echo": values, "best_of": values, "suffix": values, "top_logprobs": values, "user": values,
    "min_p": st.one_of(st.floats(), values), "repetition_penalty": st.one_of(st.floats(), values),
    "frequency_penalty": st.one_of(st.floats(), values),
    "presence_penalty": st.one_of(st.floats(), values),
    "logit_bias": st.one_of(st.dictionaries(st.one_of(text, st.integers(-2, 600).map(str)),
                                            st.one_of(st.floats(), values), max_size=4), values),
    "stop_token_ids": st.one_of(st.lists(st.integers(-2, 600), max_size=4), values),
    "response_format": values, "min_tokens": values, "tools": values,
}
bodies = st.dictionaries(st.sampled_from(sorted(FIELDS)), st.none(), max_size=8).flatmap(
    lambda keys: st.fixed_dictionaries({k: FIELDS[k] for k in keys}))
GEN_PATHS = ["/v1/completions", "/v1/chat/completions"]


def _bounded(body: dict) -> dict:
    """A body whose generation, if it runs, is short: a default max_tokens is up to 512."""
    if body.get("max_tokens") is None and body.get("max_completion_tokens") is None:
        body = {**body, "max_tokens": 4}
    return body


def _post(srv: ServerProcess, path: str, content: bytes, headers: dict,
          method: str = "POST") -> None:
    try:
        r = srv.client.request(method, path, content=content, headers=headers)
    except httpx.LocalProtocolError:
        return  # httpx refused to send it (a header value it deems illegal)
    srv.sent += 1
    check_reply(r.status_code, r.content, method)


# -- JSON bodies ---------------------------------------------------------------------------------
@_settings("json")
@given(batch(st.sampled_from(GEN_PATHS), st.one_of(bodies, values), st.booleans()))
def test_fuzz_json_bodies(srv, requests):
    for path, body, nan in requests:
        if isinstance(body, dict):
            body = _bounded(body)
        raw = json.dumps(body, allow_nan=nan).encode() if nan or _finite(body) else b"{}"
        _post(srv, path, raw, {"Authorization": f"Bearer {KEY}",
                               "Content-Type": "application/json"})


def _finite(obj) -> bool:
    try:
        json.dumps(obj, allow_nan=False)
        return True
    except ValueError:
        return False


# -- raw bytes, encodings, content types ---------------------------------------------------------
def _mangle(raw: bytes, cut: int, junk: bytes, at: int) -> bytes:
    at = at % (len(raw) + 1)
    return (raw[:at] + junk + raw[at:])[: max(cut, 0) or None]


def _encoded(prompt: str, encoding: str) -> bytes:
    """A body in another encoding than UTF-8, lone surrogates kept where the codec can."""
    raw = json.dumps({"prompt": prompt, "max_tokens": 2}, ensure_ascii=False)
    return raw.encode(encoding, "replace" if encoding == "latin-1" else "surrogatepass")


good = json.dumps({"prompt": "hello there", "max_tokens": 2}).encode()
raw_bodies = st.one_of(
    st.binary(max_size=300),
    st.builds(_mangle, st.just(good), st.integers(0, len(good)), st.binary(max_size=8),
              st.integers(0, 100)),
    st.builds(_encoded, text, st.sampled_from(["utf-8", "utf-16", "utf-32", "latin-1"])),
    st.builds(lambda n, o, c: b'{"prompt":' + o * n + c * n + b"}", st.integers(1, 30_000),
              st.sampled_from([b"[", b'{"a":', b"[[{"]), st.sampled_from([b"]", b"}", b""])),
    st.builds(lambda n: b'{"prompt": "' + b"x" * n + b'"}',
              st.integers(MAX_BODY - 40, MAX_BODY + 40)),
)
content_types = st.sampled_from([
    None, "application/json", "text/plain", "application/x-www-form-urlencoded",
    "multipart/form-data; boundary=zz", "application/json; charset=latin-1",
    "application/json; charset=utf-16", "application/json; charset=nonsense", "*/*", "",
])


@_settings("bytes")
@given(batch(st.sampled_from(GEN_PATHS), raw_bodies, content_types,
             st.sampled_from([None, "gzip", "deflate", "br", "identity", "zstd", "bogus"])))
def test_fuzz_raw_bodies(srv, requests):
    for path, raw, ctype, encoding in requests:
        headers = {"Authorization": f"Bearer {KEY}"}
        if ctype is not None:
            headers["Content-Type"] = ctype
        if encoding is not None:
            headers["Content-Encoding"] = encoding
        _post(srv, path, raw, headers)


# -- methods, paths, headers ---------------------------------------------------------------------
paths = st.one_of(
    st.sampled_from(["/", "/health", "/metrics", "/v1/models", "/v1/models/tiny", "/v1/models/x",
                     "/v1/models/", "//v1/completions", "/v1/completions/", "/v1/../v1/models",
                     "/v1/completions?x=1", "/v1/chat/completions#f", "/%00", "/v1/%ff%fe"]),
    st.builds(lambda s: "/v1/models/" + s,
              st.text(st.characters(min_codepoint=33, max_codepoint=0x2FFF,
                                                                 exclude_characters="?#",
                                                                 exclude_categories=("Cc",)),
                                                  min_size=1, max_size=30)),
    st.builds(lambda n: "/v1/" + "a" * n, st.integers(0, 6000)),
)
header_values = st.text(st.characters(min_codepoint=32, max_codepoint=126), max_size=60)


@_settings("route")
@given(batch(st.sampled_from(["GET", "POST", "PUT", "DELETE", "PATCH", "OPTIONS", "HEAD"]), paths,
             st.sampled_from([None, f"Bearer {KEY}", "Bearer", "Basic abc", KEY, ""]),
             st.dictionaries(st.sampled_from(["Accept", "Accept-Encoding", "X-Junk", "Expect",
                                              "Content-Type", "Connection", "User-Agent"]),
                             header_values, max_size=3),
             st.one_of(st.just(b""), st.just(good), st.binary(max_size=40))))
def test_fuzz_methods_paths_headers(srv, requests):
    for method, path, auth, extra, body in requests:
        headers = dict(extra)
        if auth is not None:
            headers["Authorization"] = auth
        _post(srv, path, body, headers, method)


# -- HTTP framing on raw sockets -----------------------------------------------------------------
request_lines = st.one_of(
    st.sampled_from([b"POST /v1/completions HTTP/1.1", b"POST /v1/completions HTTP/1.0",
                     b"GET /health HTTP/1.1", b"POST /v1/completions HTTP/2.0",
                     b"POST /v1/completions HTTP/1.1x", b"POST  /v1/completions HTTP/1.1",
                     b"P\x00ST /v1/completions HTTP/1.1", b"POST /v1/completions",
                     b"\x16\x03\x01\x02\x00\x01\x00\x01\xfc\x03\x03", b"", b"GET " + b"/a" * 5000]),
    st.binary(max_size=60))
header_lines = st.lists(st.one_of(
    st.sampled_from([b"Host: x", b"Content-Length: 5", b"Content-Length: -1",
                     b"Content-Length: 99999999999999999999", b"Content-Length: 1, 2",
                     b"Transfer-Encoding: chunked", b"Transfer-Encoding: gzip, chunked",
                     b"Transfer-Encoding: identity", b"Content-Type: application/json",
                     b"Bad Header: x", b" folded: continuation", b"X: \x00\x01",
                     b"Authorization: Bearer " + KEY.encode(), b"Expect: 100-continue",
                     b"Content-Encoding: gzip", b"X-Long: " + b"a" * 9000, b":", b"NoColon"]),
    st.binary(max_size=30)), max_size=6)
framed_bodies = st.one_of(
    st.just(b""), st.just(good), st.binary(max_size=80),
    st.sampled_from([b"5\r\n{\"a\":\r\n0\r\n\r\n", b"zz\r\n{}\r\n0\r\n\r\n", b"3\r\n{}", b"-1\r\n",
                     b"ffffffffffffffffff\r\n", b"2;ext=1\r\n{}\r\n0\r\n\r\n",
                     b"%x\r\n" % len(good) + good + b"\r\n0\r\n\r\n"]))


@_settings("framing")
@given(batch(request_lines, header_lines, framed_bodies))
def test_fuzz_http_framing(srv, requests):
    for line, headers, body in requests:
        _send_raw(srv, line + b"\r\n" + b"".join(h + b"\r\n" for h in headers) + b"\r\n" + body)


def _send_raw(srv: ServerProcess, request: bytes) -> None:
    srv.sent += 1
    with srv.connect() as sock:
        try:
            sock.sendall(request)
            sock.shutdown(socket.SHUT_WR)  # the end of what this client sends
        except OSError:
            return  # the server already closed on us: nothing answered, nothing to check
        reply = read_until_closed(sock)
    while reply:  # none (closed without an answer: not HTTP, or cut short at EOF) or several
        head, _, rest = reply.partition(b"\r\n\r\n")
        status = int(head.split(b" ", 2)[1])
        fields = dict(h.split(b": ", 1) for h in head.split(b"\r\n")[1:] if b": " in h)
        if status == 100 or b"chunked" in fields.get(b"Transfer-Encoding", b""):
            assert status in (100, 200)
            reply = rest if status == 100 else b""  # 100 Continue, or a valid request's stream
            continue
        n = int(fields.get(b"Content-Length", len(rest)))
        check_reply(status, rest[:n])
        reply = rest[n:]


# -- afterwards ----------------------------------------------------------------------------------
def test_server_healthy_after_fuzzing(srv):
    """Runs last in this module: the fuzzing left no 5xx and a server that still serves."""
    assert srv.sent >= 1000
    r = srv.client.post("/v1/completions", json={"prompt": "hello", "max_tokens": 5,
                                                 "ignore_eos": True},
                        headers={"Authorization": f"Bearer {KEY}"})
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 5
    m = srv.wait_idle()
    codes = {k: v for k, v in m.items() if k.startswith("batchsim_http_responses_total")}
    assert not [k for k in codes if '"5' in k], codes
    held = m["batchsim_prefix_cache_bytes"]  # cached prompt blocks stay
    assert m["batchsim_kv_bytes"] == m["batchsim_kv_bytes_measured"] == held
    assert m["batchsim_kv_account_mismatches_total"] == 0
