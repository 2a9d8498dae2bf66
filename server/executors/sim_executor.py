"""The simulated executor: the real executor's bookkeeping (pool rows, private prefill caches,
copies) with every piece of compute timed by the device profile instead of run. Nothing sleeps:
the engine advances a virtual clock by the predicted durations. A pure-decode plan covering many
steps is timed in one call, stopping at the next arrival. A step whose rows verify drafts is priced
as one forward of B rows x (K+1) tokens (spec_price.verify_extra_s), its accepted drafts drawn by
sim_spec.SpecDraws, plus the drafter's time (spec_price.draft_s; a draft model's catch-up on rows
new to it: SpecDraws.catch_up_s)."""

from __future__ import annotations

from batchsim.scheduler import prefill_groups
from batchsim.scheduler.kv_bytes import CacheLayout
from batchsim.scheduler.lazy_rows import Positions
from batchsim.scheduler.plan import CacheOps, PrefillChunk, StepPlan, StepResult, made
from batchsim.scheduler.pool_geometry import PAGE_TOKENS, PoolGeometry
from batchsim.server.executors.base import ExecutorCaps
from batchsim.server.executors.pool_rows import NO_MOVES, PoolLayout
from batchsim.server.executors.sim_spec import SpecDraws
from batchsim.server.perf.spec_price import draft_s, verify_extra_s
from batchsim.server.perf.stepcost import StepCost

PRICES_KEPT = 1 << 18  # remembered prices per kind (a few MB)


