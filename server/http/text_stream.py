"""A request's output text as its tokens arrive: incremental detokenization (mlx-lm's streaming
detokenizer) plus stop strings. Text is released only once no stop string can still begin in it,
so a streamed response never shows a stop string or any part of one. With stop strings the stream
is the request's StopChecker: the scheduler feeds it each step's tokens and finishes the request
("stop") in the step that completes one, so its KV is freed at the next step."""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable
from typing import Any

from batchsim.scheduler.request import Request
from batchsim.server.engine.engine import Engine
from batchsim.server.http.openai_api import GenerationParams


class TextStream:
    def __init__(self, detokenizer: Any, stop: tuple[str, ...] = (),
                 skip_ids: frozenset[int] = frozenset()):
        self._detok = detokenizer  # a fresh StreamingDetokenizer (tokenizer.detokenizer)
        self._stop = stop
        self._skip_ids = skip_ids  # tokens without text (EOS; skip_special_tokens: all special)
        self._pending = ""  # decoded, not yet released
        self._ready: deque[str] = deque()  # released text per fed step, not yet taken
        self.stopped = False  # a stop string matched: the text is complete

    def feed(self, token_ids: Iterable[int]) -> int | None:
        """One step's tokens (StopChecker), checked one at a time as plain decoding would: None
        while no stop string matched, else the tokens taken through the one completing it."""
        released, taken = [], 0
        for token in token_ids:
            if self.stopped:
                break
            taken += 1
            if token not in self._skip_ids:
                self._detok.add_token(token)
            released.append(self._release(final=False))
        self._ready.append("".join(released))
        return taken if self.stopped else None

    def take(self) -> str:
        """The text the oldest fed step released (often empty), in the order fed."""
        return self._ready.popleft() if self._ready else ""

    def finish(self) -> str:
        """All text not yet taken, once the request has ended."""
        self._detok.finalize()
        rest = self._release(final=True)
        text = "".join(self._ready) + rest
        self._ready.clear()
        return text

    def _release(self, final: bool) -> str:
        if self.stopped:
            return ""
        self._pending += self._detok.last_segment
        text = self._pending
        cut = min((i for i in (text.find(s) for s in self._stop) if i >= 0), default=-1)
        if cut >= 0:
            self.stopped = True
            self._pending = ""
            return text[:cut]
        keep = 0 if final else self._held_suffix(text)
        self._pending = text[len(text) - keep:] if keep else ""
        return text[: len(text) - keep]

    def _held_suffix(self, text: str) -> int:
        """Length of the longest end of `text` that a stop string starts with."""
        longest = max((len(s) for s in self._stop), default=1) - 1
        for k in range(min(longest, len(text)), 0, -1):
            tail = text[-k:]
            if any(s.startswith(tail) for s in self._stop):
                return k
        return 0


class Generation:
    """One request's tokens turned into text deltas, stop strings applied."""

    def __init__(self, engine: Engine, request: Request, params: GenerationParams, tokenizer: Any,
                 special_ids: frozenset[int]):
        """`special_ids`: the tokenizer's all_special_ids, read once (skip_special_tokens)."""
        skip = frozenset() if request.sampling.ignore_eos else request.eos_token_ids
        if params.skip_special_tokens:
            skip = skip | special_ids
        self.engine = engine
        self.request = request
        self.text = TextStream(tokenizer.detokenizer, params.stop, skip)
        if params.stop:  # the scheduler feeds it; without stop strings, `next` does (off its path)
            request.stop_checker = self.text
        self.queue = engine.stream(request)
        self.num_tokens = 0
        self.finish_reason: str | None = None
        self.done = False

    async def next(self) -> str:
        """Text released by the next step's tokens (possibly empty); `done` once it has ended."""
        item = await self.queue.get()
        if isinstance(item, Request):  # ended without a new token: aborted or rejected
            return self._end(item.finish_reason or "abort", self.text.finish())
        self.num_tokens += len(item)
        r = self.request
        if r.stop_checker is None:
            self.text.feed(item)
        # The last token list: the request is finished and we have caught up with it (a slow
        # reader may still have lists queued from earlier steps).
        if r.is_finished and self.num_tokens >= r.num_output_tokens:
            return self._end(r.finish_reason or "stop", self.text.finish())
        return self.text.take()

    def _end(self, reason: str, text: str) -> str:
        self.done = True
        self.finish_reason = reason
        return text
