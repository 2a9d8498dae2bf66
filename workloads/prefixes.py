"""Prompts that share prefixes, described as segments: a shared system prompt, a chat session's
earlier turns and replies, a Mooncake trace's hash_ids blocks.

A segment is (key, num_tokens); its tokens are the first num_tokens of a seeded stream named by
the key, so equal keys give equal tokens (a shorter segment, a prefix of the longer). Both paths
get the same blocks from the segments: the real executor the prompt's token ids
(`segment_token_ids`, hashed from its tokens by scheduler/prefix_cache.py), the simulator, which
has no ids, one key per PAGE_TOKENS block naming the segment pieces it holds (`block_keys`):
two blocks get equal keys exactly when they hold the same tokens (seeded-random collisions aside).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import NamedTuple

import numpy as np
from batchsim.configs import ConfigError
from batchsim.scheduler.pool_geometry import PAGE_TOKENS
from batchsim.scheduler.prefix_cache import chain_block_hashes
from batchsim.workloads.traces import MOONCAKE_BLOCK_TOKENS

# The first element of a segment key: what the segment is.
SYSTEM, USER, REPLY, TRACE_BLOCK, TRACE_TAIL = range(1, 6)
_STREAM_TAG = 0x5E6  # seeds segment streams apart from prompt_token_ids' [seed, index]


class Segment(NamedTuple):
    key: tuple[int, ...]  # non-negative ints: equal keys, equal tokens
    num_tokens: int


@dataclasses.dataclass(frozen=True)
class SharingSpec:
    """Prompts that share prefixes (`sharing:` in a workload YAML). Every prompt starts with the
    same system prompt; with turns > 1 requests form chat sessions in which turn k resends the
    session's turns 1..k-1 and their replies, then a new user message. input_len is then the new
    user tokens of a turn, output_len its reply."""

    system_tokens: int = 0  # tokens of the system prompt every request starts with
    turns: int = 1  # turns per chat session (1: independent requests)
    sessions: int = 1  # sessions interleaved: turn k of each of them, then turn k + 1

    def __post_init__(self) -> None:
        for key, low in (("system_tokens", 0), ("turns", 1), ("sessions", 1)):
            value = getattr(self, key)
            if type(value) is not int or value < low:
                raise ConfigError(f"sharing.{key}: must be an integer >= {low}, got {value!r}")
        if self.system_tokens == 0 and self.turns == 1:
            raise ConfigError("sharing: shares nothing (set system_tokens > 0 or turns > 1)")


def session_turn(index: int, sharing: SharingSpec) -> tuple[int, int]:
    """(session, turn) of request `index`: groups of `sessions` sessions, turn by turn."""
    group, j = divmod(index, sharing.sessions * sharing.turns)
    return group * sharing.sessions + j % sharing.sessions, j // sharing.sessions


def turn_index(session: int, turn: int, sharing: SharingSpec) -> int:
    """The request index of a session's turn (session_turn's inverse)."""
    group, s = divmod(session, sharing.sessions)
    return (group * sharing.turns + turn) * sharing.sessions + s


def session_segments(sharing: SharingSpec, seed: int, index: int,
                     lengths: Sequence[tuple[int, int]]) -> tuple[Segment, ...]:
    """Request `index`'s prompt: the system prompt, the session's earlier turns (user message and
    reply each), its own user message. lengths[i]: request i's (new user tokens, reply tokens)."""
    session, turn = session_turn(index, sharing)
    segments = [Segment((SYSTEM, seed), sharing.system_tokens)] if sharing.system_tokens else []
    for k in range(turn):
        user_tokens, reply_tokens = lengths[turn_index(session, k, sharing)]
        segments += [Segment((USER, seed, session, k), user_tokens),
                     Segment((REPLY, seed, session, k), reply_tokens)]
    segments.append(Segment((USER, seed, session, turn), lengths[index][0]))
    return tuple(segments)


def trace_segments(hash_ids: Sequence[int], row: int, prompt_len: int,
                   input_scale: float) -> tuple[Segment, ...]:
    """A trace row's prompt from its hash_ids: the row's prompt_len tokens cut in blocks of
    512 x input_scale rounded to whole cache blocks (so a scaled replay shares whole blocks too),
    block k named by hash_ids[k]; blocks past its ids are the row's own."""
    if not hash_ids:
        return ()
    block = PAGE_TOKENS * max(1, round(MOONCAKE_BLOCK_TOKENS * input_scale / PAGE_TOKENS))
    segments = []
    for k, start in enumerate(range(0, prompt_len, block)):
        key = (TRACE_BLOCK, hash_ids[k]) if k < len(hash_ids) else (TRACE_TAIL, row, k)
        segments.append(Segment(key, min(block, prompt_len - start)))
    return tuple(segments)


def segment_token_ids(segments: Sequence[Segment], vocab_size: int) -> list[int]:
    """The prompt's token ids: each segment's seeded stream, concatenated."""
    if vocab_size < 1:
        raise ConfigError(f"vocab_size must be >= 1, got {vocab_size}")
    ids: list[int] = []
    for key, n in segments:
        ids += np.random.default_rng([_STREAM_TAG, *key]).integers(0, vocab_size, n).tolist()
    return ids


def block_keys(segments: Sequence[Segment],
               page_tokens: int = PAGE_TOKENS,
               ) -> list[tuple[tuple[tuple[int, ...], int, int], ...]]:
    """One key per full block of the prompt: the (segment key, start, end) pieces it holds."""
    keys, pieces, filled = [], [], 0
    for key, n in segments:
        start = 0
        while start < n:
            take = min(page_tokens - filled, n - start)
            pieces.append((key, start, start + take))
            filled, start = filled + take, start + take
            if filled == page_tokens:
                keys.append(tuple(pieces))
                pieces, filled = [], 0
    return keys


def segment_block_hashes(segments: Sequence[Segment]) -> tuple[int, ...]:
    """The prompt's chained block hashes without its tokens (the simulator's)."""
    return chain_block_hashes(block_keys(segments))


def sharing_with(sharing: SharingSpec | None, **given: int | None) -> SharingSpec | None:
    """`sharing` with the flags given (None: not given) applied; None when the result shares
    nothing (e.g. --shared-prefix-tokens 0 on a workload without turns)."""
    given = {k: v for k, v in given.items() if v is not None}
    if not given:
        return sharing
    base = dataclasses.asdict(sharing) if sharing else {
        f.name: f.default for f in dataclasses.fields(SharingSpec)}
    merged = {**base, **given}
    if merged["system_tokens"] == 0 and merged["turns"] == 1:
        return None
    return SharingSpec(**merged)