class SimExecutor:
    def __init__(self, cost: StepCost, max_lookahead_steps: int = 1 << 16,
                 cache: CacheLayout | None = None, paged: bool = False,
                 spec: SpecDraws | None = None):
        self.caps = ExecutorCaps(real_compute=False, virtual_time=True,
                                 max_lookahead_steps=max_lookahead_steps, needs_token_ids=False)
        self.cost = cost
        self.kvt = cost.kv_bytes_per_token
        self.overhead_s = cost.step_overhead_s
        self._request_s = cost.engine.host_request_s  # once per request (PrefillChunk.fresh)
        # Windows and fixed states do not grow linearly with the width: priced step by step.
        self.per_step_decode = not cost.layers.linear_in_width
        # What the model's cache holds by layer kind (None: dense, the cost model's bytes per
        # token).
        self.cache = cache or CacheLayout.dense(self.kvt)
        self.layout = PoolLayout(self.cache, paged)  # the real pool's rows, in its order
        # request id -> bytes its private prefill cache holds (as mlx-lm allocates); kv_bytes
        # sums them (in C: a few caches, no frame), so each change is one dict write
        self.private: dict[int, int] = {}
        self._pool_bytes = 0  # what the pool's geometry holds (set when it changes)
        self.block_bytes = PAGE_TOKENS * self.cache.full_token_bytes  # one prefix-cache block
        self._cached_bytes = 0  # prefix-cache blocks held beside the pool (padded: copies)
        # Paged, cached blocks are pool blocks: request id -> those its row will reference.
        self._shared: dict[int, int] = {}
        # Prices that repeat, remembered (StepCost is a pure function of its arguments):
        # (n, start, sample, rows, rows sampling their first token) -> seconds
        self._prefill_s: dict[tuple[int, int, bool, int, int], float] = {}
        self._decode_s: dict[tuple[int, int], float] = {}  # (rows, width): per-step models
        self.spec = spec  # speculative decoding's accepted drafts (None: off)
        # (rows, K drafted, start, K asked, rows drafting): K more tokens a row and the drafter
        self._verify_s: dict[tuple[int, int, int, int, int], float] = {}
        self._decode_parts: dict[int, tuple[float, float]] = {}  # rows -> cost.decode_parts
        self._joined: tuple[int, ...] = ()  # the last plan's decode_ids (execute)

    def execute(self, plan: StepPlan, max_elapsed_s: float = float("inf")) -> StepResult:
        (step_index, free_ids, new_requests, prefills, decode_ids, positions, pool, _, steps,
         spec, ops, width) = plan  # unpacked once: this runs every plan
        layout = self.layout
        t = self.overhead_s
        if free_ids:
            t += self._free(free_ids)
        for new in new_requests:  # an empty prefill cache (private_bytes(0, 0): 0 bytes)
            self.private[new.request_id] = 0
            if new.cached_hashes:  # cached blocks copied into its prefill cache
                t += self.cost.copy_s(len(new.cached_hashes) * self.block_bytes)
                if layout.paged:
                    self._shared[new.request_id] = len(new.cached_hashes)
        if new_requests and self._request_s:  # a one-token prompt's first token: in its row
            t += self.cost.engine.joined_s(plan.num_joined_directly)
        if ops is not None and not layout.paged:  # paged: the pool's blocks, adopted in place
            self._cached_bytes += (len(ops.store) - len(ops.evict)) * self.block_bytes
            t += self.cost.copy_s(len(ops.store) * self.block_bytes)  # stored after the prefills
        elif ops is not None:
            t += self._paged_cache_ops(plan, ops)
        if pool is not layout.geometry and pool != layout.geometry:
            t += self._resize(pool)
        # The rows of the last plan that joined (the scheduler hands the same tuple while its
        # rows stay), all in the pool unless one left since; Positions' first `pooled` rows
        # decoded in the last step (most plans: all of them, and no _join frame); other plans'
        # rows (paged, speculative: the scheduler's general path) asked in C.
        if decode_ids is not self._joined and (
                positions.pooled < len(decode_ids) if type(positions) is Positions
                else not layout.in_pool.issuperset(decode_ids)):
            t += self._join(plan)
        self._joined = decode_ids
        sampled = decode_ids  # who sampled a token: the decode rows, then sampling prefills
        if prefills:
            t, sampling = self._prefill(prefills, t)
            sampled = (*sampled, *sampling)
        if spec:
            return self._verify(plan, t, sampled)
        durations = [t]
        if decode_ids:
            self._decode(len(decode_ids), width or max(positions) + 1, steps, durations,
                         max_elapsed_s)
        return made(StepResult, (step_index, sampled, None, tuple(durations), self.kv_bytes(),
                                 None, None))

    def _prefill(self, prefills: tuple[PrefillChunk, ...], t: float) -> tuple[float, list[int]]:
        """The plan's prefill chunks in groups, as the MLX executor runs them (one forward a
        group): `t` (the step's time so far) plus each group's, added in order, and the rows
        sampling a token, in order. Each chunk's private cache grows to
        CacheLayout.private_bytes; a group's price is remembered (one frame a chunk fewer: most
        plans that prefill have one chunk)."""
        sampling = []
        private, cache, prices = self.private, self.cache, self._prefill_s
        for group in ((prefills,) if len(prefills) == 1  # alone: its own group
                      else prefill_groups.groups(prefills)):
            started = 0  # rows sampling their request's first token
            for rid, start, n, sample, fresh in group:  # PrefillChunk: fields cost a call
                private[rid] = cache.private_bytes(start, start + n)
                if sample:
                    sampling.append(rid)
                    started += fresh
            _, start, n, sample, _ = group[0]
            key = (n, start, sample, len(group), started)  # prefill_forward_s's arguments
            s = prices.get(key)
            if s is None:
                s = _remember(prices, key, self.cost.prefill_forward_s(*key))
            t += s
        return t, sampling

    def _verify(self, plan: StepPlan, t: float, sampled: tuple[int, ...]) -> StepResult:
        """One verify step: accepted drafts drawn, then every row's last token and drafts in one
        forward pass (padded to the largest K drafted, as the MLX executor runs it)."""
        if self.spec is None:
            raise ValueError("a plan with drafts, and this simulated executor has no acceptance")
        asked = plan.decode_spec_tokens  # every row drafting pays the drafter, kept or not
        accepted, drafted = self.spec.draw(asked, len(sampled))
        rows, start, k = len(plan.decode_ids), max(plan.decode_positions), max(drafted)
        t += self.spec.catch_up_s(plan.decode_ids, asked, plan.decode_positions)
        key = (rows, k, start, max(asked), self.spec.drafting_rows(asked))
        extra = self._verify_s.get(key)
        if extra is None:
            extra = _remember(self._verify_s, key, verify_extra_s(self.cost, rows, k, start)
                              + draft_s(self.spec.drafter, key[4], key[3], start + 1))
        t += self._decode_forward_s(rows, start + 1) + extra
        return StepResult(plan.step_index, sampled, None, (t,), self.kv_bytes(), accepted,
                          drafted)

    def _paged_cache_ops(self, plan: StepPlan, ops: CacheOps) -> float:
        """Paged: blocks this step's chunks complete are copied into pool blocks (a joining row's
        are adopted in place); rows whose prefill ended will reference the blocks they hold."""
        for rid, hashes in ops.share:
            self._shared[rid] = len(hashes)
        if not ops.store:
            return 0.0
        chunks = {c.request_id for c in plan.prefills}
        return self.cost.copy_s(sum([rid in chunks for rid, _, _ in ops.store]) * self.block_bytes)

    def _decode(self, rows: int, width: int, num_steps: int, durations: list[float],
                max_elapsed_s: float) -> None:
        """A plan's decode steps (`rows` rows `width` tokens wide in the first, up to `num_steps`),
        each reading one more token: the first is added to this step's other work, the rest
        follow until one would start after an arrival (then: replan)."""
        if self.per_step_decode:  # windows and fixed states do not grow linearly with the width
            durations[0] += self._decode_forward_s(rows, width)
            elapsed, overhead_s = durations[0], self.overhead_s
            for w in range(width + 1, width + num_steps):
                if elapsed >= max_elapsed_s:
                    break
                d = overhead_s + self._decode_forward_s(rows, w)
                durations.append(d)
                elapsed += d
            return
        parts = self._decode_parts.get(rows)
        if parts is None:
            parts = self._decode_parts[rows] = self.cost.decode_parts(rows)  # linear in the width
        base, per_width = parts
        durations[0] += base + per_width * width
        elapsed, base_s = durations[0], base + self.overhead_s
        for w in range(width + 1, width + num_steps):
            if elapsed >= max_elapsed_s:
                break
            d = base_s + per_width * w
            durations.append(d)
            elapsed += d

    def _decode_forward_s(self, rows: int, width: int) -> float:
        key = (rows, width)
        s = self._decode_s.get(key)
        if s is None:
            s = _remember(self._decode_s, key, self.cost.decode_forward_s(rows, width))
        return s

    def end_run(self) -> None:
        self.reset()

    def reset(self) -> None:
        if self.spec is not None:
            self.spec.forget(self.layout.row_ids)
        self.layout.clear()
        self.private, self._pool_bytes = {}, 0
        self._cached_bytes = 0
        self._shared = {}
        self._joined = ()

    def kv_bytes(self) -> int:
        return self._pool_bytes + sum(self.private.values()) + self._cached_bytes

    # -- the pool's copies, as pool_rows lays them out for the real DecodePool ------------------
    def _free(self, free_ids: tuple[int, ...]) -> float:
        if self.spec is not None:
            self.spec.forget(free_ids)
        if self.private:
            private = self.private
            for rid in free_ids:  # their prefill caches end
                private.pop(rid, None)
        if self._shared:
            for rid in free_ids:
                self._shared.pop(rid, None)
        moves = self.layout.leave(free_ids)
        if moves is NO_MOVES:
            return 0.0
        self._joined = ()
        return self.cost.copy_s(2 * moves.moved_bytes)  # gathered into a temporary, then scattered

    def _resize(self, geometry: PoolGeometry) -> float:
        """A new pool geometry (called only when it changes): the kept part copied (paged: not
        the blocks when their count stays), the rest written as zeros (write only: half the
        traffic of a copy)."""
        change = self.layout.resize(geometry)
        self._pool_bytes = change.new_bytes
        return self.cost.copy_s(change.kept_bytes - change.untouched_bytes) + self.cost.copy_s(
            change.new_bytes - change.kept_bytes) / 2

    def _join(self, plan: StepPlan) -> float:
        """The plan's decode rows not yet in the pool (execute: some are) join it, in the plan's
        order."""
        layout, ids, positions = self.layout, plan.decode_ids, plan.decode_positions
        in_pool, private = layout.in_pool, self.private
        t = 0.0
        # Rows that decoded in the last step are in the pool: those before Positions.pooled, the
        # others are its tail.
        if type(positions) is Positions:
            ids, positions = ids[positions.pooled:], positions.tail
        for rid, pos in zip(ids, positions):  # faster than a sorted set difference (< ~500 rows)
            if rid in in_pool:
                continue
            layout.join(rid, pos)
            private.pop(rid, None)  # its prefill cache ends
            shared = self._shared.pop(rid, 0) * self.block_bytes  # referenced, not copied
            t += self.cost.copy_s(self.cache.seq_bytes(pos) - shared)
        return t


def _remember(prices: dict, key: tuple, seconds: float) -> float:
    if len(prices) >= PRICES_KEPT:  # a long run's widths: start over rather than grow
        prices.clear()
    prices[key] = seconds
    return seconds
