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

from batchsim.scheduler.advance import advance_decoded
from batchsim.scheduler.config import SchedulerConfig
from batchsim.scheduler.decode_plan import decode_plan
from batchsim.scheduler.kv_manager import KVAccountError, KVManager
from batchsim.scheduler.lazy_rows import REQUEST_ID, LazyRows
from batchsim.scheduler.lookahead import lookahead_steps
from batchsim.scheduler.plan import NewRequest, StepPlan, StepResult, made
from batchsim.scheduler.pool_geometry import PAGE_TOKENS
from batchsim.scheduler.request import (
    ABORTED,
    FINISHED,
    RUNNING,
    WAITING,
    Request,
    RequestStatus,
    stop_reason,
)
from batchsim.scheduler.spec_budget import kept_tokens, row_spec_tokens
from batchsim.scheduler.step_budget import StepBudget

_NO_IDS: frozenset[int] = frozenset()


class Scheduler:
    def __init__(self, config: SchedulerConfig):
        self.config = config
        self.kv = KVManager(
            config.kv_budget_bytes, config.layout, config.row_step, config.max_num_seqs,
            paged=config.kv_layout == "paged", prefix_cache=config.reuse_prefixes,
        )
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []  # in admission order: the newest is preempted first
        self.requests: dict[int, Request] = {}  # waiting or running
        self.num_steps = 0  # steps executed so far; token_runs index into this count
        self.num_preemptions = 0
        self.num_rejected = 0
        # Tokens admitted requests had to compute (prompt, or prompt + output after a
        # preemption), and those the prefix cache held (vLLM's prefix-cache queries and hits).
        self.num_query_tokens = 0
        self.num_hit_tokens = 0
        # The last step's rows whose accepted drafts a stop cut: request id -> drafts kept.
        self.cut_drafts: dict[int, int] = {}
        # The last step's sampled rows (indices into sampled_ids) whose request was gone when its
        # output came (aborted mid-step): they emitted nothing.
        self.dropped_rows: tuple[int, ...] = ()
        # Finished, aborted or preempted requests whose KV the next plan frees.
        self.releasing: list[int] = []
        # The last plan and its decode rows' requests (update_from_output's simulated fast path).
        self._planned: StepPlan | None = None
        self._planned_rows: list[Request] = []
        # Simulated decode rows advanced lazily (lazy_rows.py): running[:len(lazy.rows)]. Padded and
        # without drafts only (paged blocks and drafts read every row's counters).
        self.lazy = LazyRows()
        self._lazy_ok = config.kv_layout != "paged" and not config.spec_tokens
        # Rows whose prefill ends join them at once (LazyRows.join_ready): every decode-ready
        # row decodes in the next plan, as it does unless a plan may only prefill.
        self._join_ready = self._lazy_ok and config.policy != "prefill-first"
        self._admissible: set[int] = set()  # totals rejection_reason passed (it reads no more)

    # -- requests in and out -------------------------------------------------------------------
    def add_request(self, request: Request) -> bool:
        """Queue a request, or reject it (REJECTED, why in finish_reason): it can never run."""
        total = request.num_prompt_tokens + request.sampling.max_tokens
        if total not in self._admissible:  # (most arrivals: a total seen before, no frames)
            reason = self.rejection_reason(request)
            if reason is not None:
                request.status = RequestStatus.REJECTED
                request.finish_reason = reason
                self.num_rejected += 1
                return False
            self._admissible.add(total)
        if request.request_id in self.requests:
            raise ValueError(f"request id {request.request_id} is already queued or running")
        request.status = WAITING
        self.waiting.append(request)
        self.requests[request.request_id] = request
        return True

    def rejection_reason(self, request: Request) -> str | None:
        cfg = self.config
        total = request.num_prompt_tokens + request.sampling.max_tokens  # max_total_tokens
        if total > cfg.max_model_len:
            return (f"prompt ({request.num_prompt_tokens}) + max_tokens "
                    f"({request.sampling.max_tokens})"
                    f" = {total} tokens exceeds the model context of {cfg.max_model_len}")
        alone = self.kv.cache.alone_bytes(total)
        if alone > cfg.kv_budget_bytes:
            return (f"its KV cache at full length ({alone} bytes) exceeds the KV budget "
                    f"({cfg.kv_budget_bytes} bytes)")
        return None

    def abort(self, request_id: int) -> Request | None:
        request = self.requests.pop(request_id, None)
        if request is None:
            return None
        self.lazy.settle()
        if request.status is WAITING:
            self.waiting.remove(request)
        else:
            self.running.remove(request)
            self.releasing.append(request_id)
        request.status = ABORTED
        request.finish_reason = "abort"
        return request

    def has_work(self) -> bool:
        return bool(self.waiting or self.running or self.releasing)

    # -- planning ------------------------------------------------------------------------------
    def schedule(self) -> StepPlan:
        free_ids = self.releasing
        self.releasing = []
        for rid in free_ids:
            self.kv.release(rid)
        planned = decode_plan(self.lazy, self.running, self.waiting, self.kv, self.config,
                              self.requests, self.num_steps, free_ids)  # most simulated plans
        if planned is not None:
            self._planned, self._planned_rows, tokens = planned
            self.num_query_tokens += tokens  # admitted ones' (none cached: num_hit_tokens stays)
            return self._planned
        if self.config.policy == "prefill-first":
            plan = self._plan(free_ids, decode_step=False)
            if plan is not None:
                return plan
        plan = self._plan(free_ids, decode_step=True)
        assert plan is not None
        return plan

    def _plan(self, free_ids: list[int], decode_step: bool) -> StepPlan | None:
        """One step's plan. decode_step=False plans prefill only; None if there is none."""
        pool, prefilling, width, longest = self._split_running(decode_step)
        n, ids = len(self.lazy.rows), self.lazy.id_set.copy()  # the pool's ids: the lazy rows'
        if len(pool) > n:  # and the rest's (most plans: every row is lazy)
            ids.update(map(REQUEST_ID, pool[n:]))
        budget = StepBudget(self.kv, self.config, pool, width, decode_step, ids)
        preemptions_before = self.num_preemptions
        while not budget.fit_pool():  # decoding rows must grow: preempt from the newest end
            if not self.running:
                raise KVAccountError("nothing running, yet the empty pool does not fit")
            self._preempt_newest(budget, free_ids)
        blocked = prefilling and self._continue_prefills(budget, prefilling, free_ids)
        new_requests: list[NewRequest] = []
        if self.waiting and not blocked and len(self.running) < self.config.max_num_seqs:
            if self.num_preemptions != preemptions_before:  # the longest may have left `running`
                longest = max((r.num_tokens for r in self.running), default=0)
            new_requests = self._admit_waiting(budget, longest)
        if not decode_step and not budget.prefills:
            return None
        return self._step_plan(budget, free_ids, new_requests)

    def _split_running(self, decode_step: bool) -> tuple[list[Request], list[Request], int, int]:
        """The pool's rows after this step, the requests still prefilling, the rows' width (the
        longest row after this step) and the longest running request (prompt + output so far)."""
        prefilling: list[Request] = []
        members = self.kv.pool_members
        lazy, running = self.lazy, self.running
        n = len(lazy.rows)
        if n:  # decoding rows, all in the pool
            pool, rest = running[:n], running[n:]
            width, longest = lazy.widest_longest()
            width += decode_step
        else:
            pool, rest, width, longest = [], running, 0, 0
        # One pass, with comparisons rather than max(): this runs every step over every request.
        for r in rest:
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
        return pool, prefilling, width, longest

    def _continue_prefills(self, budget: StepBudget, prefilling: list[Request],
                           free_ids: list[int]) -> bool:
        """A chunk for each request part-way through its prompt, oldest first. True: one got none
        (blocked), so nobody is admitted this step."""
        blocked = False
        for r in prefilling:
            gap = r.num_tokens - r.num_computed_tokens
            if r.status is not RUNNING or gap <= 1 or budget.tokens_left <= 0:
                continue  # preempted this step, or no tokens left
            n = budget.chunk(r, gap)
            while n == 0 and budget.decode_step and self.running[-1] is not r:
                self._preempt_newest(budget, free_ids)  # an older request grows before newer ones
                budget.refit_pool()
                n = budget.chunk(r, gap)
            if n == 0:
                blocked = True
                continue
            budget.add_chunk(r, n)
        return blocked

    def _admit_waiting(self, budget: StepBudget, longest: int) -> list[NewRequest]:
        """Admit from the head of the queue while its first chunk fits this step. Admission also
        asks whether the request could decode beside everyone running, so a request that would only
        be preempted again when it joins the pool waits instead."""
        kv, cfg, waiting, running = self.kv, self.config, self.waiting, self.running
        new_requests: list[NewRequest] = []
        rows_later = len(running)  # rows and longest row once everyone running decodes
        len_later = longest + 1 if running else 0
        blocks_later = kv.blocks_after(running) if kv.paged else 0
        while waiting and len(running) < cfg.max_num_seqs and budget.tokens_left > 0:
            r = waiting[0]
            tokens = r.num_prompt_tokens + r.num_output_tokens  # num_tokens, without a frame
            n_later = tokens + 1 if tokens >= len_later else len_later  # max() without a call
            blocks = blocks_later + kv.admit_blocks(r) if kv.paged else 0
            if kv.geometry_for(rows_later + 1, n_later, cfg.kv_budget_bytes, blocks) is None:
                break
            if tokens == 1:  # a one-token prompt is decode-ready: it joins the pool
                if not budget.add_row(r):
                    break
            else:
                n = budget.first_chunk(r)
                if n == 0:
                    break
                budget.add_chunk(r, n)
            waiting.popleft()
            r.status = RUNNING
            running.append(r)
            rows_later, len_later, blocks_later = rows_later + 1, n_later, blocks
            ids = r.all_token_ids() if r.prompt_token_ids is not None else None  # (simulated)
            cached = (r.block_hashes or ())[:r.num_computed_tokens // PAGE_TOKENS]
            new_requests.append(made(NewRequest, (r.request_id, tuple(ids) if ids else None,
                                                  r.sampling, r.num_prompt_tokens, cached)))
            # Prefix-cache counters (its computed tokens: the cached ones)
            self.num_query_tokens += tokens
            self.num_hit_tokens += r.num_computed_tokens
            if not r.num_preemptions:
                r.num_cached_tokens = r.num_computed_tokens
        return new_requests

    def _step_plan(self, budget: StepBudget, free_ids: list[int],
                   new_requests: list[NewRequest]) -> StepPlan:
        kv_bytes = budget.commit(self.requests)
        cache_ops, prefix = None, self.kv.prefix
        if prefix is not None and prefix.has_ops(budget.prefills, self.requests):
            cache_ops, kv_bytes = self.kv.cache_ops(kv_bytes, budget.prefills, self.requests)
        decodes = budget.pool if budget.decode_step else []
        prefills = budget.prefills
        spec = budget.spec_k and tuple([row_spec_tokens(r, budget.spec_k) for r in decodes])
        pure_decode = not (prefills or new_requests or spec)
        self._planned_rows = decodes
        ids, positions = self.lazy.columns(decodes)
        steps = lookahead_steps(decodes, budget.geom, budget.width, self.config.max_lookahead_steps,
                                self.kv, self.lazy) if pure_decode else 1
        self._planned = plan = made(StepPlan, (  # every field, in order: this runs every step
            self.num_steps, tuple(sorted(free_ids)) if free_ids else (), tuple(new_requests),
            tuple(prefills), ids, positions, budget.geom, kv_bytes, steps,
            spec if spec and any(spec) else (), cache_ops, budget.width if decodes else 0))
        return plan

    def _preempt_newest(self, budget: StepBudget, free_ids: list[int]) -> None:
        victim = self.running[-1]
        self._preempt(victim, free_ids)
        budget.drop(victim)

    def _preempt(self, request: Request, free_ids: list[int]) -> None:
        self.lazy.settle()
        self.running.remove(request)
        self.kv.release(request.request_id)
        free_ids.append(request.request_id)
        request.status = WAITING
        request.num_computed_tokens = 0
        request.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(request)

    # -- results -------------------------------------------------------------------------------
    def update_from_output(self, plan: StepPlan, result: StepResult) -> list[Request]:
        """Advance counters by what ran; return the requests that finished."""
        _, sampled, token_ids, durations, _, accepted, _ = result  # unpacked once: field reads
        k, prefills = len(durations), plan.prefills  # of a named tuple are slow (unspecialized)
        if k != 1 and (k > plan.num_steps or prefills):
            raise ValueError(f"executor ran {k} steps of a plan allowing {plan.num_steps}")
        requests, running, finished = self.requests, RUNNING, []
        prefill_ids = set() if prefills else _NO_IDS  # (most plans: no set made)
        for chunk in prefills:
            r = requests.get(chunk.request_id)
            if r is not None and r.status is running:
                r.num_computed_tokens += chunk.num_tokens
                prefill_ids.add(chunk.request_id)
        step = self.num_steps
        end = self.num_steps = step + k  # (nothing below reads it)
        self.cut_drafts = self.cut_drafts and {}  # a new one only after cuts (most plans: none)
        self.dropped_rows = ()
        first = (self._advance_simulated(plan, sampled, step, k, finished)
                 if token_ids is None and accepted is None and plan is self._planned else 0)
        if first:  # simulated decode rows: counters only (advance.py, lazy_rows.py)
            if first == len(sampled):  # no other row sampled (most plans): nothing more to do
                return finished
            sampled = sampled[first:]
        else:  # the general path reads and writes every row's counters
            self.lazy.settle()
        for i, rid in enumerate(sampled, first):  # every decode row and sampling prefill
            r = requests.get(rid)
            if r is None or r.status is not running:
                self.dropped_rows += (i,)
                continue
            n = k  # tokens this row emitted: one per step, or accepted drafts and one (k is 1)
            new = reason = None
            if token_ids is not None:
                new, reason = self._kept(r, i, k, token_ids, accepted)
                n = len(new)
            elif accepted is not None:  # simulated drafts: only their count
                n += len(accepted[i])
            if rid not in prefill_ids:
                r.num_computed_tokens += n
            out = r.num_output_tokens = r.num_output_tokens + n
            runs = r.token_runs  # this is the hot loop: one run per stretch of consecutive steps
            if runs and runs[-1][1] == step:
                runs[-1][1] = end
            else:
                runs.append([step, end])
            if n > k:  # tokens emitted at the same step: a run of that one step each
                runs.extend([step, end] for _ in range(n - k))
            if new is None:  # simulation: no token ids, only the length can stop a request
                if out >= r.sampling.max_tokens:
                    self._finish(r, "length")
                    finished.append(r)
                continue
            r.output_token_ids.extend(new)
            reason = reason or stop_reason(r, new)
            if reason is not None:
                self._finish(r, reason)
                finished.append(r)
        if sampled and self._join_ready and token_ids is None and accepted is None:
            self.lazy.join_ready(self.running, end)  # prefills that sampled: they decode next
        return finished

    def _kept(self, r: Request, i: int, k: int, token_ids: tuple[tuple[int, ...], ...],
              accepted: tuple[tuple[int, ...], ...] | None) -> tuple[list[int], str | None]:
        """Row i's tokens of a step with token ids (kept_tokens: a stop cuts its drafts)."""
        return kept_tokens(r, [token_ids[s][i] for s in range(k)],
                           accepted[i] if accepted is not None else (), self.cut_drafts)

    def _advance_simulated(self, plan: StepPlan, sampled: tuple[int, ...], step: int, k: int,
                           finished: list[Request]) -> int:
        """The last plan made (`plan`)'s decode rows, when its result has no token ids nor drafts
        (the caller asks) and sampled them first (`sampled`) as planned, decoded k steps from
        `step`: the lazy ones by one count, the rest row by row (then joining the lazy ones where
        they can). How many rows (0: none, or the general path's to advance)."""
        ids, rows = plan.decode_ids, self._planned_rows
        if not rows or (sampled is not ids and sampled[:len(ids)] != ids):
            return 0
        n = len(self.lazy.rows)
        for r in self.lazy.advance(k, self.running):  # (out of running already)
            self._finish(r, "length", listed=False)
            finished.append(r)
        for r in advance_decoded(rows[n:], step, k) if len(rows) > n else ():
            self._finish(r, "length")
            finished.append(r)
        if len(rows) > n and self._lazy_ok:  # after the finishes: running is the lazy prefix
            self.lazy.absorb(rows, n, self.running)
        return len(rows)

    def settle(self) -> None:
        """Write the lazily advanced rows' counters back to their requests (for whoever reads a
        running request's counters from outside: the end of a run, tests)."""
        self.lazy.settle()

    def _finish(self, r: Request, reason: str, listed: bool = True) -> None:
        r.status = ABORTED if reason == "error" else FINISHED
        r.finish_reason = reason
        if listed:  # still in running (LazyRows.advance takes its finished rows out itself)
            self.running.remove(r)
        del self.requests[r.request_id]
        self.releasing.append(r.request_id)

    # -- integrity -----------------------------------------------------------------------------
    def check_integrity(self) -> None:
        """The KV account matches the running requests and stays inside the budget (tests call
        this after every step)."""
        computed = {r.request_id: r.num_computed_tokens for r in self.running}
        computed.update(self.lazy.computed())
        for r in self.waiting:
            if r.num_computed_tokens or self.kv.holds(r.request_id):
                raise KVAccountError(f"waiting request {r.request_id} holds KV")
        self.kv.check(computed, releasing=set(self.releasing))
        if len(self.running) > self.config.max_num_seqs:
            raise KVAccountError(f"{len(self.running)} running > max_num_seqs")
