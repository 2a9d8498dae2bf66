"""Prompt text for HTTP load: about `prompt_len` tokens per request, built as vLLM's random dataset
builds it (decode seeded random token ids, re-encode, trim to the target count) with the model's
own tokenizer when the model resolves locally. Only the tokenizer is loaded, never the weights.
Without a tokenizer, prompts are seeded random words (about one token each for common
tokenizers) and the server's `usage.prompt_tokens` is the count that matters."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from batchsim.configs import ConfigError
from batchsim.server.engine.run_config import RunConfig
from batchsim.server.models.tokenizer import special_token_ids
from batchsim.workloads.requests import RequestSpec, request_token_ids

_WORDS = ["time", "person", "year", "way", "day", "thing", "man", "world", "life", "hand", "part",
          "child", "eye", "woman", "place", "work", "week", "case", "point", "number", "group",
          "problem", "fact", "house", "water", "story", "room", "night", "light"]
_MAX_ROUNDS = 8


class PromptMaker:
    def __init__(self, tokenizer: Any | None, seed: int, local_path: str | None = None,
                 vocab_size: int | None = None, no_tokenizer_reason: str = ""):
        self.tokenizer = tokenizer
        self.no_tokenizer_reason = no_tokenizer_reason  # why random words, when they are used
        self.seed = seed
        self.local_path = local_path  # the model directory, as mlx_lm.server names its model
        self.vocab_size = vocab_size or (len(tokenizer) if tokenizer is not None else 0)
        self._special = special_token_ids(tokenizer) or frozenset()

    def describe(self) -> str:
        if self.tokenizer is not None:
            return f"tokenizer {self.local_path}"
        reason = self.no_tokenizer_reason
        return f"random words ({reason})" if reason else "random words"

    def make(self, rs: RequestSpec) -> tuple[str, int | None]:
        """(text, its token count by the local tokenizer, or None without one)."""
        if self.tokenizer is None:  # seeded words (shared segments: shared words)
            return " ".join(_WORDS[i] for i in request_token_ids(self.seed, rs, len(_WORDS))), None
        return self._from_ids(rs)

    def _from_ids(self, rs: RequestSpec) -> tuple[str, int]:
        tok, target = self.tokenizer, rs.prompt_len
        ids = [i if i not in self._special else (i + 1) % self.vocab_size
               for i in request_token_ids(self.seed, rs, self.vocab_size)]
        text = tok.decode(ids)
        n = 0
        for _ in range(_MAX_ROUNDS):  # a decode/encode round trip can merge or split tokens
            ids = tok.encode(text, add_special_tokens=False)[:target]
            text = tok.decode(ids)
            n = len(tok.encode(text, add_special_tokens=False))
            if n <= target:
                break
            target -= n - rs.prompt_len
        return text, n


def open_prompt_maker(cfg: RunConfig) -> PromptMaker:
    try:
        path = _tokenizer_dir(cfg)
    except ConfigError as exc:
        return PromptMaker(None, cfg.workload.seed,
                           no_tokenizer_reason=f"no local tokenizer for {cfg.model!r}: {exc}")
    from mlx_lm.tokenizer_utils import load

    return PromptMaker(load(path), cfg.workload.seed, str(path.resolve()))


def _tokenizer_dir(cfg: RunConfig) -> Path:
    """A local directory holding the model's tokenizer: an existing build of a zoo model in any
    dtype, else the model resolved (a zoo model is built on first use)."""
    from batchsim.server.models.build import build_id, cache_root
    from batchsim.server.models.spec import zoo_names

    if cfg.model in zoo_names():
        for dtype in ("float32", "float16", "bfloat16"):
            for bits in (None, 8, 4):
                build = cache_root() / build_id(cfg.model, dtype, bits)
                if (build / "tokenizer.json").is_file():
                    return build
    from batchsim.server.models.loader import resolve
    from batchsim.server.platform import env

    dtype = env.default_dtype() if cfg.dtype == "auto" else cfg.dtype
    return resolve(cfg.model, dtype, cfg.quantize, build=True).path
