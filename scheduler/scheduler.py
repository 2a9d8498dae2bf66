"""FCFS continuous batching under a KV memory budget. Policy only: it never computes time and never
imports mlx; an executor (real MLX, roofline model, or fake) runs what it plans.

Each step: requests already running decode together (one token each, one forward pass) and the
rest of the token budget goes to prefill chunks, oldest first, then to admitting the head of the
waiting queue (decode-first). With prefill-first, a step that can prefill does only that. When
the KV of running requests outgrows the budget, the newest request is preempted: its KV is freed
and it goes back to the front of the queue to be recomputed.
"""

from __future__ import annotations

from collections import deque

from batchsim.scheduler.config import SchedulerConfig
from batchsim.scheduler.kv_layout import KV_STEP, PoolGeometry, private_cache_tokens, round_down
from batchsim.scheduler.kv_manager import KVAccountError, KVManager
from batchsim.scheduler.plan import NewRequest, PrefillChunk, StepPlan, StepResult
from batchsim.scheduler.request import Request, RequestStatus


class Scheduler:
    def __init__(self, config: SchedulerConfig):
        self.config = config
        self.kv = KVManager(
            config.kv_budget_bytes, config.kv_bytes_per_token, config.row_step, config.max_num_seqs
        )
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []  # in admission order: the newest is preempted first
        self.requests: dict[int, Request] = {}  # waiting or running
        self.num_steps = 0  # steps executed so far; token_runs index into this count
        self.num_preemptions = 0
        self.num_rejected = 0
        self._pending_free: list[int] = []

    # -- requests in and out -------------------------------------------------------------------
    def add_request(self, request: Request) -> bool:
        """Queue a request, or reject it (status REJECTED, reason in finish_reason) if it can never run."""
        reason = self.rejection_reason(request)
        if reason is not None:
            request.status = RequestStatus.REJECTED
            request.finish_reason = reason
            self.num_rejected += 1
            return False
        if request.request_id in self.requests:
            raise ValueError(f"request id {request.request_id} is already queued or running")
        request.status = RequestStatus.WAITING
        self.waiting.append(request)
        self.requests[request.request_id] = request
        return True

    def rejection_reason(self, request: Request) -> str | None:
        cfg = self.config
        total = request.max_total_tokens
        if total > cfg.max_model_len:
            return (f"prompt ({request.num_prompt_tokens}) + max_tokens ({request.sampling.max_tokens})"
                    f" = {total} tokens exceeds the model context of {cfg.max_model_len}")
        alone = PoolGeometry(1, private_cache_tokens(total)).nbytes(cfg.kv_bytes_per_token)
        if alone > cfg.kv_budget_bytes:
            return (f"its KV cache at full length ({alone} bytes) exceeds the KV budget "
                    f"({cfg.kv_budget_bytes} bytes)")
        return None

    def abort(self, request_id: int) -> Request | None:
        request = self.requests.pop(request_id, None)
        if request is None:
            return None
        if request.status is RequestStatus.WAITING:
            self.waiting.remove(request)
        else:
            self.running.remove(request)
            self._pending_free.append(request_id)
        request.status = RequestStatus.ABORTED
        request.finish_reason = "abort"
        return request

    def has_work(self) -> bool:
        return bool(self.waiting or self.running or self._pending_free)

    # -- planning ------------------------------------------------------------------------------
    def schedule(self) -> StepPlan:
        free_ids = self._pending_free
        self._pending_free = []
        for rid in free_ids:
            self.kv.release(rid)
        if self.config.policy == "prefill-first":
            plan = self._plan(free_ids, decode_step=False)
            if plan is not None:
                return plan
        plan = self._plan(free_ids, decode_step=True)
        assert plan is not None
        return plan

    def _plan(self, free_ids: list[int], decode_step: bool) -> StepPlan | None:
        """One step's plan. decode_step=False plans prefill only and returns None if there is none."""
        cfg, kv = self.config, self.kv
        kvt = cfg.kv_bytes_per_token
        pool: list[Request] = []  # rows after this step (decoding, or untouched in a prefill step)
        prefilling: list[Request] = []
        members = kv.pool_members
        width = 0  # the pool's longest row after this step, in tokens
        longest = 0  # the longest running request, prompt + output so far
        # One pass, with comparisons rather than max(): this runs every step over every request.
        for r in self.running:
            c = r.num_computed_tokens
            n = r.num_prompt_tokens + r.num_output_tokens
            if n > longest:  # noqa: PLR1730
                longest = n
            if n - c > 1:
                prefilling.append(r)
            elif decode_step or r.request_id in members:
                pool.append(r)
                if c + decode_step > width:  # noqa: PLR1730
                    width = c + decode_step
        in_pool = {r.request_id for r in pool}
        private: dict[int, int] = {}  # the prefill caches that stay private after this step
        if kv.private_tokens:
            private = {rid: t for rid, t in kv.private_tokens.items() if rid not in in_pool}
        preempted = False

        def geometry(reserve_bytes: int = 0) -> PoolGeometry | None:
            room = cfg.kv_budget_bytes - sum(private.values()) * kvt - reserve_bytes
            return kv.geometry_for(len(pool), width, room)

        def preempt_newest() -> Request:
            nonlocal width, preempted
            victim = self.running[-1]
            self._preempt(victim, free_ids)
            preempted = True
            private.pop(victim.request_id, None)
            if victim.request_id in in_pool:
                in_pool.discard(victim.request_id)
                pool.remove(victim)
                width = max((r.num_computed_tokens + decode_step for r in pool), default=0)
            return victim

        geom = geometry()
        while geom is None:  # decoding rows must grow: preempt from the newest end
            if not self.running:
                raise KVAccountError("nothing running, yet the empty pool does not fit")
            preempt_newest()
            geom = geometry()

        tok_budget = cfg.max_num_batched_tokens - (len(pool) if decode_step else 0)
        prefills: list[PrefillChunk] = []
        new_requests: list[NewRequest] = []

        def fit(r: Request, n: int) -> int:
            """The largest chunk up to n whose cache growth fits, dropping the pool's spare rows
            and capacity first, then whole KV steps of the chunk."""
            nonlocal geom
            c = r.num_computed_tokens
            while n > 0:
                need = kv.private_bytes_after(r.request_id, c + n)
                if need <= cfg.kv_budget_bytes - geom.nbytes(kvt) - sum(private.values()) * kvt:
                    return n
                tighter = geometry(reserve_bytes=need)
                if tighter is not None:
                    geom = tighter
                    return n
                n = round_down(c + n - 1, KV_STEP) - c
            return 0

        # Admission also asks whether the request could decode beside everyone running, so a
        # request that would only be preempted again when it joins the pool waits instead.
        rows_later, len_later = 0, 0  # set when admission starts (most steps admit nobody)

        def can_join_later(r: Request) -> bool:
            width = max(len_later, r.num_tokens + 1)
            return kv.geometry_for(rows_later + 1, width, cfg.kv_budget_bytes) is not None

        blocked = False
        for r in prefilling:
            gap = r.num_tokens - r.num_computed_tokens
            if r.status is not RequestStatus.RUNNING or gap <= 1 or tok_budget <= 0:
                continue
            n = fit(r, self._chunk_size(gap, tok_budget))
            while n == 0 and decode_step and self.running[-1] is not r:
                preempt_newest()  # an older request grows before newer ones keep theirs
                geom = geometry() or geom
                n = fit(r, self._chunk_size(gap, tok_budget))
            if n == 0:
                blocked = True
                continue
            self._add_chunk(r, n, prefills, private)
            tok_budget -= n

        if self.waiting:
            rows_later = len(self.running)
            if preempted:
                longest = max((x.num_tokens for x in self.running), default=0)
            len_later = longest + 1 if self.running else 0
        while not blocked and self.waiting and len(self.running) < cfg.max_num_seqs and tok_budget > 0:
            r = self.waiting[0]
            if not can_join_later(r):
                break
            if r.num_tokens == 1:  # a one-token prompt is decode-ready on arrival: it joins the pool
                if not decode_step:
                    break
                pool.append(r)
                width_before, width = width, max(width, r.num_computed_tokens + decode_step)
                trial = geometry()
                if trial is None:
                    pool.pop()
                    width = width_before
                    break
                geom = trial
                in_pool.add(r.request_id)
                tok_budget -= 1
            else:
                n = fit(r, self._chunk_size(r.num_tokens, tok_budget))
                if n == 0:
                    break
                self._add_chunk(r, n, prefills, private)
                tok_budget -= n
            self.waiting.popleft()
            r.status = RequestStatus.RUNNING
            self.running.append(r)
            rows_later, len_later = rows_later + 1, max(len_later, r.num_tokens + 1)
            ids = r.all_token_ids()
            new_requests.append(NewRequest(r.request_id, tuple(ids) if ids else None, r.sampling))

        if not decode_step and not prefills:
            return None
        kv_bytes = kv.commit(geom, in_pool, private)
        decodes = pool if decode_step else []
        return StepPlan(  # positional: this runs every step
            self.num_steps,
            tuple(sorted(free_ids)) if free_ids else (),
            tuple(new_requests),
            tuple(prefills),
            tuple([r.request_id for r in decodes]),
            tuple([r.num_computed_tokens for r in decodes]),
            geom,
            kv_bytes,
            self._lookahead(decodes, geom, width) if not (prefills or new_requests) else 1,
        )

    def _chunk_size(self, gap: int, tok_budget: int) -> int:
        n = min(self.config.prefill_step_size, gap, tok_budget)
        # Only a request's final chunk may end off a KV_STEP boundary.
        return n if n == gap else round_down(n, KV_STEP)

    @staticmethod
    def _add_chunk(r: Request, n: int, prefills: list[PrefillChunk], private: dict[int, int]) -> None:
        c = r.num_computed_tokens
        prefills.append(PrefillChunk(r.request_id, c, n, sample=c + n == r.num_tokens))
        private[r.request_id] = private_cache_tokens(c + n)

    def _lookahead(self, decodes: list[Request], geom: PoolGeometry, width: int) -> int:
        """How many identical pure-decode steps this plan may stand for: until a request finishes or
        the pool must grow (`width`: its longest row after the first). Queued requests cannot be
        admitted meanwhile: memory only grows."""
        limit = self.config.max_lookahead_steps
        if limit == 1 or not decodes:
            return 1
        steps = min(limit, geom.capacity_tokens - width + 1)
        for r in decodes:  # a plain loop: comprehensions cost a frame each in Python 3.11
            sampling = r.sampling
            if r.prompt_token_ids is not None and not sampling.ignore_eos:
                return 1  # a real token could be EOS
            left = sampling.max_tokens - r.num_output_tokens
            if left < steps:  # noqa: PLR1730
                steps = left
        return max(1, steps)

    def _preempt(self, request: Request, free_ids: list[int]) -> None:
        self.running.remove(request)
        self.kv.release(request.request_id)
        free_ids.append(request.request_id)
        request.status = RequestStatus.WAITING
        request.num_computed_tokens = 0
        request.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(request)

    # -- results -------------------------------------------------------------------------------
    def update_from_output(self, plan: StepPlan, result: StepResult) -> list[Request]:
        """Advance counters by what ran; return the requests that finished."""
        k = len(result.step_durations_s)
        if k != 1 and (k > plan.num_steps or plan.prefills):
            raise ValueError(f"executor ran {k} steps of a plan allowing {plan.num_steps}")
        requests, running = self.requests, RequestStatus.RUNNING
        prefill_ids = set()
        for chunk in plan.prefills:
            r = requests.get(chunk.request_id)
            if r is not None and r.status is running:
                r.num_computed_tokens += chunk.num_tokens
                prefill_ids.add(chunk.request_id)
        finished: list[Request] = []
        step = self.num_steps
        end = step + k
        token_ids = result.token_ids
        for i, rid in enumerate(result.sampled_ids):  # every decode row and sampling prefill
            r = requests.get(rid)
            if r is None or r.status is not running:
                continue
            if rid not in prefill_ids:
                r.num_computed_tokens += k
            out = r.num_output_tokens = r.num_output_tokens + k
            runs = r.token_runs  # this is the hot loop: one run per stretch of consecutive steps
            if runs and runs[-1][1] == step:
                runs[-1][1] = end
            else:
                runs.append([step, end])
            if token_ids is None:  # simulation: no token ids, only the length can stop a request
                if out >= r.sampling.max_tokens:
                    self._finish(r, "length")
                    finished.append(r)
                continue
            new = [token_ids[s][i] for s in range(k)]
            r.output_token_ids.extend(new)
            reason = self._stop_reason(r, new[-1])
            if reason is not None:
                self._finish(r, reason)
                finished.append(r)
        self.num_steps += k
        return finished

    @staticmethod
    def _stop_reason(r: Request, last_token: int) -> str | None:
        if not r.sampling.ignore_eos and last_token in r.eos_token_ids:
            return "stop"
        if last_token in r.sampling.stop_token_ids:
            return "stop"
        if r.num_output_tokens >= r.sampling.max_tokens:
            return "length"
        return None

    def _finish(self, r: Request, reason: str) -> None:
        r.status = RequestStatus.FINISHED
        r.finish_reason = reason
        self.running.remove(r)
        del self.requests[r.request_id]
        self._pending_free.append(r.request_id)

    # -- integrity -----------------------------------------------------------------------------
    def check_integrity(self) -> None:
        """The KV account matches the running requests and stays inside the budget (tests call
        this after every step)."""
        computed = {r.request_id: r.num_computed_tokens for r in self.running}
        for r in self.waiting:
            if r.num_computed_tokens or self.kv.holds(r.request_id):
                raise KVAccountError(f"waiting request {r.request_id} holds KV")
        self.kv.check(computed, releasing=set(self._pending_free))
        if len(self.running) > self.config.max_num_seqs:
            raise KVAccountError(f"{len(self.running)} running > max_num_seqs")
