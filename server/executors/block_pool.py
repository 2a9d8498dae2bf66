"""The paged decode pool's blocks as plain bookkeeping (no mlx): which of `num_blocks` blocks are
free, how many references each has (rows' tables and the prefix cache: a cached block shared by
rows is one block), each row's block table, and the prefix cache's block per hash. The arrays
themselves live in paged_store.PagedKVStore."""

from __future__ import annotations

from batchsim.scheduler.pool_geometry import row_blocks


class BlockPool:
    def __init__(self) -> None:
        self.refcount: list[int] = []  # per block; 0: free
        self._free: list[int] = []  # free block ids, the lowest last (popped first)
        self.tables: list[list[int]] = []  # per pool row, its blocks in token order
        self.cached: dict[int, int] = {}  # prefix-cache block hash -> block (one reference)

    @property
    def num_blocks(self) -> int:
        return len(self.refcount)

    @property
    def num_free(self) -> int:
        return len(self._free)

    # -- blocks --------------------------------------------------------------------------------
    def allocate(self, n: int) -> list[int]:
        """n free blocks, each referenced once."""
        if n > len(self._free):
            raise RuntimeError(f"paged pool: {n} blocks asked, {len(self._free)} free")
        out = [self._free.pop() for _ in range(n)]
        for b in out:
            self.refcount[b] = 1
        return out

    def incref(self, blocks: list[int]) -> None:
        for b in blocks:
            if self.refcount[b] <= 0:
                raise RuntimeError(f"paged pool: block {b} is free")
            self.refcount[b] += 1

    def decref(self, blocks: list[int]) -> None:
        """Drop one reference each; a block nobody references is free again."""
        for b in blocks:
            self.refcount[b] -= 1
            if self.refcount[b] == 0:
                self._free.append(b)
            elif self.refcount[b] < 0:
                raise RuntimeError(f"paged pool: block {b} freed twice")

    def resize(self, num_blocks: int) -> tuple[list[int], list[int]]:
        """Hold `num_blocks` blocks; used blocks at or above it move into free ones below it.
        Returns (sources, destinations) of those moves, for the arrays; tables are remapped."""
        old = self.num_blocks
        used_above = [b for b in range(num_blocks, old) if self.refcount[b]]
        free_below = sorted(b for b in self._free if b < num_blocks)
        if len(used_above) > len(free_below):
            raise RuntimeError(f"paged pool: {old - self.num_free} blocks in use > {num_blocks}")
        dst = free_below[: len(used_above)]
        where = dict(zip(used_above, dst))
        if where:
            self.tables = [[where.get(b, b) for b in t] for t in self.tables]
            self.cached = {h: where.get(b, b) for h, b in self.cached.items()}
        refs = self.refcount[:num_blocks] + [0] * max(0, num_blocks - old)
        for s, d in where.items():
            refs[d] = self.refcount[s]
        self.refcount = refs
        self._free = [b for b in range(num_blocks - 1, -1, -1) if not refs[b]]
        return used_above, dst

    # -- the prefix cache's blocks ------------------------------------------------------------
    def cache(self, block_hash: int, block: int) -> None:
        """The prefix cache keeps `block` (a row's, already written) as `block_hash`."""
        self.incref([block])
        self.cached[block_hash] = block

    def cache_new(self, block_hash: int) -> int:
        """A free block the prefix cache keeps as `block_hash` (its one reference), to be
        written; returns it."""
        block = self.cached[block_hash] = self.allocate(1)[0]
        return block

    def uncache(self, block_hash: int) -> None:
        """The prefix cache drops a block: free once no row references it."""
        self.decref([self.cached.pop(block_hash)])

    # -- rows ----------------------------------------------------------------------------------
    def add_row(self, tokens: int, shared: list[int] | None = None) -> list[int]:
        """A new last row holding `tokens`, its first blocks `shared` (referenced, not copied);
        returns its table."""
        shared = shared or []
        self.incref(shared)
        table = shared + self.allocate(row_blocks(tokens) - len(shared))
        self.tables.append(table)
        return table

    def fit_row(self, row: int, tokens: int) -> bool:
        """Row `row` holds exactly row_blocks(tokens) (more allocated, extras freed); True if its
        table changed."""
        table, need = self.tables[row], row_blocks(tokens)
        if len(table) == need:
            return False
        if len(table) < need:
            table += self.allocate(need - len(table))
        else:
            self.decref(table[need:])
            del table[need:]
        return True

    def remove_rows(self, leaving: list[int], holes: list[int], movers: list[int]) -> None:
        """Rows `leaving` free their blocks; row movers[i] takes hole holes[i] (pool_rows.leave);
        the table keeps its first len - len(leaving) rows."""
        for r in leaving:
            self.decref(self.tables[r])
        for h, m in zip(holes, movers):
            self.tables[h] = self.tables[m]
        del self.tables[len(self.tables) - len(leaving):]
