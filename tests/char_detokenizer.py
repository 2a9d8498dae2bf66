"""A detokenizer for the stop-string tests (TextStream): no tokenizer, one character a token."""

from __future__ import annotations


class CharDetokenizer:
    """Token id = a character code, released one character at a time."""

    def __init__(self) -> None:
        self.text, self.offset = "", 0

    def add_token(self, token: int) -> None:
        self.text += chr(token)

    def finalize(self) -> None:
        pass

    @property
    def last_segment(self) -> str:
        segment, self.offset = self.text[self.offset:], len(self.text)
        return segment
