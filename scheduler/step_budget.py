"""One step's budget while the scheduler plans it: the decode pool's rows and width after the step,
the private prefill caches, the pool geometry that holds them within the KV budget, and the tokens
left for prefill. The scheduler decides who runs and who is preempted; the budget answers whether
it fits (vLLM's `allocate_slots -> None`, nano-vllm's `can_allocate`)."""

from __future__ import annotations

from batchsim.scheduler.chunk_fit import chunk_fit
from batchsim.scheduler.config import SchedulerConfig
from batchsim.scheduler.kv_bytes import PrivateCache
from batchsim.scheduler.kv_manager import KVManager
from batchsim.scheduler.plan import PrefillChunk, made
from batchsim.scheduler.pool_geometry import (
    PAGE_TOKENS,
    PoolGeometry,
    block_slack,
    cache_headroom,
    row_blocks,
)
from batchsim.scheduler.prefix_cache import prompt_block_hashes
from batchsim.scheduler.request import Request
from batchsim.scheduler.spec_budget import step_spec_tokens


class StepBudget:
    __slots__ = (
        "blocks",
        "budget_bytes",
        "cache",
        "decode_step",
        "geom",
        "in_pool",
        "kv",
        "max_num_batched_tokens",
        "pool",
        "prefill_step_size",
        "prefills",
        "private",
        "private_bytes",
        "spec_k",
        "spec_policy",
        "spec_tokens",
        "tokens_left",
        "width",
    )

    def __init__(self, kv: KVManager, config: SchedulerConfig, pool: list[Request], width: int,
                 decode_step: bool, pool_ids: set[int]):
        self.kv = kv
        self.budget_bytes = config.kv_budget_bytes
        self.cache = kv.cache
        self.prefill_step_size = config.prefill_step_size
        self.max_num_batched_tokens = config.max_num_batched_tokens
        self.decode_step = decode_step  # False: a prefill-only step (the pool's rows sit still)
        self.pool = pool  # rows after this step: decoding, or untouched in a prefill-only step
        self.in_pool = pool_ids  # their ids (the scheduler knows the lazy rows' without a loop)
        self.width = width  # the pool's longest row after this step, in tokens
        # paged: blocks the pool's rows hold after this step
        self.blocks = self._blocks() if kv.paged else 0
        # The prefill caches that stay private after this step.
        self.private: dict[int, PrivateCache] = {}
        self.private_bytes = 0  # what they hold (kept as they change)
        if kv.private and not pool_ids.issuperset(kv.private):  # most plans: the one joins
            in_pool = self.in_pool
            self.private = {rid: p for rid, p in kv.private.items() if rid not in in_pool}
            self.private_bytes = sum([p.kv_bytes for p in self.private.values()])
        self.geom: PoolGeometry | None = None  # set by fit_pool
        self.tokens_left = 0  # set by fit_pool
        self.prefills: list[PrefillChunk] = []
        self.spec_tokens, self.spec_policy = config.spec_tokens, config.spec_policy
        self.spec_k = 0  # drafts each decode row may verify this step (spec_budget.py)

    def geometry(self, reserve_bytes: int = 0) -> PoolGeometry | None:
        """The pool geometry for these rows in what the private caches leave; None: none fits."""
        room = self.budget_bytes - self.private_bytes - reserve_bytes
        if not self.pool:
            return self.kv.geometry_for(0, self.width, room, self.blocks)
        k = self.spec_k
        return self.kv.geometry_for(len(self.pool), self.width + k, room,
                                    self.blocks + self._draft_blocks() if k else self.blocks)

    def _draft_blocks(self) -> int:
        """Paged: blocks the rows' drafted tokens take this step beyond their own (the executor
        frees those its rows do not keep)."""
        k = self.spec_k
        if not k or not self.kv.paged:
            return 0
        step = self.decode_step
        return sum([row_blocks(r.num_computed_tokens + step + k)
                    - row_blocks(r.num_computed_tokens + step) for r in self.pool])

    def _blocks(self) -> int:
        kv = self.kv
        if not kv.paged:
            return 0
        step = self.decode_step
        if kv.shared is None:
            return sum([row_blocks(r.num_computed_tokens + step) for r in self.pool])
        return sum([kv.own_blocks(r.request_id, r.num_computed_tokens + step)
                    for r in self.pool]) + kv.held_cache_blocks()

    def fit_pool(self) -> bool:
        """Place the pool's rows (False: they do not fit); decode rows take one token each, and
        spec_k drafted tokens each while those fit (else this step does not speculate)."""
        rows = len(self.pool) if self.decode_step else 0
        if self.spec_tokens:  # else spec_k stays 0
            self.spec_k = step_spec_tokens(self.spec_tokens, self.spec_policy, rows,
                                           self.max_num_batched_tokens)
        self.geom = self.geometry()
        if self.geom is None and self.spec_k:
            self.spec_k = 0
            self.geom = self.geometry()
        self.tokens_left = self.max_num_batched_tokens - rows * (1 + self.spec_k)
        return self.geom is not None

    def refit_pool(self) -> None:
        """After rows were dropped: a tighter geometry if one fits, else the current one."""
        self.geom = self.geometry() or self.geom

    def drop(self, request: Request) -> None:
        """A preempted request leaves this step's rows and private caches."""
        rid = request.request_id
        private = self.private.pop(rid, None)
        if private is not None:
            self.private_bytes -= private.kv_bytes
        if rid in self.in_pool:
            self.in_pool.discard(rid)
            self.pool.remove(request)
            step = self.decode_step
            self.width = max((r.num_computed_tokens + step for r in self.pool), default=0)
            self.blocks = self._blocks()

    def chunk(self, request: Request, gap: int) -> int:
        """The largest prefill chunk toward `gap` tokens that fits this step's tokens and memory
        (dropping the pool's spare rows and capacity first, then whole KV steps of the chunk)."""
        free_bytes = self.budget_bytes - self.cache.pool_bytes(self.geom) - self.private_bytes
        held = self.kv.private.get(request.request_id)
        n, tighter, _ = chunk_fit(self.cache, held.kv_bytes if held is not None else 0,
                                  request.num_computed_tokens, gap, self.prefill_step_size,
                                  self.tokens_left, free_bytes, self.geometry)
        if tighter is not None:
            self.geom = tighter
        return n

    def first_chunk(self, r: Request) -> int:
        """The first chunk of a request being admitted, after the longest cached prefix of whole
        blocks (pinned for this step), or from its start when the hit and its prefill cache's copy
        of it do not fit together; 0: it does not fit."""
        prefix = self.kv.prefix
        hashes = prompt_block_hashes(r) if prefix is not None else ()
        if not hashes:  # nothing to reuse (prompt + output: num_tokens without a frame)
            return self.chunk(r, r.num_prompt_tokens + r.num_output_tokens)
        reused = hashes[:prefix.match(hashes, r.num_tokens)]
        if prefix.shared:
            return self._first_shared_chunk(r, reused)
        pinned = prefix.pin(reused) * prefix.block_bytes
        self.budget_bytes -= pinned
        r.num_computed_tokens = len(reused) * PAGE_TOKENS
        n = self.chunk(r, r.num_tokens - r.num_computed_tokens)
        if n == 0 and reused:
            prefix.unpin_step(reused)
            self.budget_bytes += pinned
            r.num_computed_tokens = 0
            n = self.chunk(r, r.num_tokens)
        return n

    def _first_shared_chunk(self, r: Request, reused: tuple[int, ...]) -> int:
        """first_chunk in the paged layout: the request holds its hit (pool blocks) until it is
        released, so the blocks nothing referenced join the pool's need."""
        prefix, geom = self.kv.shared, self.geom
        new = prefix.pin(reused, r.request_id)
        self.blocks += new
        r.num_computed_tokens = len(reused) * PAGE_TOKENS
        if new:
            self.geom = self.geometry()
        n = self.chunk(r, r.num_tokens - r.num_computed_tokens) if self.geom is not None else 0
        if n == 0 and reused:
            prefix.release(r.request_id)
            self.blocks -= new
            self.geom = geom
            r.num_computed_tokens = 0
            n = self.chunk(r, r.num_tokens)
        return n

    def add_chunk(self, request: Request, n: int) -> None:
        c = request.num_computed_tokens
        rid = request.request_id
        # the chunk reaches the last known token (num_tokens, without the property's frame)
        sample = c + n == request.num_prompt_tokens + request.num_output_tokens
        fresh = not request.num_output_tokens
        self.prefills.append(made(PrefillChunk, (rid, c, n, sample, fresh)))
        old = self.private.get(rid)
        new = self.private[rid] = self.cache.private(c, c + n)
        self.private_bytes += new.kv_bytes - old.kv_bytes if old is not None else new.kv_bytes
        self.tokens_left -= n

    def add_row(self, request: Request) -> bool:
        """A one-token prompt joins the decode pool on arrival, if this step decodes and it fits."""
        if not self.decode_step:
            return False
        width_before, blocks_before = self.width, self.blocks
        self.pool.append(request)
        if request.num_computed_tokens + 1 > width_before:
            self.width = request.num_computed_tokens + 1
        if self.kv.paged:
            self.blocks += row_blocks(request.num_computed_tokens + 1)
        trial = self.geometry()
        if trial is None:
            self.pool.pop()
            self.width, self.blocks = width_before, blocks_before
            return False
        self.geom = trial
        self.in_pool.add(request.request_id)
        self.tokens_left -= 1 + self.spec_k
        return True

    def commit(self, requests: dict[int, Request]) -> int:
        """Hand this step's KV to the manager (`requests`: by id, those of this step's chunks);
        returns the bytes it holds."""
        kv = self.kv  # paged: the blocks the rows hold (KVManager.peak_running_bytes)
        if kv.shared is not None:
            plain = self._fit_shared_cache(requests)
            held_blocks = self.blocks + self._draft_blocks() + plain
        else:
            held_blocks = self.blocks + self._draft_blocks() if kv.paged else 0
        return kv.commit(self.geom, self.in_pool, self.private, self.private_bytes, held_blocks)

    @staticmethod
    def _plain_prompt_blocks(r: Request) -> int:
        """Paged, caching: the full prompt blocks a request without block hashes (a simulated
        plain prompt) would hold beside its prefill cache the step that prefill ends, as a real
        run's every prompt does (_hold_prefilled): its running KV, not its pool's."""
        return 0 if prompt_block_hashes(r) else r.num_prompt_tokens // PAGE_TOKENS

    def _hold_prefilled(self, r: Request) -> None:
        """Paged: a request whose prefill ended holds the cached run of its prompt blocks, which
        its row will reference, when the pool holds those beside what it needs."""
        prefix = self.kv.shared
        held = prefix.num_held(r.request_id)
        new = prefix.hold_prefilled(r.request_id, r.block_hashes or ())
        if new:
            self.blocks += new
            geom = self.geometry()
            if geom is None:
                prefix.unhold(r.request_id, held)
                self.blocks -= new
            else:
                self.geom = geom

    def _fit_shared_cache(self, requests: dict[int, Request]) -> int:
        """Paged: rows joining this step give the cache their full prompt blocks (no copy, the
        same blocks), this step's chunks the blocks they complete (copies), and the pool holds the
        cache's unreferenced blocks beside what it needs, evicting the least recently used of
        those that do not fit. Returns the plain prompts' blocks (_plain_prompt_blocks)."""
        kv, prefix = self.kv, self.kv.shared
        for r in self.pool:
            if r.request_id not in kv.pool_members and r.block_hashes:
                prefix.adopt(r.request_id, r.block_hashes)
        plain = 0
        if self.prefills:
            prefix.cache_chunks(self.prefills, requests)
            for c in self.prefills:
                if c.sample:  # one walk: the prefills that end hold their blocks, plain or not
                    r = requests[c.request_id]
                    self._hold_prefilled(r)
                    plain += self._plain_prompt_blocks(r)
        free = prefix.num_unreferenced
        if not free:
            return plain
        need = self.blocks
        self.blocks = need + free
        geom = self.geometry()
        if geom is None or (geom.blocks != self.kv.pool.blocks
                            and geom.blocks < need + free + block_slack(need + free)):
            # At the budget (no slack fits): every step's private caches and joins would resize
            # the whole pool by a few blocks; the cache keeps the pool's blocks instead, or
            # when those no longer fit, what fits less cache_headroom.
            room = self.budget_bytes - self.private_bytes - self.cache.pool_bytes(self.geom)
            fit = self.geom.blocks - self._draft_blocks() + room // prefix.block_bytes
            held = self.kv.pool.blocks or 0
            keep = held if need <= held <= fit else max(need, fit - cache_headroom(fit))
            prefix.evict(need + free - keep)
            self.blocks = need + prefix.num_unreferenced
            geom = self.geometry()
            if geom is None and self.spec_k:  # the rows' drafted blocks no longer fit: no drafts
                self.spec_k = 0
                geom = self.geometry()
        self.blocks = need
        self.geom = geom
        return plain
