"""Runs step plans on a real model loaded by mlx-lm.

Per step: free finished rows, apply the scheduler's pool geometry, move newly prefilled requests
into the pool, run each prefill chunk on the request's own mlx-lm caches (fresh chunks of one length
together: prefill_groups.py), and run one forward pass
over every decoding request (each weight matrix multiplied once for B rows), then sample. Before
reading the sampled tokens it starts the next decode step (lookahead.py), which the next plan
takes or undoes. Every model decodes in decode_pool.DecodePool, one store per layer by the cache
kind prefill_cache.layers_of reads from the model."""

from __future__ import annotations

import time
from dataclasses import dataclass

import mlx.core as mx
from batchsim.scheduler import prefill_groups
from batchsim.scheduler.plan import NewRequest, PrefillChunk, StepPlan, StepResult
from batchsim.scheduler.request import SamplingParams
from batchsim.server.executors import acceptance, lookahead, prefill_cache, sampler, speculative
from batchsim.server.executors.base import ExecutorCaps
from batchsim.server.executors.decode_pool import DecodePool
from batchsim.server.executors.prefix_blocks import PoolPrefixBlocks, PrefixBlocks


@dataclass(slots=True)
class SeqState:
    token_ids: list[int]  # prompt + every sampled token
    sampling: SamplingParams
    cache: list | None = None  # private mlx-lm caches while prefilling
    num_prompt_tokens: int = -1  # token_ids before it are the prompt; -1: all at the start
    cached_hashes: tuple[int, ...] = ()  # cached blocks: its hit (paged: then all its row holds)

    def __post_init__(self) -> None:
        if self.num_prompt_tokens < 0:
            self.num_prompt_tokens = len(self.token_ids)


