"""The scheduler's account of KV memory, mirroring what the executor allocates: one pool for
decoding requests (padded rows, or paged: full-attention and MLA layers in PAGE_TOKENS-token blocks,
a row holding row_blocks(tokens) of them), a private cache per prefilling request, priced by the
model's CacheLayout, and the prefix cache's blocks (evicted when a plan needs their bytes). Paged,
cached blocks are pool blocks shared by reference: a row's own blocks are row_blocks(tokens) less
the cached ones it references (own_blocks), and each cached block is counted once.
Allocator verbs in the nano-vllm style: `can_*` asks, `commit` applies a plan, `release` frees."""

from __future__ import annotations

from batchsim.scheduler.kv_bytes import CacheLayout, PrivateCache
from batchsim.scheduler.plan import CacheOps, PrefillChunk
from batchsim.scheduler.pool_geometry import (
    EMPTY_PAGED_POOL,
    EMPTY_POOL,
    KV_STEP,
    PAGE_TOKENS,
    PoolGeometry,
    next_geometry,
    next_paged_geometry,
    row_blocks,
)
from batchsim.scheduler.prefix_cache import PrefixCache, prompt_block_hashes
from batchsim.scheduler.request import Request

GEOMETRIES_KEPT = 1 << 12  # geometry_for's remembered answers (for one pool)


class KVAccountError(AssertionError):
    """The KV account contradicts itself or the budget: a bug, never a user error."""


