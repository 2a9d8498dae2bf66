"""The `draft` drafter: a second, smaller model sharing the tokenizer proposes each row's next k
tokens (greedily, or drawn at the row's temperature: q of the rejection rule, acceptance.py).

Every row drafts in the same forward passes, as the target decodes: the draft model has its own
decode pool (decode_pool.DecodePool, each row's cache at its own position). A row new to it
prefills its context but the last token on a private cache and joins the pool (what the simulator
prices as the drafter's catch-up: spec_price.catch_up_s). Each step, every row is first cut back
to what the target kept of its drafts (the rest is never read again, as after a verify step:
DecodePool.keep); then one forward feeds each row the tokens it has not seen (padded to the
longest, as a verify step is), and K - 1 more forwards one token each. All rows draft the step's
largest K; a row is handed the K it asked for. Tokens stay on the device until the last draft."""

from __future__ import annotations

import mlx.core as mx
from batchsim.scheduler.config import SchedulerSettings
from batchsim.scheduler.pool_geometry import EMPTY_POOL, next_geometry
from batchsim.server.executors import prefill_cache, sampler
from batchsim.server.executors.acceptance import KEY_DRAFT, position_key
from batchsim.server.executors.decode_pool import DecodePool
from batchsim.server.executors.speculative import Draft

_ROW_STEP = SchedulerSettings.row_step  # the draft pool's rows grow as the target's do
# No caps of the draft pool's own: it holds the rows the target's scheduler admitted, whatever
# their number and bytes (next_geometry's max_rows and max_bytes, set past any real pool).
_UNCAPPED_ROWS = 1 << 30
_UNCAPPED_BYTES = 1 << 62


class DraftModelDrafter:
    def __init__(self, model):
        self.model = model
        dtype = prefill_cache.activation_dtype(model)
        self.pool = DecodePool(prefill_cache.layers_of(model, dtype), dtype)
        self._held: dict[int, list[int]] = {}  # request id -> the tokens its pool row holds

    def propose(self, rids: list[int], seqs: list[sampler.History],
                ks: list[int]) -> list[Draft]:
        k = max(ks, default=0)
        if k <= 0:
            return [Draft([]) for _ in rids]
        by_id = dict(zip(rids, seqs))
        self._admit(by_id, dict(zip(rids, ks)), k)
        rows = self.pool.row_ids
        row_seqs = [by_id[rid] for rid in rows]
        tokens, probs = self._draft(rows, row_seqs, k)
        drafted = mx.stack(tokens, axis=1).tolist()  # (B, k): the one read back to the host
        at = {rid: i for i, rid in enumerate(rows)}
        for rid, seq, row in zip(rows, row_seqs, drafted):
            self._held[rid] = seq.token_ids + row[:-1]  # the last draft was never fed
        return [_draft_of(drafted, probs, at[rid], ask) if rid in at and ask else Draft([])
                for rid, ask in zip(rids, ks)]

    def forget(self, request_id: int) -> None:
        if self._held.pop(request_id, None) is None:
            return
        self.pool.remove({request_id})
        if not len(self.pool):
            self.pool.resize(EMPTY_POOL)

    # -- pieces --------------------------------------------------------------------------------
    def _admit(self, by_id: dict[int, sampler.History], asked: dict[int, int], k: int) -> None:
        """Rows gone from the call leave; rows asking for drafts that the pool lacks join it
        (their context prefilled); the pool grows to hold this step's drafts."""
        for rid in [r for r in self.pool.row_ids if r not in by_id]:
            self.forget(rid)
        new = [rid for rid, n in asked.items() if n and rid not in self._held]
        longest = max(len(by_id[rid].token_ids) for rid in [*self.pool.row_ids, *new])
        pool = self.pool
        self._fit(len(pool) + len(new), longest + k)  # a row then holds its context + k - 1
        for rid in new:
            context = by_id[rid].token_ids[:-1]
            cache = self._prefill(context)
            pool.add(rid, cache, len(context))
            self._held[rid] = list(context)

    def _fit(self, rows: int, tokens: int) -> None:
        """Room for `rows` rows of `tokens`, and for what rows hold now (drafts of a larger K
        than this step's included); the geometry grows and shrinks as the target's does."""
        pool = self.pool
        tokens = max(tokens, *pool.lengths) if pool.lengths else tokens
        pool.resize(next_geometry(pool.geometry, rows, tokens, _ROW_STEP, _UNCAPPED_ROWS,
                                  _UNCAPPED_BYTES, pool.layout.cache))

    def _prefill(self, context: list[int]) -> list | None:
        """A private cache holding `context` (no logits: the pool's first step feeds the last
        token)."""
        if not context:
            return None
        cache = prefill_cache.new_private_cache(self.pool.layers)
        self.model.model(mx.array([context]), cache=cache)
        mx.eval([c.state for c in cache])
        return cache

    def _draft(self, rows: list[int], seqs: list[sampler.History], k: int):
        """k tokens for every pool row: per draft position a (B,) array, and the (B_drawn, V)
        distributions of the rows that draw (None if none do)."""
        pool = self.pool
        same = [_common_prefix(self._held[rid], s.token_ids, len(s.token_ids) - 1)
                for rid, s in zip(rows, seqs)]
        feeds = [s.token_ids[n:] for s, n in zip(seqs, same)]
        n = max(map(len, feeds))
        self._fit(len(rows), max(max(same) + n, max(len(s.token_ids) for s in seqs) + k))
        inputs = mx.array([f + [0] * (n - len(f)) for f in feeds])
        pool.keep(same, [0] * len(same))  # cut back to what the target kept
        logits = self.model(inputs, cache=pool.layer_views(n))
        pool.keep(same, [len(f) for f in feeds])  # the padding is never read
        logits = logits[mx.arange(len(rows)), mx.array([len(f) - 1 for f in feeds])]
        drawn = [i for i, s in enumerate(seqs) if s.sampling.temperature > 0]
        tokens, probs = [], []
        for i in range(k):
            if i:
                logits = self.model(tokens[-1][:, None], cache=pool.layer_views())[:, -1]
            token, p = _choose(logits, rows, seqs, drawn, i)
            tokens.append(token)
            probs.append(p)
        return tokens, (probs, drawn)


def _choose(logits: mx.array, rows: list[int], seqs: list[sampler.History], drawn: list[int],
            i: int) -> tuple[mx.array, mx.array | None]:
    """(B,) each row's draft i: the argmax, or drawn from q at the row's temperature (keyed by
    its seed and position); and q of the drawing rows."""
    tokens = mx.argmax(logits, axis=-1)
    if not drawn:
        return tokens, None
    at = mx.array(drawn)
    q = sampler.probabilities(logits[at], [seqs[j].sampling for j in drawn])
    picks = [mx.random.categorical(mx.log(q[m : m + 1]), key=position_key(
        seqs[j].sampling, rows[j], len(seqs[j].token_ids) + i, KEY_DRAFT))
        for m, j in enumerate(drawn)]
    tokens[at] = mx.concatenate(picks).astype(tokens.dtype)
    return tokens, q


def _draft_of(drafted: list[list[int]], probs: tuple[list, list[int]], row: int,
              ask: int) -> Draft:
    """Row `row`'s first `ask` drafts, with q when it drew them."""
    steps, drawn = probs
    if row not in drawn:
        return Draft(drafted[row][:ask])
    m = drawn.index(row)
    return Draft(drafted[row][:ask], mx.stack([q[m] for q in steps[:ask]]))


def _common_prefix(a: list[int], b: list[int], limit: int) -> int:
    n = min(len(a), len(b), limit)
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i