class MLXExecutor:
    caps = ExecutorCaps(real_compute=True, virtual_time=False, max_lookahead_steps=1,
                        needs_token_ids=True)

    def __init__(self, model, cache_limit_bytes: int | None = 4 << 30, kv_bits: int | None = None,
                 run_ahead: bool = True, kv_layout: str = "padded",
                 drafter: speculative.Drafter | None = None):
        self.model = model
        self.kv_layout = kv_layout  # the decode pool's: "padded" rows or "paged" blocks
        # Speculative decoding: drafts for the rows a plan lets verify (speculative.py).
        self.drafter = drafter
        # Run each decode step while the previous step's tokens are read (lookahead.py); not
        # with a drafter: a step's drafts need the previous step's tokens on the host.
        self.run_ahead = run_ahead and drafter is None
        device = mx.default_device()
        self._stream = None if device == mx.cpu else mx.new_thread_local_stream(device)
        self._ahead: lookahead.Ahead | None = None
        self.ahead_steps = {"used": 0, "undone": 0}
        self.dtype = prefill_cache.activation_dtype(model)
        self.kv_bits = kv_bits
        # Each layer's cache as arch_cache.Attention: the spec's own description.
        self.layers = prefill_cache.layers_of(model, self.dtype, kv_bits)
        self.pool = self._new_pool()
        self.seqs: dict[int, SeqState] = {}
        self._split_head = self._head_fn()
        if cache_limit_bytes is not None:
            # Keep freed buffers for reuse: re-faulting large buffers every step costs bandwidth.
            mx.set_cache_limit(cache_limit_bytes)

    def _head_fn(self):
        """The output projection alone, so a prefill computes logits for its last token only."""
        model = self.model
        if getattr(model.args, "tie_word_embeddings", False):
            return model.model.embed_tokens.as_linear
        return getattr(model, "lm_head", None)

    # -- the step ------------------------------------------------------------------------------
    def execute(self, plan: StepPlan, max_elapsed_s: float = float("inf")) -> StepResult:
        # On a GPU, MLX (>= 0.31.2) lets a thread run only the streams it owns: the engine's worker
        # thread gets its own instance of this stream, as mlx-lm's generation_stream does. (On the
        # CPU backend every thread may use the default stream, and `mx.synchronize()` waits for it.)
        if self._stream is None:
            return self._execute(plan, max_elapsed_s)
        with mx.stream(self._stream):
            return self._execute(plan, max_elapsed_s)

    def _execute(self, plan: StepPlan, max_elapsed_s: float) -> StepResult:
        t0 = time.perf_counter()
        ahead = self._settle_ahead(plan)
        self._free(plan.free_ids)
        for new in plan.new_requests:
            self._register(new)
        self.prefix_blocks.evict(plan.cache_ops)
        self.pool.resize(plan.pool)
        if self.drafter is not None:
            self.drafter.resize(plan.pool)
        self._join(plan)

        sampled_ids: list[int] = []  # aligned with the concatenated samples
        samples: list[mx.array] = []
        verified = None
        if plan.decode_ids:
            sampled_ids.extend(ahead.row_ids if ahead else self.pool.row_ids)
            if plan.decode_spec_tokens and ahead is None:
                verified = self._verify(plan)
                samples.append(verified.tokens)
            else:
                samples.append(ahead.tokens if ahead else self._decode())
        stale = len(sampled_ids) if ahead else 0  # run-ahead rows this plan frees are dropped
        for group in prefill_groups.groups(plan.prefills):
            tokens = self._prefill(group)
            if tokens is not None:
                sampled_ids.extend(c.request_id for c in group)
                samples.append(tokens)
        if plan.cache_ops is not None:
            self.prefix_blocks.store(plan.cache_ops, {
                rid: self.seqs[rid].cache for rid, _, _ in plan.cache_ops.store})
            for rid, hashes in plan.cache_ops.share:  # paged: referenced when it joins
                self.seqs[rid].cached_hashes = hashes
        pairs = self._read_tokens(plan, sampled_ids, samples)
        freed = set(plan.free_ids)
        pairs = _in_plan_order(plan, [p for i, p in enumerate(pairs)
                                      if i >= stale or p[0] not in freed])
        for rid, tok in pairs:
            if verified is not None:
                self.seqs[rid].token_ids.extend(verified.accepted.get(rid, ()))
            self.seqs[rid].token_ids.append(tok)
        elapsed = time.perf_counter() - t0
        return StepResult(
            step_index=plan.step_index,
            sampled_ids=tuple(rid for rid, _ in pairs),
            token_ids=(tuple(tok for _, tok in pairs),),
            step_durations_s=(elapsed,),
            kv_bytes=self.kv_bytes(),
            **(verified.result_fields([rid for rid, _ in pairs]) if verified else {}),
        )

    def _read_tokens(self, plan: StepPlan, sampled_ids: list[int],
                     samples: list[mx.array]) -> list[tuple[int, int]]:
        """This step's tokens, with the next decode step already running behind them."""
        if not samples:
            return []
        # a plain decode step's (B,) tokens as they are: no op the bare loop does not have
        flat = samples[0] if len(samples) == 1 and samples[0].ndim == 1 else mx.concatenate(
            [s.reshape(-1) for s in samples])
        mx.async_eval(flat)
        if self.run_ahead and (plan.decode_ids or not len(self.pool)):
            prefilled = [c.request_id for c in plan.prefills if c.sample]
            self._ahead = self._run_ahead(flat, sampled_ids, prefilled)
        if self._ahead is None:
            mx.eval(flat, self.pool.arrays())
        return list(zip(sampled_ids, flat.tolist()))

    # -- the step run ahead (lookahead.py) -----------------------------------------------------
    def _run_ahead(self, flat: mx.array, sampled_ids: list[int],
                   prefilled: list[int]) -> lookahead.Ahead | None:
        pool = self.pool
        cached = {rid: len(self.seqs[rid].token_ids) for rid in prefilled}
        shared = {rid: self.prefix_blocks.shared_blocks(self.seqs[rid].cached_hashes)
                  for rid in prefilled}
        joiners = lookahead.next_rows(pool, prefilled, cached, shared)
        if joiners is None:
            return None
        states = pool.states()
        for rid in joiners:
            pool.add(rid, self.seqs[rid].cache, cached[rid], shared[rid])
        lengths, rows = list(pool.lengths), list(pool.row_ids)
        tokens = self._forward(lookahead.gather_inputs(flat, sampled_ids, rows), rows, ahead=1)
        mx.async_eval(tokens, pool.arrays())
        return lookahead.Ahead(rows, tokens, lengths, joiners, states)

    def _settle_ahead(self, plan: StepPlan) -> lookahead.Ahead | None:
        """The step run ahead if this plan is it; otherwise undone."""
        ahead, self._ahead = self._ahead, None
        if ahead is None:
            return None
        if ahead.serves(plan):
            for rid in ahead.joined:
                self.seqs[rid].cache = None
            self.ahead_steps["used"] += 1
            return ahead
        self.pool.undo_step(ahead.lengths, ahead.states, ahead.joined)
        self.ahead_steps["undone"] += 1
        return None

    def adopt_prefilled(self, rid: int, token_ids: list[int], sampling: SamplingParams,
                        cache: list) -> None:
        """A request whose prompt `token_ids` already sits in `cache` (its private mlx-lm
        caches, as a finished prefill leaves them): it joins the pool at its first decode."""
        self.seqs[rid] = SeqState(list(token_ids), sampling, cache)

    def reset(self) -> None:
        self._ahead = None
        for rid in self.seqs if self.drafter is not None else ():
            self.drafter.forget(rid)
        self.pool = self._new_pool()
        if self.drafter is not None:
            self.drafter.resize(self.pool.geometry)  # emptied with the target's
        self.seqs.clear()

    def end_run(self) -> None:
        self.reset()
        mx.eval(self.pool.arrays())  # made on this thread's stream, which ends with the run
        mx.synchronize()  # and the step run ahead, if one was computing

    def _new_pool(self) -> DecodePool:
        """A fresh decode pool and prefix cache (scheduler/prefix_cache.py): paged, the cache's
        blocks are the pool's."""
        pool = DecodePool(self.layers, self.dtype, self.kv_bits, self.kv_layout == "paged")
        self.prefix_blocks = PoolPrefixBlocks(pool) if pool.paged else PrefixBlocks()
        return pool

    @property
    def cache_layout(self):
        """What the pool and the private caches hold, by layer kind (the scheduler's pricing);
        a draft model's rows beside the pool's (speculative.Drafter.cache)."""
        cache = self.pool.layout.cache
        return cache.with_draft(self.drafter.cache) if self.drafter is not None else cache

    @property
    def kv_bytes_per_token(self) -> int:
        """K and V of every layer, in the activation dtype (what the pool holds per token)."""
        return self.pool.layout.kv_bytes_per_token

    def kv_bytes(self) -> int:
        private = sum(c.nbytes for s in self.seqs.values() if s.cache for c in s.cache)
        drafter = self.drafter.nbytes if self.drafter is not None else 0
        return self.pool.nbytes + private + self.prefix_blocks.nbytes + drafter

    # -- pieces --------------------------------------------------------------------------------
    def _free(self, request_ids: tuple[int, ...]) -> None:
        if not request_ids:
            return
        gone = set(request_ids)
        self.pool.remove(gone)
        for rid in gone:
            self.seqs.pop(rid, None)
            if self.drafter is not None:
                self.drafter.forget(rid)

    def _register(self, new: NewRequest) -> None:
        if new.token_ids is None:
            raise ValueError(f"request {new.request_id}: the MLX executor needs token ids")
        seq = self.seqs[new.request_id] = SeqState(list(new.token_ids), new.sampling,
                                                   num_prompt_tokens=new.num_prompt_tokens or -1)
        if new.cached_hashes:
            seq.cache = self.prefix_blocks.prefill_cache(new.cached_hashes)
            seq.cached_hashes = new.cached_hashes

    def _join(self, plan: StepPlan) -> None:
        in_pool = self.pool.layout.in_pool
        for rid, pos in zip(plan.decode_ids, plan.decode_positions):
            if rid in in_pool:
                continue
            seq = self.seqs[rid]
            self.pool.add(rid, seq.cache, pos, self.prefix_blocks.shared_blocks(seq.cached_hashes))
            seq.cache = None
        if len(self.pool) != len(plan.decode_ids) and plan.decode_ids:
            raise RuntimeError("decode plan does not cover every pool row")

    def _prefill(self, group: list[PrefillChunk]) -> mx.array | None:
        """One forward pass over the chunks of `group` (one chunk, or fresh chunks of one length:
        prefill_groups.py) on their private caches; the sampled tokens if they sample."""
        rids = [c.request_id for c in group]
        start, n, sample = group[0].start, group[0].num_tokens, group[0].sample
        seqs = [self.seqs[rid] for rid in rids]
        cache = seqs[0].cache if len(group) == 1 else None
        if cache is None:
            if start != 0:
                raise RuntimeError(f"request {rids[0]}: prefill resumes at {start} without a cache")
            cache = prefill_cache.new_private_cache(self.layers, self.kv_bits)
        inputs = mx.array([seq.token_ids[start : start + n] for seq in seqs])
        if not sample:
            self.model.model(inputs, cache=cache)
            mx.eval([c.state for c in cache])
            logits = None
        elif self._split_head is not None:
            logits = self._split_head(self.model.model(inputs, cache=cache)[:, -1, :])
        else:
            logits = self.model(inputs, cache=cache)[:, -1, :]
        rows = [cache] if len(group) == 1 else prefill_cache.split_rows(cache, len(group))
        for seq, row in zip(seqs, rows):
            seq.cache = row
        return None if logits is None else self._sample(logits, rids)

    def _decode(self) -> mx.array:
        rows = self.pool.row_ids
        return self._forward(mx.array([self.seqs[rid].token_ids[-1] for rid in rows])[:, None],
                             rows)

    def _verify(self, plan: StepPlan) -> speculative.Verified:
        """One forward pass over each row's last token and its drafts; rows keep the drafts the
        acceptance rule keeps and the token after them (acceptance.py)."""
        pool, rows, seqs = self.pool, self.pool.row_ids, self.seqs
        budget = dict(zip(plan.decode_ids, plan.decode_spec_tokens))
        drafts = self.drafter.propose(rows, [seqs[rid] for rid in rows],
                                      [budget.get(rid, 0) for rid in rows])
        n = 1 + max(len(d.tokens) for d in drafts)
        if n == 1:
            return speculative.Verified(self._decode(), {}, {})
        inputs = mx.array([[seqs[rid].token_ids[-1], *d.tokens] + [0] * (n - 1 - len(d.tokens))
                           for rid, d in zip(rows, drafts)])
        lengths = list(pool.lengths)
        logits = self.model(inputs, cache=pool.layer_views(n))  # (B, n, V)
        kept, tokens = acceptance.accept(logits, rows, [seqs[rid] for rid in rows], drafts)
        pool.keep(lengths, [a + 1 for a in kept])
        return speculative.Verified(
            tokens, {rid: d.tokens[:a] for rid, d, a in zip(rows, drafts, kept)},
            {rid: len(d.tokens) for rid, d in zip(rows, drafts)})

    def _forward(self, inputs: mx.array, rows: list[int], ahead: int = 0) -> mx.array:
        """One forward pass over the pool's rows; `ahead`: tokens not yet in token_ids (then
        `inputs` are those tokens)."""
        logits = self.model(inputs, cache=self.pool.layer_views())[:, -1, :]
        return self._sample(logits, rows, ahead, inputs if ahead else None)

    def _sample(self, logits: mx.array, rids: list[int], ahead: int = 0,
                pending: mx.array | None = None) -> mx.array:
        """Each row as its request asks (sampler.py); greedy rows: the argmax."""
        return sampler.sample(logits, rids, [self.seqs[r] for r in rids], ahead, pending)


def _in_plan_order(plan: StepPlan, pairs: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """StepResult's order (scheduler/plan.py): the decode rows as plan.decode_ids lists them (the
    pool holds them in its own row order), then the sampling prefills, already in plan order."""
    n = len(plan.decode_ids)
    if [rid for rid, _ in pairs[:n]] == list(plan.decode_ids):
        return pairs
    token = dict(pairs[:n])
    return [(rid, token[rid]) for rid in plan.decode_ids] + pairs[n:]
