"""Speculative decoding's pieces in the MLX executor: the drafters and the greedy acceptance rule.

A verify step feeds each decoding row its last token and up to k drafted tokens in one forward
pass (rows with fewer drafts are padded; their extra positions are written and never kept). Which
drafts a row keeps, and its token after them, is acceptance.py's: greedy output is the tokens plain
decoding would produce, sampled output has the distribution plain sampling has."""

from __future__ import annotations

from typing import NamedTuple, Protocol

import mlx.core as mx
import numpy as np
from batchsim.scheduler.kv_bytes import CacheLayout
from batchsim.scheduler.pool_geometry import PoolGeometry
from batchsim.server.executors.sampler import History

# vLLM's prompt_lookup_min / prompt_lookup_max: the n-gram lengths the n-gram drafter matches.
NGRAM_MIN = 2
NGRAM_MAX = 5


class Draft(NamedTuple):
    """One row's proposal for a verify step."""

    tokens: list[int]  # up to k drafted tokens
    # (len(tokens), V) the distributions they were drawn from (q of the rejection rule); None:
    # chosen outright (n-gram lookup, greedy drafting): q is one-hot at each token.
    probs: mx.array | None = None


class Drafter(Protocol):
    def propose(self, rids: list[int], seqs: list[History], ks: list[int]) -> list[Draft]:
        """Per row, up to ks[i] tokens to follow seqs[i].token_ids (prompt + output so far), for
        a row that samples as seqs[i].sampling asks; all rows of a step in one call."""
        ...

    def forget(self, request_id: int) -> None:
        """The request left: drop what is held for it."""
        ...

    def resize(self, geometry: PoolGeometry) -> None:
        """The target's pool takes `geometry` this step (a draft model's pool follows it)."""
        ...

    @property
    def cache(self) -> CacheLayout | None:
        """What the drafter holds per pool row (CacheLayout.draft); None: nothing."""
        ...

    @property
    def nbytes(self) -> int:
        """Bytes the drafter's cache holds now (the executor's KV account)."""
        ...


def ngram_proposal(token_ids: list[int], k: int, min_n: int = NGRAM_MIN,
                   max_n: int = NGRAM_MAX) -> list[int]:
    """Prompt lookup as vLLM's NgramProposer: the longest n in [min_n, max_n] whose last n tokens
    occur earlier in `token_ids`; at its earliest occurrence, the up to k tokens that follow."""
    total = len(token_ids)
    if k <= 0 or total < min_n + 1:
        return []
    tokens = np.asarray(token_ids)
    for n in range(min(max_n, total - 1), min_n - 1, -1):
        windows = np.lib.stride_tricks.sliding_window_view(tokens[:-1], n)
        hits = np.flatnonzero((windows == tokens[-n:]).all(axis=1))
        if hits.size:
            start = int(hits[0]) + n
            return token_ids[start : start + k]
    return []


class NgramDrafter:
    """Drafts from the request's own prompt and output: no second model."""

    def __init__(self, min_n: int = NGRAM_MIN, max_n: int = NGRAM_MAX):
        if not 1 <= min_n <= max_n:
            raise ValueError(f"n-gram lengths must satisfy 1 <= min <= max, got {min_n}, {max_n}")
        self.min_n, self.max_n = min_n, max_n

    def propose(self, rids: list[int], seqs: list[History], ks: list[int]) -> list[Draft]:
        return [Draft(ngram_proposal(s.token_ids, k, self.min_n, self.max_n))
                for s, k in zip(seqs, ks)]

    def forget(self, request_id: int) -> None:
        pass

    def resize(self, geometry: PoolGeometry) -> None:
        pass

    cache = None  # no cache of its own
    nbytes = 0


def num_accepted(drafts: list[int], greedy: list[int]) -> int:
    """How many drafts, from the first, equal the model's argmax at their position (greedy[i] is
    the argmax after the row's last token and drafts[:i])."""
    n = 0
    for d, g in zip(drafts, greedy):
        if d != g:
            break
        n += 1
    return n


class Verified(NamedTuple):
    """What a verify step produced for the pool's rows."""

    tokens: mx.array  # (B,) each row's sampled token (after its accepted drafts)
    accepted: dict[int, list[int]]  # request id -> drafts it kept
    drafted: dict[int, int]  # request id -> drafts it verified

    def result_fields(self, sampled_ids: list[int]) -> dict:
        """StepResult's accepted_ids and num_drafted, aligned with its sampled_ids."""
        if not self.drafted:
            return {}
        return {"accepted_ids": tuple(tuple(self.accepted.get(r, ())) for r in sampled_ids),
                "num_drafted": tuple(self.drafted.get(r, 0) for r in sampled_ids)}
