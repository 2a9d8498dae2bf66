"""The HTTP server's options and their defaults (read by `batchsim serve`'s flags too). A module of
its own, without aiohttp, so the CLI builds its parser without importing the server."""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class ServeOptions:
    served_model_name: str
    api_key: str | None = None  # when set, /v1/* needs `Authorization: Bearer KEY`
    max_queue: int = 256  # waiting requests beyond which new ones get 429
    max_body_bytes: int = 1 << 20
    drain_timeout_s: float = 30.0  # on SIGINT/SIGTERM, in-flight requests get this long to finish
    # What the model and budget allow (from the session).
    max_model_len: int = 4096
    vocab_size: int = 32000
    kv_budget_bytes: int = 0
