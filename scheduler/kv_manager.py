"""The scheduler's account of KV memory, mirroring what the executor allocates: one padded pool for
decoding requests plus a private cache per prefilling request. Allocator verbs in the nano-vllm
style: `can_*` asks, `commit` applies a plan, `release` frees."""

from __future__ import annotations

from batchsim.scheduler.kv_layout import (
    EMPTY_POOL,
    PoolGeometry,
    next_geometry,
    private_cache_tokens,
)


class KVAccountError(AssertionError):
    """The KV account contradicts itself or the budget: a bug, never a user error."""


class KVManager:
    def __init__(self, budget_bytes: int, kv_bytes_per_token: int, row_step: int, max_rows: int):
        self.budget_bytes = budget_bytes
        self.kv_bytes_per_token = kv_bytes_per_token
        self.row_step = row_step
        self.max_rows = max_rows
        self.pool = EMPTY_POOL
        self.pool_members: set[int] = set()
        self.private_tokens: dict[int, int] = {}  # request id -> tokens its private cache holds

    @property
    def pool_bytes(self) -> int:
        return self.pool.nbytes(self.kv_bytes_per_token)

    @property
    def private_bytes(self) -> int:
        return sum(self.private_tokens.values()) * self.kv_bytes_per_token

    @property
    def kv_bytes(self) -> int:  # pool_bytes + private_bytes, in one call: commit runs every step
        return (self.pool.nbytes(1) + sum(self.private_tokens.values())) * self.kv_bytes_per_token

    def holds(self, request_id: int) -> bool:
        return request_id in self.pool_members or request_id in self.private_tokens

    def release(self, request_id: int) -> None:
        """Free a request's KV (finished, aborted, preempted). The pool keeps its geometry until the
        next plan decides it."""
        self.pool_members.discard(request_id)
        self.private_tokens.pop(request_id, None)

    def geometry_for(self, num_rows: int, max_len: int, max_bytes: int) -> PoolGeometry | None:
        return next_geometry(
            self.pool, num_rows, max_len, self.row_step, self.max_rows, max_bytes,
            self.kv_bytes_per_token,
        )

    def private_bytes_after(self, request_id: int, computed_tokens: int) -> int:
        """Extra bytes a private cache needs to hold `computed_tokens`."""
        new = private_cache_tokens(computed_tokens)
        return (new - self.private_tokens.get(request_id, 0)) * self.kv_bytes_per_token

    def commit(
        self,
        pool: PoolGeometry,
        pool_members: set[int],
        private_tokens: dict[int, int],
    ) -> int:
        """Apply a plan's KV; returns the bytes now held."""
        self.pool = pool
        self.pool_members = pool_members
        self.private_tokens = private_tokens
        held = self.kv_bytes
        if held > self.budget_bytes:
            raise KVAccountError(f"plan holds {held} KV bytes > budget {self.budget_bytes}")
        return held

    def check(self, computed_tokens: dict[int, int], releasing: set[int] = frozenset()) -> None:
        """Integrity: geometry covers the members, private caches match their tokens, budget holds.
        `computed_tokens`: request id -> tokens in its cache, for every running request;
        `releasing`: finished or aborted requests whose KV the next plan frees."""
        if self.kv_bytes > self.budget_bytes:
            raise KVAccountError(f"{self.kv_bytes} KV bytes held > budget {self.budget_bytes}")
        if self.pool.rows < len(self.pool_members):
            raise KVAccountError(f"pool has {self.pool.rows} rows for {len(self.pool_members)}")
        for rid in self.pool_members - releasing:
            if rid not in computed_tokens:
                raise KVAccountError(f"pool holds request {rid}, which is not running")
            if computed_tokens[rid] > self.pool.capacity_tokens:
                raise KVAccountError(f"request {rid} has {computed_tokens[rid]} tokens > capacity")
            if rid in self.private_tokens:
                raise KVAccountError(f"request {rid} is both in the pool and in a private cache")
        for rid, tokens in self.private_tokens.items():
            if rid in releasing:
                continue
            if rid not in computed_tokens:
                raise KVAccountError(f"private cache of request {rid}, which is not running")
            if tokens != private_cache_tokens(computed_tokens[rid]):
                raise KVAccountError(
                    f"request {rid}: private cache {tokens} tokens for {computed_tokens[rid]} computed"
                )
        for rid, tokens in computed_tokens.items():
            if tokens and not self.holds(rid):
                raise KVAccountError(f"request {rid} has {tokens} computed tokens but no KV")
