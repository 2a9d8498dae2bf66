"""What a model's KV cache holds, by layer kind, as pure arithmetic (the scheduler's budget, the
executors' account and their copy prices all ask this one object):
- full-attention and MLA layers grow with the context: a pool row holds `capacity` tokens, a
  private mlx-lm KVCache round_up(tokens, KV_STEP) (prefill chunks are KV_STEP-aligned);
- sliding-window layers: a pool row holds min(capacity, W) tokens (a batched rotating buffer
  capped at its window); a private RotatingKVCache keeps each multi-token chunk whole after
  trimming what it held to W - 1 (server/models/arch_cache._rotating_rows);
- linear-attention layers hold a fixed state per sequence, whatever its length.
A dense model's layout is one number, bytes per token, and gives exactly the scalar arithmetic.
Speculative decoding by a draft model (`draft`): the draft model's own cache is one padded row
per pool row at the pool's capacity (draft_model.py mirrors the target's geometry), so a pool row
costs the target's bytes plus the draft's; private prefill caches and prefix blocks are the
target's alone (the drafter prefills a row's context when it first drafts, and keeps no blocks).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import NamedTuple

from batchsim.scheduler.plan import made
from batchsim.scheduler.pool_geometry import KV_STEP, PAGE_TOKENS, PoolGeometry


class PrivateCache(NamedTuple):
    """A prefilling request's private cache after its last chunk [chunk_start, computed_tokens)."""

    chunk_start: int  # tokens the cache held before its last chunk
    computed_tokens: int  # tokens it holds now
    kv_bytes: int  # bytes it holds now (CacheLayout.private_bytes of the two)


class RowPart(NamedTuple):
    """A CacheLayout less its full-attention and MLA layers (a row of the paged pool)."""

    cache: CacheLayout

    def seq_bytes(self, tokens: int) -> int:
        return self.cache.seq_bytes(tokens) - tokens * self.cache.full_token_bytes


@dataclasses.dataclass(frozen=True)
class CacheLayout:
    # Bytes per token of the layers whose cache grows with the context (full attention, MLA).
    full_token_bytes: int
    # (window W in tokens, bytes per token of all sliding layers with that window), by window.
    sliding: tuple[tuple[int, int], ...] = ()
    # Bytes per sequence of the linear-attention layers' fixed state (conv + recurrent).
    state_bytes: int = 0
    # The draft model's cache beside each pool row (speculative decoding; None: no draft model).
    draft: CacheLayout | None = None

    def __post_init__(self) -> None:
        if min(self.full_token_bytes, self.state_bytes) < 0 or any(
                w < 1 or b <= 0 for w, b in self.sliding):
            raise ValueError(f"cache layout has a negative size or an empty window: {self}")
        if not (self.full_token_bytes or self.sliding or self.state_bytes):
            raise ValueError("cache layout holds no bytes")
        if self.draft is not None and self.draft.draft is not None:
            raise ValueError("a draft model's cache layout has no draft of its own")

    @classmethod
    def dense(cls, kv_bytes_per_token: int) -> CacheLayout:
        return cls(kv_bytes_per_token)

    def with_draft(self, draft: CacheLayout | None) -> CacheLayout:
        """This layout with a draft model's cache beside each pool row (None: as it is)."""
        return self if draft is None else dataclasses.replace(self, draft=draft)

    @property
    def is_dense(self) -> bool:
        """One number prices it all: every layer full attention or MLA, and no draft model."""
        return self.all_full and self.draft is None

    @property
    def all_full(self) -> bool:
        """Every layer of the target is full attention or MLA (a draft model's aside)."""
        return not self.sliding and not self.state_bytes

    def seq_bytes(self, tokens: int) -> int:
        """One pool row of `tokens` capacity, or one sequence's `tokens` copied into a row (with
        a draft model, its row of the same capacity too)."""
        b = tokens * self.full_token_bytes + self.state_bytes
        for window, token_bytes in self.sliding:
            b += (min(window, tokens)) * token_bytes
        if self.draft is not None:
            b += self.draft.seq_bytes(tokens)
        return b

    def pool_bytes(self, pool: PoolGeometry) -> int:
        rows, capacity, blocks = pool
        if blocks is None:
            return rows * self.seq_bytes(capacity) if rows else 0
        # paged: blocks may outlive the rows (the prefix cache's)
        return (rows * self.per_row.seq_bytes(capacity) if rows else 0) + blocks * self.block_bytes

    @property
    def block_bytes(self) -> int:
        """One paged block: PAGE_TOKENS tokens of every full-attention and MLA layer."""
        return PAGE_TOKENS * self.full_token_bytes

    @functools.cached_property
    def per_row(self) -> RowPart:
        """What a paged pool still holds per row: the sliding rings and linear states."""
        return RowPart(self)

    def private_bytes(self, chunk_start: int, computed_tokens: int) -> int:
        """A private prefill cache after chunks ending with [chunk_start, computed_tokens); every
        chunk before the last is KV_STEP-aligned and every chunk has more than one token."""
        if computed_tokens <= 0:
            return 0
        b = -(-computed_tokens // KV_STEP) * KV_STEP * self.full_token_bytes + self.state_bytes
        if self.sliding:
            chunk = computed_tokens - chunk_start
            for window, token_bytes in self.sliding:
                held = min(window - 1, chunk_start)
                b += (chunk + held) * token_bytes
        return b

    def private(self, chunk_start: int, computed_tokens: int) -> PrivateCache:
        return made(PrivateCache, (  # every field, in order (plan.made)
            chunk_start, computed_tokens, self.private_bytes(chunk_start, computed_tokens)))

    def alone_bytes(self, total_tokens: int) -> int:
        """The most one request of `total_tokens` may need with nothing else running: its pool row
        at full length, or its private cache after a last KV_STEP chunk (sliding layers hold the
        chunk plus W - 1). A request over the budget here can never run. Not remembered here:
        Scheduler.add_request remembers the totals that passed (asked once per total)."""
        capacity = -(-total_tokens // KV_STEP) * KV_STEP
        chunk = min(KV_STEP, total_tokens)
        return max(self.seq_bytes(capacity), self.private_bytes(total_tokens - chunk, total_tokens))
