"""Which drafts a verify step keeps, from the target's logits (B, n, V) over each row's last token
and its drafts (position i: the logits after drafts[:i]), and the row's token after them.

- Temperature 0: the longest prefix of drafts equal to the argmax, then the argmax after it: the
  tokens plain greedy decoding gives.
- Temperature > 0: rejection sampling (Leviathan et al. 2023; vLLM's RejectionSampler). Draft x at
  position i is kept with probability min(1, p_i(x) / q_i(x)); at the first rejection the row
  draws from norm(max(p_i - q_i, 0)); with every draft kept, a bonus token from p_n. Each emitted
  token then has the target's distribution p. q is the drafter's (speculative.Draft.probs; one-hot
  for n-gram drafts: keep with p(x), else draw from p without x).

p is what the batched sampler draws from (sampler.py): logit_bias and penalties (counting the
drafts before each position), temperature, min_p, top_k, top_p. Draws are keyed by the row's seed
and position (sampler.row_key), split into one key per use."""

from __future__ import annotations

from typing import NamedTuple

import mlx.core as mx
import numpy as np
from batchsim.server.executors import sampler
from batchsim.server.executors.speculative import Draft, num_accepted

# mx.random.split(sampler.row_key(...))[use]: what each draw of one position is keyed by.
KEY_VERIFY, KEY_DRAFT = range(2)


def position_key(sampling: sampler.SamplingParams, rid: int, position: int,
                 use: int) -> mx.array:
    return mx.random.split(sampler.row_key(sampling, rid, position))[use]


class _Ahead(NamedTuple):
    """A row's history with some of its drafts appended (sampler.History)."""

    sampling: sampler.SamplingParams
    token_ids: list[int]
    num_prompt_tokens: int


def accept(logits: mx.array, rids: list[int], seqs: list[sampler.History],
           drafts: list[Draft]) -> tuple[list[int], mx.array]:
    """Each row's number of kept drafts, and (B,) its token after them."""
    if all(s.sampling.is_plain_greedy for s in seqs):
        greedy = mx.argmax(logits, axis=-1).tolist()
        kept = [num_accepted(d.tokens, g) for d, g in zip(drafts, greedy)]
        return kept, mx.array([g[a] for g, a in zip(greedy, kept)])
    b, n, vocab = logits.shape
    adjusted = _adjusted(logits, seqs, drafts)
    greedy = mx.argmax(adjusted, axis=-1).reshape(b, n).tolist()
    kept = [num_accepted(d.tokens, g) for d, g in zip(drafts, greedy)]
    tokens = [mx.array([g[a]]) for g, a in zip(greedy, kept)]
    drawn = [i for i, s in enumerate(seqs) if s.sampling.temperature > 0]
    if drawn:
        rows = mx.array(drawn)
        params = [seqs[i].sampling for i in drawn for _ in range(n)]
        probs = sampler.probabilities(adjusted.reshape(b, n, vocab)[rows].reshape(-1, vocab),
                                      params).reshape(len(drawn), n, vocab)
        sub_kept, sub_tokens = reject(probs, [rids[i] for i in drawn], [seqs[i] for i in drawn],
                                      [drafts[i] for i in drawn])
        for j, i in enumerate(drawn):
            kept[i], tokens[i] = sub_kept[j], sub_tokens[j : j + 1]
    return kept, mx.concatenate(tokens)


def _adjusted(logits: mx.array, seqs: list[sampler.History], drafts: list[Draft]) -> mx.array:
    """(B * n, V) float32 logits after each row's bias and penalties at each position, the
    row's drafts before that position counted as output."""
    b, n, vocab = logits.shape
    flat = logits.reshape(b * n, vocab).astype(mx.float32)
    rows = [i for i, s in enumerate(seqs) if s.sampling.adjusts_logits]
    if not rows:
        return flat
    ahead = [_Ahead(seqs[i].sampling, seqs[i].token_ids + drafts[i].tokens[:j],
                    seqs[i].num_prompt_tokens) for i in rows for j in range(n)]
    at = mx.array([i * n + j for i in rows for j in range(n)])
    flat[at] = sampler.adjust_logits(flat[at], ahead)
    return flat


def reject(probs: mx.array, rids: list[int], seqs: list[sampler.History],
           drafts: list[Draft]) -> tuple[list[int], mx.array]:
    """Rejection sampling of (m, n, V) target probabilities: each row's kept drafts, and (m,)
    its token after them."""
    m, n, vocab = probs.shape
    width = n - 1
    lens = [len(d.tokens) for d in drafts]
    padded = mx.array([d.tokens + [0] * (width - len(d.tokens)) for d in drafts]).reshape(m, width)
    q = _draft_probs(drafts, padded, vocab)  # (m, width, V)
    p_x = mx.take_along_axis(probs[:, :width], padded[..., None], axis=-1)[..., 0]
    q_x = mx.take_along_axis(q, padded[..., None], axis=-1)[..., 0]
    # Per row, one draw keyed by its seed and position: `width` uniforms, then V for its token.
    noise = mx.stack([mx.random.uniform(shape=(width + vocab,),
                                        key=position_key(s.sampling, r, len(s.token_ids),
                                                         KEY_VERIFY))
                      for s, r in zip(seqs, rids)])
    ratio, u = np.array(p_x / q_x), np.array(noise[:, :width])
    kept = [_first_rejected(u[i] < ratio[i], lens[i]) for i in range(m)]
    at, rows = mx.array(kept), mx.arange(m)
    target = probs[rows, at]  # (m, V): p at each row's first unkept position
    rejected = (at < mx.array(lens))[:, None]  # else the bonus: p itself
    residual = mx.maximum(target - mx.where(rejected, q[rows, mx.minimum(at, width - 1)], 0), 0)
    mass = residual.sum(axis=-1, keepdims=True)
    dist = mx.where(mass > 0, residual / mx.maximum(mass, 1e-30), target)
    gumbel = -mx.log(-mx.log(noise[:, width:]))
    return kept, mx.argmax(mx.log(dist) + gumbel, axis=-1)


def _first_rejected(accepted: np.ndarray, num_drafts: int) -> int:
    misses = np.flatnonzero(~accepted[:num_drafts])
    return int(misses[0]) if misses.size else num_drafts


def _draft_probs(drafts: list[Draft], padded: mx.array, vocab: int) -> mx.array:
    """(m, width, V) q of every draft position: the drafter's, else one-hot at the draft."""
    q = (mx.arange(vocab)[None, None] == padded[..., None]).astype(mx.float32)
    held = [i for i, d in enumerate(drafts) if d.probs is not None]
    if held:
        width = padded.shape[1]
        q[mx.array(held)] = mx.stack([
            mx.pad(drafts[i].probs.astype(mx.float32), [(0, width - len(drafts[i].tokens)),
                                                        (0, 0)]) for i in held])
    return q
