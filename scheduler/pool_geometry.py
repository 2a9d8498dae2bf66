"""The decode pool's geometry (rows x capacity tokens) and how it grows, as pure arithmetic shared
by the scheduler (admission), the executors (allocation) and `size` (per-Mac limits).

batchsim's real executor holds two kinds of KV:
- a *pool* for decoding requests: per layer arrays with one row per request (full attention:
  K and V of shape (rows, kv_heads, capacity, head_dim); what each layer kind holds per row is
  kv_bytes.CacheLayout). Every row is padded to `capacity`, which grows in
  `KV_STEP`-token steps (mlx-lm's cache step) to cover the longest running sequence. Rows are
  added in powers of two up to `row_step`, then in multiples of it, so a join usually lands in a
  spare row instead of copying the whole pool.
- a *private* mlx-lm KVCache per request while its prompt is prefilled, grown by mlx-lm in
  KV_STEP-token steps (prefill chunks are multiples of KV_STEP, so it holds round_up(tokens)).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import NamedTuple, Protocol

KV_STEP = 256  # mlx-lm's KVCache.step / BatchKVCache.step
PAGE_TOKENS = 16  # a typical paged-attention block (vLLM, vllm-mlx)


def round_up(x: int, multiple: int) -> int:
    return -(-x // multiple) * multiple


def kv_steps(max_len: int) -> int:
    """KV_STEPs a padded pool row holds for rows of at most `max_len` tokens (at least one): all
    next_geometry reads of max_len (kv_manager's memo keys on (max_len - 1) // KV_STEP, which
    determines it)."""
    return -(-max_len // KV_STEP) if max_len > 1 else 1


def round_down(x: int, multiple: int) -> int:
    return x // multiple * multiple


class PoolGeometry(NamedTuple):  # a named tuple: built several times per step
    rows: int  # allocated rows (>= requests in the pool)
    capacity_tokens: int  # tokens per row, a multiple of KV_STEP
    # Paged layout: PAGE_TOKENS-token blocks in each full/MLA layer's block pool (those layers
    # then hold no per-row K/V); None: the padded layout.
    blocks: int | None = None

    def nbytes(self, kv_bytes_per_token: int) -> int:
        return self.rows * self.capacity_tokens * kv_bytes_per_token


EMPTY_POOL = PoolGeometry(0, 0)
EMPTY_PAGED_POOL = PoolGeometry(0, 0, 0)


class RowPricer(Protocol):
    """What a pool row costs (cache_layout.CacheLayout, by layer kind)."""

    def seq_bytes(self, tokens: int) -> int:
        """Bytes of one row of `tokens` capacity."""
        ...


class PagedPricer(Protocol):
    """What a paged pool costs (kv_bytes.CacheLayout): a block, and a row's other layers."""

    @property
    def block_bytes(self) -> int:
        """One block of every full-attention and MLA layer."""
        ...

    @property
    def per_row(self) -> RowPricer:
        """A row's sliding rings and linear states, at a given capacity."""
        ...


def rows_for(num_seqs: int, row_step: int, max_rows: int) -> int:
    """Rows to allocate for `num_seqs` requests: 1, 2, 4, ... below row_step, then multiples of
    it."""
    if num_seqs <= 0:
        return 0
    if num_seqs < row_step:
        rows = 1 << (num_seqs - 1).bit_length()  # the next power of two
    else:
        rows = round_up(num_seqs, row_step)
    return max(num_seqs, min(rows, max_rows))


