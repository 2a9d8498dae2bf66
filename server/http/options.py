"""The HTTP server's options and their defaults (read by `batchsim serve`'s flags too). A module of
its own, without aiohttp, so the CLI builds its parser without importing the server."""

from __future__ import annotations

import dataclasses

# Default prompt limit per token of context: real text averages 3-6 bytes a token, so 32 leaves
# room for any prompt that can fit and refuses megabytes before they are tokenized.
PROMPT_BYTES_PER_TOKEN = 32


@dataclasses.dataclass(frozen=True)
class ServeOptions:
    served_model_name: str
    api_key: str | None = None  # when set, /v1/* needs `Authorization: Bearer KEY`
    max_queue: int = 256  # waiting requests beyond which new ones get 429
    max_body_bytes: int = 1 << 20
    max_prompt_bytes: int | None = None  # prompt text (UTF-8); None: 32 x the context length
    # A connection must send a request's head (line and headers) this long after it opened or
    # after its last response, else it is closed: slow or stalled clients, idle keep-alive.
    header_timeout_s: float = 60.0
    body_timeout_s: float = 60.0  # once the head is in, the body must follow this fast, else 408
    drain_timeout_s: float = 30.0  # on a stop signal, in-flight requests get this long to finish
    # What the model and budget allow (from the session).
    max_model_len: int = 4096
    vocab_size: int = 32000
    kv_budget_bytes: int = 0
    memory_budget_bytes: int = 0  # weights + KV: what /metrics compares process memory with

    @property
    def prompt_bytes_limit(self) -> int:
        if self.max_prompt_bytes is not None:
            return self.max_prompt_bytes
        return PROMPT_BYTES_PER_TOKEN * self.max_model_len