class KVManager:
    def __init__(self, budget_bytes: int, cache: CacheLayout, row_step: int, max_rows: int,
                 paged: bool = False, prefix_cache: bool = False):
        self.budget_bytes = budget_bytes
        self.cache = cache
        self.row_step = row_step
        self.max_rows = max_rows
        self.paged = paged  # full-attention and MLA layers in blocks (PoolGeometry.blocks)
        self.pool = EMPTY_PAGED_POOL if paged else EMPTY_POOL
        self.pool_members: set[int] = set()
        self.private: dict[int, PrivateCache] = {}  # request id -> its private prefill cache
        self._private_bytes = 0  # what they hold (check() adds them up again)
        self.pool_bytes = 0  # what the pool's geometry holds (priced in commit as it changes)
        # The most KV the running requests held after a plan: held less what is free on demand
        # (padded: the cache's copies; paged: pool blocks no row holds, the cache's unreferenced
        # ones and the pool's slack). Both executors hold the same, whatever the cache keeps.
        self.peak_running_bytes = 0
        # Cached prompt blocks (paged: in the pool, shared by reference); None: caching off.
        self.prefix = (PrefixCache(PAGE_TOKENS * cache.full_token_bytes, shared=paged)
                       if prefix_cache else None)
        self.shared = self.prefix if paged and prefix_cache else None
        # Padded: the cache's blocks are copies held beside the pool (kv_bytes counts them).
        self.copies = self.prefix if prefix_cache and not paged else None
        # geometry_for's answers for the pool: (rows, (max_len - 1) // KV_STEP, bytes) -> geometry
        # (the middle is kv_steps(max_len) - 1 for max_len >= 1, and -1 at max_len 0)
        self._geometries: dict[tuple[int, int, int], PoolGeometry | None] = {}

    @property
    def private_bytes(self) -> int:
        return self._private_bytes

    @property
    def kv_bytes(self) -> int:
        """KV held: the pool, the private caches and, padded, the prefix cache's copies beside
        them (commit and cache_ops read this rule, not a sum of their own)."""
        held_bytes, copies = self.pool_bytes + self._private_bytes, self.copies
        if copies is not None and copies.blocks:  # (none: no nbytes frame, every commit)
            return held_bytes + copies.nbytes
        return held_bytes

    def holds(self, request_id: int) -> bool:
        return request_id in self.pool_members or request_id in self.private

    def release(self, request_id: int) -> None:
        """Free a request's KV (finished, aborted, preempted). The pool keeps its geometry until the
        next plan decides it."""
        self.pool_members.discard(request_id)
        private = self.private.pop(request_id, None)
        if private is not None:
            self._private_bytes -= private.kv_bytes
        if self.shared is not None:
            self.shared.release(request_id)  # its references only: cached blocks stay

    # -- paged blocks shared with the prefix cache ------------------------------------------------
    def own_blocks(self, request_id: int, tokens: int) -> int:
        """Blocks a pool row of `tokens` holds that are not cached blocks it references."""
        n = row_blocks(tokens)
        return n - self.shared.num_held(request_id) if self.shared is not None else n

    def held_cache_blocks(self) -> int:
        """Cached blocks something references (never evicted): pool blocks beside the rows' own."""
        return len(self.shared.refs) if self.shared is not None else 0

    def blocks_after(self, rows: list[Request], tokens_ahead: int = 1) -> int:
        """Pool blocks once `rows` hold tokens_ahead more tokens each, the cache's referenced
        blocks included."""
        return sum([self.own_blocks(r.request_id, r.num_tokens + tokens_ahead) for r in rows]) + (
            self.held_cache_blocks())

    def blocks_beside(self, rows: list[Request]) -> int:
        """Pool blocks beyond the row_blocks of these rows (all the pool's rows): cached blocks
        none of them references."""
        if self.shared is None:
            return 0
        return len(self.shared.blocks) - sum([self.shared.num_held(r.request_id) for r in rows])

    def admit_blocks(self, r: Request) -> int:
        """Blocks a waiting request adds to blocks_after once it decodes: its own, and the cached
        blocks of its hit that nothing references yet."""
        n = row_blocks(r.num_tokens + 1)
        if self.shared is None:
            return n
        hashes = prompt_block_hashes(r)
        hit = self.shared.match(hashes, r.num_tokens)
        refs = self.shared.refs
        return n - hit + sum([h not in refs for h in hashes[:hit]])

    def geometry_for(self, num_rows: int, max_len: int, max_bytes: int,
                     need_blocks: int = 0) -> PoolGeometry | None:
        """The pool after a step with `num_rows` rows, the longest `max_len` tokens; paged:
        `need_blocks` in all (row_blocks of each row)."""
        if self.paged:
            return next_paged_geometry(self.pool, num_rows, max_len, need_blocks, self.row_step,
                                       self.max_rows, max_bytes, self.cache)
        # next_geometry reads max_len only as kv_steps(max_len), a function of
        # (max_len - 1) // KV_STEP (the key: no frame), and the pool: its answers for this pool
        # (commit forgets them when it changes) are remembered (a simulated plan asks a few
        # times, most often what an earlier plan asked).
        key = (num_rows, (max_len - 1) // KV_STEP, max_bytes)
        known = self._geometries
        geom = known.get(key, known)  # (known itself: not asked yet; None is an answer)
        if geom is known:
            if len(known) >= GEOMETRIES_KEPT:
                known.clear()
            geom = known[key] = next_geometry(self.pool, num_rows, max_len, self.row_step,
                                              self.max_rows, max_bytes, self.cache)
        return geom

    def commit(
        self,
        pool: PoolGeometry,
        pool_members: set[int],
        private: dict[int, PrivateCache],
        private_bytes: int,
        need_blocks: int = 0,
    ) -> int:
        """Apply a plan's KV (`private_bytes`: what `private` holds; paged: `need_blocks` of the
        pool's blocks held by its rows), evicting cached prefix blocks it needs the bytes of;
        returns the bytes now held."""
        if pool is not self.pool:  # the geometry rarely changes: priced once per change
            self.pool = pool
            self.pool_bytes = self.cache.pool_bytes(pool)
            self._geometries.clear()  # geometry_for's answers were for the old pool
        running = self.pool_bytes + private_bytes
        if self.paged:
            running -= ((pool.blocks or 0) - need_blocks) * self.cache.block_bytes
        if running > self.peak_running_bytes:  # noqa: PLR1730 (max(): a call, every plan)
            self.peak_running_bytes = running
        self.pool_members = pool_members
        self.private = private
        self._private_bytes = private_bytes
        copies = self.copies
        if copies is not None and copies.blocks:  # they keep what the plan leaves
            copies.fit(self.budget_bytes - self.kv_bytes + copies.nbytes)
        held_bytes = self.kv_bytes
        if held_bytes > self.budget_bytes:
            raise KVAccountError(f"plan holds {held_bytes} KV bytes > budget {self.budget_bytes}")
        return held_bytes

    def cache_ops(self, kv_bytes: int, prefills: list[PrefillChunk], requests: dict[int, Request]
                  ) -> tuple[CacheOps | None, int]:
        """The prefix cache keeps the blocks a plan's chunks complete in what the plan's committed
        `kv_bytes` leave: its ops for the plan, and the plan's KV bytes after them."""
        prefix, copies = self.prefix, self.copies is not None  # (kv_bytes counts copies)
        held_bytes = kv_bytes - prefix.nbytes if copies else kv_bytes  # pool and private caches
        prefix.store_chunks(prefills, requests, self.budget_bytes - held_bytes)
        return prefix.take_ops(), held_bytes + prefix.nbytes if copies else held_bytes

    def check(self, computed_tokens: dict[int, int], releasing: set[int] = frozenset()) -> None:
        """Integrity: geometry covers the members, private caches match their tokens, budget holds.
        `computed_tokens`: request id -> tokens in its cache, for every running request;
        `releasing`: finished or aborted requests whose KV the next plan frees."""
        if self.kv_bytes > self.budget_bytes:
            raise KVAccountError(f"{self.kv_bytes} KV bytes held > budget {self.budget_bytes}")
        if self._private_bytes != sum(p.kv_bytes for p in self.private.values()):
            raise KVAccountError(f"private caches counted as {self._private_bytes} bytes, hold "
                                 f"{sum(p.kv_bytes for p in self.private.values())}")
        if self.pool.rows < len(self.pool_members):
            raise KVAccountError(f"pool has {self.pool.rows} rows for {len(self.pool_members)}")
        for rid in self.pool_members - releasing:
            if rid not in computed_tokens:
                raise KVAccountError(f"pool holds request {rid}, which is not running")
            if computed_tokens[rid] > self.pool.capacity_tokens:
                raise KVAccountError(f"request {rid} has {computed_tokens[rid]} tokens > capacity")
            if rid in self.private:
                raise KVAccountError(f"request {rid} is both in the pool and in a private cache")
        if self.paged:
            self._check_blocks(computed_tokens, releasing)
        for rid, p in self.private.items():
            if rid not in releasing:
                self._check_private(rid, p, computed_tokens)
        for rid, tokens in computed_tokens.items():
            if tokens and not self.holds(rid):
                raise KVAccountError(f"request {rid} has {tokens} computed tokens but no KV")

    def _check_blocks(self, computed_tokens: dict[int, int], releasing: set[int]) -> None:
        members = self.pool_members - releasing
        held_blocks = sum(self.own_blocks(rid, computed_tokens[rid]) for rid in members)
        if self.shared is not None:
            held_blocks += len(self.shared.blocks)
            refs: dict[int, int] = {}
            for rid, hashes in self.shared.held.items():
                if rid not in computed_tokens and rid not in releasing:
                    raise KVAccountError(f"request {rid} holds cached blocks but is not running")
                for h in hashes:
                    refs[h] = refs.get(h, 0) + 1
            if any(h not in self.shared.blocks for h in refs) or any(
                    self.shared.refs.get(h, 0) < n for h, n in refs.items()):
                raise KVAccountError("a request holds a cached block the cache does not count")
        if held_blocks > (self.pool.blocks or 0):
            raise KVAccountError(f"pool rows hold {held_blocks} blocks > the pool's "
                                 f"{self.pool.blocks}")

    def _check_private(self, rid: int, p: PrivateCache, computed_tokens: dict[int, int]) -> None:
        if rid not in computed_tokens:
            raise KVAccountError(f"private cache of request {rid}, which is not running")
        if p.computed_tokens != computed_tokens[rid] or not 0 <= p.chunk_start < p.computed_tokens:
            raise KVAccountError(f"request {rid}: private cache {p} for {computed_tokens[rid]} "
                                 "computed")
        if p.kv_bytes != self.cache.private_bytes(p.chunk_start, p.computed_tokens):
            raise KVAccountError(f"request {rid}: private cache {p} holds the wrong bytes")
