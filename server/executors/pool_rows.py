"""The decode pool's layout as plain bookkeeping: which request holds which row, the pool's
geometry, and what each change copies. The real pool (decode_pool.DecodePool) applies these moves
to MLX arrays; the simulator (sim_executor) prices them. One model for both, and no mlx here.

Rows [0, B) are occupied. A join takes row B. Leaves move the last surviving rows into the holes
below the new row count, so rows stay dense without copying the whole pool. A resize keeps rows
[0, B) and their tokens. Paged, full-attention and MLA layers stay in their blocks: only the
per-row part (CacheLayout.per_row) moves."""

from __future__ import annotations

from collections.abc import Collection
from typing import NamedTuple

from batchsim.scheduler.kv_bytes import CacheLayout
from batchsim.scheduler.plan import made
from batchsim.scheduler.pool_geometry import EMPTY_PAGED_POOL, EMPTY_POOL, PoolGeometry


class RowMoves(NamedTuple):
    """What a leave copies: row movers[i] moves into row holes[i]."""

    holes: list[int]  # rows below the new row count whose requests left
    movers: list[int]  # surviving rows above it, in order
    moved_bytes: int  # bytes of the moving rows (whole rows, padding included)


NO_MOVES = RowMoves([], [], 0)


class Resize(NamedTuple):
    """What a geometry change copies."""

    old: PoolGeometry
    new: PoolGeometry
    kept_bytes: int  # the old pool's overlap with the new one, copied over (0 from or to empty)
    new_bytes: int  # the new pool's size; all but kept_bytes are written as zeros
    # Paged, the block count unchanged: the block arrays stay as they are (DecodePool.resize
    # leaves them), neither copied nor written; part of kept_bytes.
    untouched_bytes: int = 0


class PoolLayout:
    def __init__(self, cache: CacheLayout, paged: bool = False):
        self.cache = cache  # what a row holds, by layer kind
        self.paged = paged
        self.geometry = EMPTY_PAGED_POOL if paged else EMPTY_POOL
        self.row_ids: list[int] = []  # request id per occupied row, rows [0, B)
        self.in_pool: set[int] = set()  # the same ids, for membership tests
        self._row_bytes = 0  # one row of the geometry (what a leave moves per row)

    def __len__(self) -> int:
        return len(self.row_ids)

    def leave(self, request_ids: Collection[int]) -> RowMoves:
        """Drop these requests' rows (ids not in the pool are ignored); the last surviving rows
        fill the holes below the new row count."""
        leaving = self.in_pool.intersection(request_ids)
        if not leaving:
            return NO_MOVES
        self.in_pool -= leaving
        rows = self.row_ids
        keep = len(rows) - len(leaving)
        if keep == len(rows) - 1:  # one row (most steps): the last row fills its hole
            i = rows.index(next(iter(leaving)))
            last = rows.pop()
            holes, movers = ([i], [keep]) if i < keep else ([], [])
            if holes:
                rows[i] = last
        else:
            # The leaving rows, found by index (a few among many): holes below keep, gaps above.
            at = sorted(map(rows.index, leaving))
            holes = [i for i in at if i < keep]
            movers = [i for i in range(keep, len(rows)) if i not in at]
            for h, m in zip(holes, movers):
                rows[h] = rows[m]
            del rows[keep:]
        # every field, in order (plan.made: a leave most plans)
        return made(RowMoves, (holes, movers, len(movers) * self._row_bytes))

    def join(self, request_id: int, num_tokens: int) -> int:
        """Give a prefilled request of `num_tokens` the next row; returns the row. The copy is
        its tokens only: cache.seq_bytes(num_tokens)."""
        row = len(self.row_ids)
        if row >= self.geometry.rows or num_tokens > self.geometry.capacity_tokens:
            raise RuntimeError(
                f"pool {self.geometry} has no room for request {request_id} ({num_tokens} tokens)"
            )
        self.row_ids.append(request_id)
        self.in_pool.add(request_id)
        return row

    def resize(self, geometry: PoolGeometry) -> Resize:
        """Take the scheduler's new geometry, keeping rows [0, B)."""
        old = self.geometry
        if geometry.rows < len(self.row_ids):
            raise RuntimeError(f"geometry {geometry} cannot hold the pool's {len(self)} rows")
        self.geometry = geometry
        cache = self.cache
        row = cache.per_row if self.paged else cache
        self._row_bytes = row.seq_bytes(geometry.capacity_tokens)
        kept = 0
        if (old.rows or old.blocks) and (geometry.rows or geometry.blocks):
            blocks = None if old.blocks is None else min(old.blocks, geometry.blocks or 0)
            kept = cache.pool_bytes(PoolGeometry(min(old.rows, geometry.rows), min(
                old.capacity_tokens, geometry.capacity_tokens), blocks))
        same_blocks = kept and geometry.blocks and old.blocks == geometry.blocks
        untouched = geometry.blocks * cache.block_bytes if same_blocks else 0
        return Resize(old, geometry, kept, cache.pool_bytes(geometry), untouched)

    @property
    def kv_bytes_per_token(self) -> int:
        """What each further token adds to a row (full-attention and MLA layers)."""
        return self.cache.full_token_bytes

    def clear(self) -> None:
        self.geometry = EMPTY_PAGED_POOL if self.paged else EMPTY_POOL
        self.row_ids, self.in_pool = [], set()
        self._row_bytes = 0
