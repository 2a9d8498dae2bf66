"""What both decode pools (kv_pool.DecodePool, family_pool.FamilyPool) share: rows of decoding
requests kept by pool_layout.PoolLayout (joins take the next row, leaves move the last rows into
the holes), tokens cached per row, and a reallocation only when the scheduler changes the
geometry. A subclass says which arrays hold the rows, how one request is written into a row, and
how its arrays take a new geometry."""

from __future__ import annotations

import mlx.core as mx
from batchsim.scheduler.kv_layout import PoolGeometry
from batchsim.server.executors.pool_layout import PoolLayout, Resize


class RowPool:
    def __init__(self, layout: PoolLayout):
        self.layout = layout
        self.lengths: list[int] = []  # tokens cached per row, aligned with layout.row_ids

    def __len__(self) -> int:
        return len(self.layout.row_ids)

    @property
    def row_ids(self) -> list[int]:
        return self.layout.row_ids

    @property
    def geometry(self) -> PoolGeometry:
        return self.layout.geometry

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes for a in self.arrays())

    def arrays(self) -> list[mx.array]:
        """Every array whose first axis is the row."""
        raise NotImplementedError

    # -- membership ----------------------------------------------------------------------------
    def remove(self, request_ids: set[int]) -> None:
        """Drop rows; fill holes below the new row count with the surviving rows above it."""
        moves = self.layout.leave(request_ids)
        if moves.holes:
            src, dst = mx.array(moves.movers), mx.array(moves.holes)
            arrays = self.arrays()
            moved = [a[src] for a in arrays]
            mx.eval(moved)  # detach from the pool arrays so the scatter below updates them in place
            for a, m in zip(arrays, moved):
                a[dst] = m
            for h, m in zip(moves.holes, moves.movers):
                self.lengths[h] = self.lengths[m]
        del self.lengths[len(self.layout.row_ids):]

    def add(self, request_id: int, layer_caches: list | None, length: int) -> None:
        """Copy a prefilled request (its private caches, one per layer) into the next row."""
        row = self.layout.join(request_id, length)
        if layer_caches is not None and length:
            self._write_row(row, layer_caches, length)
        self.lengths.append(length)

    def _write_row(self, row: int, layer_caches: list, length: int) -> None:
        raise NotImplementedError

    # -- a decode step undone (lookahead.py) ---------------------------------------------------
    def states(self) -> list:
        """What a decode step replaces rather than writes past the rows' lengths."""
        return []

    def _restore_states(self, states: list) -> None:
        pass

    def undo_step(self, lengths: list[int], states: list, joined: list[int]) -> None:
        """Back to before a decode step that joined `joined` as the last rows: lengths, states."""
        self.lengths = list(lengths)
        self._restore_states(states)
        self.remove(set(joined))

    # -- geometry ------------------------------------------------------------------------------
    def resize(self, geometry: PoolGeometry) -> None:
        """Reallocate to the scheduler's geometry, keeping rows [0, B) and their tokens."""
        if geometry == self.layout.geometry:
            return
        if self.lengths and geometry.capacity_tokens < max(self.lengths):
            raise RuntimeError(f"geometry {geometry} cannot hold the pool's rows")
        self._reallocate(self.layout.resize(geometry))
        mx.eval(self.arrays())

    def _reallocate(self, change: Resize) -> None:
        raise NotImplementedError