def next_geometry(
    current: PoolGeometry,
    num_seqs: int,
    max_len: int,
    row_step: int,
    max_rows: int,
    max_bytes: int,
    cache: RowPricer,
) -> PoolGeometry | None:
    """The pool geometry after a step in which `num_seqs` rows hold at most `max_len` tokens.

    Grows when needed; shrinks when a whole row step or KV step (twice, for rows) is idle, so a
    batch size or length hovering at a boundary does not copy the pool every step. When the
    preferred geometry does not fit `max_bytes`, the tightest one that does is used. None: nothing
    that holds these rows fits. `cache` prices a row of a given capacity.
    """
    if num_seqs == 0:
        return EMPTY_POOL if max_bytes >= 0 else None
    need_cap = kv_steps(max_len) * KV_STEP
    rows, cap = current[0], current[1]
    # rows_for(n) >= n, so a pool under n + 2 row steps is never shrunk (skips the call).
    if rows < num_seqs or (rows >= num_seqs + 2 * row_step
                           and rows >= rows_for(num_seqs, row_step, max_rows) + 2 * row_step):
        rows = rows_for(num_seqs, row_step, max_rows)
    if cap < need_cap or cap >= need_cap + 2 * KV_STEP:
        cap = need_cap
    if rows * cache.seq_bytes(cap) <= max_bytes:
        # Most steps keep the pool as it is: no new object (this runs several times per step).
        same = rows == current.rows and cap == current.capacity_tokens
        return current if same else PoolGeometry(rows, cap)
    row_bytes = cache.seq_bytes(need_cap)
    if num_seqs * row_bytes > max_bytes:
        return None
    # Keep as many spare rows as fit.
    fit_rows = max_bytes // row_bytes
    return PoolGeometry(min(max(num_seqs, fit_rows), max(rows, num_seqs)), need_cap)


def row_blocks(tokens: int) -> int:
    """Blocks a row of `tokens` holds in the paged layout."""
    return -(-tokens // PAGE_TOKENS)


def block_slack(need_blocks: int) -> int:
    """Spare blocks a paged pool grows by beyond what its rows need, so it is not reallocated
    every few steps: a quarter of the need, at least one KV_STEP's worth."""
    return max(KV_STEP // PAGE_TOKENS, need_blocks // 4)


def cache_headroom(fit_blocks: int) -> int:
    """Blocks a paged pool at the budget leaves free when the prefix cache must shrink it, so the
    next steps' prefill caches fit beside it without a resize: 1/16 of what fits, at least one
    KV_STEP's worth."""
    return max(KV_STEP // PAGE_TOKENS, fit_blocks // 16)


def next_paged_geometry(
    current: PoolGeometry,
    num_seqs: int,
    max_len: int,
    need_blocks: int,
    row_step: int,
    max_rows: int,
    max_bytes: int,
    cache: PagedPricer,
) -> PoolGeometry | None:
    """next_geometry for the paged layout: the rows (sliding rings, linear states) as there, and
    a block pool holding `need_blocks` plus block_slack, grown or shrunk (at twice the slack
    idle) only then. When that does not fit `max_bytes`, exactly `need_blocks`; None: no fit.
    Blocks without rows are the prefix cache's."""
    if num_seqs == 0 and not need_blocks:
        return EMPTY_PAGED_POOL if max_bytes >= 0 else None
    blocks = current.blocks or 0
    slack = block_slack(need_blocks)
    if blocks < need_blocks or blocks > need_blocks + 2 * slack:
        blocks = need_blocks + slack
    rows_only = PoolGeometry(current.rows, current.capacity_tokens)
    geom = None
    for n in (blocks, need_blocks):
        room = max_bytes - n * cache.block_bytes
        if room >= 0:
            geom = next_geometry(rows_only, num_seqs, max_len, row_step, max_rows, room,
                                 cache.per_row)
        if geom is not None:
            blocks = n
            break
    if geom is None:
        return None
    same = geom[:2] == current[:2] and blocks == current.blocks
    return current if same else PoolGeometry(geom.rows, geom.capacity_tokens, blocks)


def private_cache_tokens(computed_tokens: int) -> int:
    """Tokens an mlx-lm KVCache holds after prefilling `computed_tokens` in KV_STEP-aligned
    chunks."""
    return round_up(computed_tokens, KV_STEP)


def padded_batch_bytes(lengths: Iterable[int], kv_bytes_per_token: int) -> int:
    """A batch cache that pads every row to the longest, grown in KV_STEP steps (mlx-lm's
    BatchKVCache, batchsim's pool with no spare rows)."""
    lengths = list(lengths)
    if not lengths:
        return 0
    return len(lengths) * round_up(max(lengths), KV_STEP) * kv_bytes_per_token


def paged_bytes(lengths: Iterable[int], kv_bytes_per_token: int,
                page_tokens: int = PAGE_TOKENS) -> int:
    """Fixed-size pages with no padding between sequences (vLLM, vllm-mlx)."""
    return sum(round_up(n, page_tokens) for n in lengths) * kv_bytes_per_token
