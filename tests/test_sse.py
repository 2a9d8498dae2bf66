"""The SSE parser: the event-stream format as real OpenAI-compatible servers send it, fed in
arbitrary byte splits (events, lines, CRLF pairs and UTF-8 characters may split across reads)."""

from __future__ import annotations

import itertools
import json

from batchsim.workloads.client.sse import SSEEvent, SSEParser
from hypothesis import given, settings
from hypothesis import strategies as st


def parse(stream: bytes, cuts: list[int] = ()) -> tuple[list[SSEEvent], int]:
    """Events and comment count, feeding `stream` split at `cuts`."""
    parser = SSEParser()
    events: list[SSEEvent] = []
    bounds = [0, *sorted(set(cuts)), len(stream)]
    for a, b in itertools.pairwise(bounds):
        events += parser.feed(stream[a:b])
    return events + parser.close(), parser.num_comments


def chunk(text: str, finish: str | None = None) -> dict:
    return {"id": "cmpl-1", "object": "text_completion",
            "choices": [{"index": 0, "text": text, "finish_reason": finish}]}


# mlx_lm.server's shape: keepalive comments during prefill, token chunks, a usage chunk with empty
# choices, [DONE]; with non-ASCII text so a split can fall inside a character.
MLX_LM_STREAM = (
    b": keepalive 256/1024\n\n: keepalive 512/1024\n\n"
    + b"".join(f"data: {json.dumps(chunk(t), ensure_ascii=False)}\n\n".encode()
               for t in ("Hel", "lo ", "wörld ", "→ ✓"))
    + f"data: {json.dumps(chunk('', 'length'))}\n\n".encode()
    + b'data: {"choices": [], "usage": {"prompt_tokens": 5, "completion_tokens": 4}}\n\n'
    + b"data: [DONE]\n\n"
)


def test_mlx_lm_style_stream():
    events, comments = parse(MLX_LM_STREAM)
    assert comments == 2
    assert [e.is_done for e in events] == [False] * 6 + [True]
    texts = [e.json()["choices"][0]["text"] for e in events[:5]]
    assert "".join(texts) == "Hello wörld → ✓"
    usage = {"prompt_tokens": 5, "completion_tokens": 4}
    assert events[5].json() == {"choices": [], "usage": usage}


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(0, len(MLX_LM_STREAM)), max_size=40))
def test_any_split_gives_the_same_events(cuts):
    assert parse(MLX_LM_STREAM, cuts) == parse(MLX_LM_STREAM)


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(0, 200), max_size=20), st.sampled_from([b"\n", b"\r\n", b"\r"]))
def test_line_endings_and_splits(cuts, eol):
    stream = (b"data: a" + eol + b"data: b" + eol + eol + b": ping" + eol + eol
              + b"event: update" + eol + b"id: 7" + eol + b"data:c" + eol + eol)
    cuts = [c % (len(stream) + 1) for c in cuts]
    events, comments = parse(stream, cuts)
    assert events == [SSEEvent("a\nb"), SSEEvent("c", "update", "7")]
    assert comments == 1


def test_crlf_split_between_cr_and_lf_is_one_line_ending():
    parser = SSEParser()
    assert parser.feed(b"data: x\r") == []
    assert parser.feed(b"\n") == []  # the LF completes the CRLF: not a blank line
    assert parser.feed(b"\r\n") == [SSEEvent("x")]


def test_multiline_data_and_field_rules():
    events, _ = parse(b"data\ndata:  two spaces\ndata: x\nretry: 10\nfoo: bar\n\n")
    assert events == [SSEEvent("\n two spaces\nx")]  # one leading space only is removed


def test_blank_lines_without_data_send_nothing():
    events, comments = parse(b"\n\n: keepalive\n\nevent: ping\n\n\n")
    assert events == []
    assert comments == 1


def test_close_flushes_an_unterminated_event():
    events, _ = parse(b'data: {"a": 1}\n\ndata: [DONE]')
    assert [e.data for e in events] == ['{"a": 1}', "[DONE]"]
    assert events[-1].is_done


def test_bom_is_dropped_once():
    events, _ = parse("\ufeffdata: x\n\n".encode())
    assert events == [SSEEvent("x")]


def test_split_utf8_character():
    data = "data: é✓\n\n".encode()
    parser = SSEParser()
    events = []
    for i in range(len(data)):  # one byte at a time
        events += parser.feed(data[i : i + 1])
    assert events == [SSEEvent("é✓")]


def test_id_persists_across_events():
    events, _ = parse(b"id: 1\ndata: a\n\ndata: b\n\n")
    assert [e.id for e in events] == ["1", "1"]
