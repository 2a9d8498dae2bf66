"""Stop strings in isolation: the server's TextStream and Generation on a character
detokenizer (moved from test_http_server.py)."""

from __future__ import annotations

import asyncio

import pytest
from batchsim.server.http.text_stream import TextStream

from tests.char_detokenizer import CharDetokenizer


# -- stop strings in isolation -------------------------------------------------------------------
@pytest.mark.parametrize("text,stop,expected", [
    ("hello world", ("wor",), "hello "),
    ("hello world", ("xyz",), "hello world"),
    ("aaab", ("aab",), "a"),  # overlapping prefixes
    ("abcabd", ("abd", "ca"), "ab"),  # the earliest match wins
    ("hello", ("lo!",), "hello"),  # a held-back prefix is released at the end
])
def test_text_stream_stop_strings(text, stop, expected):
    ts = TextStream(CharDetokenizer(), stop)
    released = ""
    for ch in text:
        stopped = ts.feed([ord(ch)])  # as the scheduler does, one step at a time
        released += ts.take()
        assert not any(s in released for s in stop)
        if stopped:
            break
    released += ts.finish()
    assert released == expected
    assert ts.stopped == (expected != text)


def test_text_stream_skips_eos():
    ts = TextStream(CharDetokenizer(), (), skip_ids=frozenset({0}))
    assert not ts.feed([ord("a"), 0])
    assert ts.finish() == "a"


def test_generation_reads_every_queued_token_of_a_finished_request():
    """A slow reader finds its request already finished with several steps' tokens queued."""
    from batchsim.scheduler.request import Request, RequestStatus, SamplingParams
    from batchsim.server.http.openai_api import GenerationParams
    from batchsim.server.http.text_stream import Generation

    request = Request(1, 1, SamplingParams(max_tokens=3), 0.0, [5])
    request.status, request.finish_reason, request.num_output_tokens = (
        RequestStatus.FINISHED, "length", 3)

    class Engine:
        def stream(self, r: Request) -> asyncio.Queue:
            q: asyncio.Queue = asyncio.Queue()
            for item in ([ord("a")], [ord("b")], [ord("c")], r):
                q.put_nowait(item)
            return q

    class Tokenizer:
        detokenizer = CharDetokenizer()

    params = GenerationParams("completion", (5,), 3, request.sampling, (), False, False)

    async def read() -> tuple[list[str], str | None]:
        gen = Generation(Engine(), request, params, Tokenizer(), frozenset())
        parts = []
        while not gen.done:
            parts.append(await gen.next())
        return parts, gen.finish_reason

    assert asyncio.run(read()) == (["a", "b", "c"], "length")



def test_skip_special_tokens_drops_their_text_and_spaces_between_them_is_refused():
    """skip_special_tokens was neither honoured nor refused (a 200 with the special tokens'
    text); spaces_between_special_tokens is refused where it would change the text."""
    from batchsim.scheduler.request import Request, SamplingParams
    from batchsim.server.http.fields import APIError
    from batchsim.server.http.openai_api import parse_generation
    from batchsim.server.http.text_stream import Generation

    class Engine:
        def stream(self, r: Request) -> asyncio.Queue:
            return asyncio.Queue()

    class Tokenizer:
        def __init__(self) -> None:
            self.detokenizer = CharDetokenizer()
            self.all_special_ids = [ord("<"), ord(">")]

        def encode(self, text: str) -> list[int]:
            return [ord(c) for c in text]

    def text(body: dict) -> str:
        params = parse_generation(body, "completion", Tokenizer(), 1000, 10_000)
        request = Request(1, 1, SamplingParams(max_tokens=4), 0.0, [5])
        special = frozenset(Tokenizer().all_special_ids)
        gen = Generation(Engine(), request, params, Tokenizer(), special)
        gen.text.feed([ord(c) for c in "<a>b"])
        return gen.text.finish()

    body = {"prompt": "hi"}
    assert text(body) == text({**body, "skip_special_tokens": False}) == "<a>b"
    assert text({**body, "skip_special_tokens": True}) == "ab"
    assert text({**body, "skip_special_tokens": True, "spaces_between_special_tokens": False})
    # false asks for what serve writes (r7 LOW 3: it was a 400 too)
    assert text({**body, "spaces_between_special_tokens": False}) == "<a>b"
    for bad in ({"skip_special_tokens": 1}, {"spaces_between_special_tokens": True},
                {"skip_special_tokens": True, "spaces_between_special_tokens": "x"}):
        with pytest.raises(APIError) as err:
            text({**body, **bad})
        assert err.value.param == next(reversed(bad)), err.value


def test_mlx_lm_detokenizer_joins_adjacent_special_tokens_with_no_space(tiny):
    """What spaces_between_special_tokens=false asks for, which serve therefore accepts."""
    tokenizer = tiny[2]
    a, b = tokenizer.all_special_ids[:2]
    detokenizer = tokenizer.detokenizer
    detokenizer.reset()
    for token in (a, b, a):
        detokenizer.add_token(token)
    detokenizer.finalize()
    names = tokenizer.convert_ids_to_tokens([a, b, a])
    assert detokenizer.text == "".join(names) and " " not in detokenizer.text, names
