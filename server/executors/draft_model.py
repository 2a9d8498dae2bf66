"""The `draft` drafter: a second, smaller model sharing the tokenizer proposes each row's next k
tokens (greedily, or drawn at the row's temperature: q of the rejection rule, acceptance.py).

Every row drafts in the same forward passes, as the target decodes: the draft model has its own
decode pool (decode_pool.DecodePool, each row's cache at its own position), padded whatever the
target's layout, and of the target pool's geometry (rows x capacity: `resize`, each step), so the
scheduler's budget holds it (kv_bytes.CacheLayout.draft: one draft row per pool row) and the
executor's KV account counts it (`nbytes`). A row new to it prefills its context but the last
token on a private cache and joins the pool (what the simulator prices as the drafter's catch-up:
spec_price.catch_up_s). Each step, every row is first cut back to what the target kept of its
drafts (the rest is never read again, as after a verify step: DecodePool.keep); then forwards feed
each row the tokens it has not seen (padded to the longest, as a verify step is; in pieces that
fit the capacity when a row lags, e.g. after steps without drafts), and K - 1 more forwards one
token each. All rows draft the step's largest K; a row is handed the K it asked for. Tokens stay
on the device until the last draft."""

from __future__ import annotations

import mlx.core as mx
from batchsim.scheduler.kv_bytes import CacheLayout
from batchsim.scheduler.pool_geometry import EMPTY_POOL, PoolGeometry
from batchsim.server.executors import prefill_cache, sampler
from batchsim.server.executors.acceptance import KEY_DRAFT, position_key
from batchsim.server.executors.decode_pool import DecodePool
from batchsim.server.executors.speculative import Draft


class DraftModelDrafter:
    def __init__(self, model, kv_bits: int | None = None):
        self.model, self.kv_bits = model, kv_bits  # K/V quantized as the target's (--kv-bits)
        dtype = prefill_cache.activation_dtype(model)
        self.pool = DecodePool(prefill_cache.layers_of(model, dtype, kv_bits), dtype, kv_bits)
        self._held: dict[int, list[int]] = {}  # request id -> the tokens its pool row holds

    def propose(self, rids: list[int], seqs: list[sampler.History],
                ks: list[int]) -> list[Draft]:
        k = max(ks, default=0)
        if k <= 0:
            return [Draft([]) for _ in rids]
        by_id = dict(zip(rids, seqs))
        self._admit(by_id, dict(zip(rids, ks)))
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
        if self._held.pop(request_id, None) is not None:
            self.pool.remove({request_id})

    def resize(self, geometry: PoolGeometry) -> None:
        """The target pool's rows and capacity (padded here, whatever the target's layout); rows
        holding drafts past the capacity are cut to it (drafts the target never kept)."""
        pool, cap = self.pool, geometry.capacity_tokens
        if any(n > cap for n in pool.lengths):
            pool.lengths = [min(n, cap) for n in pool.lengths]
            for rid in pool.row_ids:
                del self._held[rid][cap:]
        pool.resize(PoolGeometry(geometry.rows, cap) if geometry.rows else EMPTY_POOL)

    @property
    def cache(self) -> CacheLayout:
        """What one draft row of a given capacity holds (CacheLayout.draft)."""
        return self.pool.layout.cache

    @property
    def nbytes(self) -> int:
        return self.pool.nbytes

    # -- pieces --------------------------------------------------------------------------------
    def _admit(self, by_id: dict[int, sampler.History], asked: dict[int, int]) -> None:
        """Rows gone from the call leave; rows asking for drafts that the pool lacks join it
        (their context prefilled) in the rows the target's geometry gives (`resize`)."""
        for rid in [r for r in self.pool.row_ids if r not in by_id]:
            self.forget(rid)
        new = [rid for rid, n in asked.items() if n and rid not in self._held]
        pool = self.pool
        for rid in new:
            context = by_id[rid].token_ids[:-1]
            cache = self._prefill(context)
            pool.add(rid, cache, len(context))
            self._held[rid] = list(context)

    def _prefill(self, context: list[int]) -> list | None:
        """A private cache holding `context` (no logits: the pool's first step feeds the last
        token)."""
        if not context:
            return None
        cache = prefill_cache.new_private_cache(self.pool.layers, self.kv_bits)
        self.model.model(mx.array([context]), cache=cache)
        mx.eval([c.state for c in cache])
        return cache

    def _draft(self, rows: list[int], seqs: list[sampler.History], k: int):
        """k tokens for every pool row: per draft position a (B,) array, and the (B_drawn, V)
        distributions of the rows that draw (None if none do)."""
        logits = self._feed(rows, seqs)
        drawn = [i for i, s in enumerate(seqs) if s.sampling.temperature > 0]
        tokens, probs = [], []
        for i in range(k):
            if i:
                logits = self.model(tokens[-1][:, None], cache=self.pool.layer_views())[:, -1]
            token, p = _choose(logits, rows, seqs, drawn, i)
            tokens.append(token)
            probs.append(p)
        return tokens, (probs, drawn)

    def _feed(self, rows: list[int], seqs: list[sampler.History]) -> mx.array:
        """Each row cut back to what the target kept, then fed the tokens it has not seen (at
        least its last), padded to the longest, in forwards as wide as the capacity leaves;
        (B, V): the logits after each row's last token."""
        pool = self.pool
        same = [_common_prefix(self._held[rid], s.token_ids, len(s.token_ids) - 1)
                for rid, s in zip(rows, seqs)]
        feeds = [s.token_ids[n:] for s, n in zip(seqs, same)]
        pool.keep(same, [0] * len(same))  # cut back to what the target kept
        last, done, at = None, 0, mx.arange(len(rows))
        while left := [f[done:] for f in feeds if len(f) > done]:
            room = pool.geometry.capacity_tokens - max(pool.lengths)
            if room < 1:
                raise RuntimeError(f"draft pool {pool.geometry} has no room to feed its rows")
            n = min(max(map(len, left)), room)
            pieces = [f[done : done + n] for f in feeds]
            lengths = list(pool.lengths)
            logits = self.model(mx.array([p + [0] * (n - len(p)) for p in pieces]),
                                cache=pool.layer_views(n))
            pool.keep(lengths, [len(p) for p in pieces])  # the padding is never read
            logits = logits[at, mx.array([max(len(p) - 1, 0) for p in pieces])]
            ends = mx.array([0 < len(f) - done <= n for f in feeds])[:, None]
            last = logits if last is None else mx.where(ends, logits, last)
            done += n
        return last


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
