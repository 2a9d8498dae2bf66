"""The simulated executor: the real executor's bookkeeping (pool rows, private prefill caches,
copies) with every piece of compute timed by the device profile instead of run. Nothing sleeps:
the engine advances a virtual clock by the predicted durations. A pure-decode plan covering many
steps is timed in one call, stopping at the next arrival."""

from __future__ import annotations

from scheduler.kv_layout import EMPTY_POOL, private_cache_tokens
from scheduler.plan import StepPlan, StepResult
from server.stepcost import StepCost


class SimExecutor:
    name = "sim"
    needs_token_ids = False
    max_lookahead_steps = 1 << 16

    def __init__(self, cost: StepCost):
        self.cost = cost
        self.kvt = cost.kv_bytes_per_token
        self.geometry = EMPTY_POOL
        self.rows: list[int] = []  # request per pool row, in the real pool's order
        self.in_pool: set[int] = set()  # the same ids, for membership tests
        self.private: dict[int, int] = {}  # request id -> tokens in its private prefill cache
        self._private_tokens = 0  # what those caches hold, rounded up as mlx-lm allocates

    def execute(self, plan: StepPlan, max_elapsed_s: float = float("inf")) -> StepResult:
        cost = self.cost
        t = cost.step_overhead_s + self._free(plan.free_ids)
        for new in plan.new_requests:
            self._set_private(new.request_id, 0)
        t += self._resize(plan)
        t += self._join(plan)
        sampled: list[int] = []
        for c in plan.prefills:
            t += cost.prefill_forward_s(c.num_tokens, c.start, c.sample)
            self._set_private(c.request_id, c.start + c.num_tokens)
            if c.sample:
                sampled.append(c.request_id)
        durations = [t]
        if plan.decode_ids:
            sampled.extend(plan.decode_ids)
            width = max(plan.decode_positions) + 1
            batch = len(plan.decode_ids)
            base, per_width = cost.decode_parts(batch)
            durations[0] += base + per_width * width
            base += cost.step_overhead_s
            elapsed = durations[0]
            for w in range(width + 1, width + plan.num_steps):  # each step reads one more token
                if elapsed >= max_elapsed_s:  # this step would start after an arrival: replan
                    break
                d = base + per_width * w
                durations.append(d)
                elapsed += d
        return StepResult(plan.step_index, tuple(sampled), None, tuple(durations), self.kv_bytes())

    def reset(self) -> None:
        self.geometry, self.rows, self.in_pool = EMPTY_POOL, [], set()
        self.private, self._private_tokens = {}, 0

    def kv_bytes(self) -> int:
        return (self.geometry.nbytes(1) + self._private_tokens) * self.kvt

    def _set_private(self, request_id: int, tokens: int) -> None:
        self._drop_private(request_id)
        self.private[request_id] = tokens
        self._private_tokens += private_cache_tokens(tokens)

    def _drop_private(self, request_id: int) -> None:
        tokens = self.private.pop(request_id, None)
        if tokens is not None:
            self._private_tokens -= private_cache_tokens(tokens)

    # -- the pool's copies, as the real DecodePool makes them ------------------------------------
    def _free(self, free_ids: tuple[int, ...]) -> float:
        if not free_ids:
            return 0.0
        gone = set(free_ids)
        for rid in gone:
            self._drop_private(rid)
        leaving = gone & self.in_pool
        if not leaving:
            return 0.0
        self.in_pool -= leaving
        rows = self.rows
        keep = len(rows) - len(leaving)
        holes = [i for i in range(keep) if rows[i] in gone]
        movers = [i for i in range(keep, len(rows)) if rows[i] not in gone]
        for h, m in zip(holes, movers):
            rows[h] = rows[m]
        del rows[keep:]
        return self.cost.copy_s(2 * len(movers) * self.geometry.capacity_tokens * self.kvt)

    def _resize(self, plan: StepPlan) -> float:
        new, old = plan.pool, self.geometry
        if new == old:
            return 0.0
        self.geometry = new
        if new.rows == 0 or old.rows == 0:
            return self.cost.copy_s(new.nbytes(self.kvt)) / 2  # fresh zeros, write only
        kept = min(old.rows, new.rows) * min(old.capacity_tokens, new.capacity_tokens) * self.kvt
        return self.cost.copy_s(kept) + self.cost.copy_s(new.nbytes(self.kvt) - kept) / 2

    def _join(self, plan: StepPlan) -> float:
        in_pool = self.in_pool
        t = 0.0
        for rid, pos in zip(plan.decode_ids, plan.decode_positions):
            if rid not in in_pool:
                self.rows.append(rid)
                in_pool.add(rid)
                self._drop_private(rid)
                t += self.cost.copy_s(pos * self.kvt)
        return t


def open_sim_executor(cfg, ref) -> SimExecutor:
    from server.devices import resolve_profile

    profile = resolve_profile(cfg.device_profile, ref.quantize_bits)
    return SimExecutor(StepCost(ref.spec, profile, ref.dtype, ref.quantize_bits))
