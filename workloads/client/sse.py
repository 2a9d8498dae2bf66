"""An incremental parser for server-sent events (the WHATWG event-stream format), fed raw byte
chunks as they arrive: an event, a line, even a UTF-8 character or a CRLF pair may split across
reads.

Real OpenAI-compatible servers differ in the details: mlx_lm.server sends `: keepalive` comment
lines during prefill and a final usage chunk with an empty `choices` list; some end without a blank
line after `data: [DONE]`. The parser reports comments as a count, joins multi-line `data:` fields
with newlines, and `close()` flushes an event left without its blank line."""

from __future__ import annotations

import codecs
import dataclasses
import json
from typing import Any

DONE = "[DONE]"


@dataclasses.dataclass(frozen=True, slots=True)
class SSEEvent:
    data: str  # the data lines joined with "\n"
    event: str = "message"  # the `event:` field, "message" when absent
    id: str | None = None  # the last `id:` seen so far, as the spec keeps it

    @property
    def is_done(self) -> bool:
        """OpenAI's end-of-stream sentinel."""
        return self.data.strip() == DONE

    def json(self) -> Any:
        return json.loads(self.data)


class SSEParser:
    def __init__(self) -> None:
        self._decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self._partial = ""  # text of an incomplete line
        self._after_cr = False  # the last text ended in CR: a leading LF completes that line ending
        self._started = False  # a leading byte-order mark is dropped once
        self._data: list[str] = []
        self._event = ""
        self._last_id: str | None = None
        self.num_comments = 0  # comment lines seen (keepalives)

    def feed(self, chunk: bytes) -> list[SSEEvent]:
        """Events completed by this chunk, in order."""
        return self._feed_text(self._decoder.decode(chunk))

    def close(self) -> list[SSEEvent]:
        """End of stream: the last line and event are taken even without their terminators."""
        events = self._feed_text(self._decoder.decode(b"", final=True))
        if self._partial:
            self._line(self._partial)
            self._partial = ""
        event = self._dispatch()
        return events + ([event] if event else [])

    def _feed_text(self, text: str) -> list[SSEEvent]:
        if not text:  # e.g. half of a UTF-8 character: nothing changes yet
            return []
        if not self._started:
            self._started = True
            text = text.removeprefix("\ufeff")
        if self._after_cr and text.startswith("\n"):
            text = text[1:]
        self._after_cr = text.endswith("\r")
        lines = (self._partial + text).replace("\r\n", "\n").replace("\r", "\n").split("\n")
        self._partial = lines.pop()  # after the last line ending: incomplete (or empty)
        events: list[SSEEvent] = []
        for line in lines:
            if line:
                self._line(line)
                continue
            event = self._dispatch()
            if event is not None:
                events.append(event)
        return events

    def _line(self, line: str) -> None:
        if line.startswith(":"):
            self.num_comments += 1
            return
        name, sep, value = line.partition(":")
        if sep and value.startswith(" "):
            value = value[1:]
        if name == "data":
            self._data.append(value)
        elif name == "event":
            self._event = value
        elif name == "id" and "\0" not in value:
            self._last_id = value
        # `retry:` and unknown fields are ignored, as the spec says.

    def _dispatch(self) -> SSEEvent | None:
        data, event = self._data, self._event
        self._data, self._event = [], ""
        if not data:  # a blank line with no data (after comments, event or id only) sends nothing
            return None
        return SSEEvent("\n".join(data), event or "message", self._last_id)
