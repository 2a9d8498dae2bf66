"""Per-row sampling of one batched forward pass, with vLLM's semantics. Each row's logit_bias is
added, then its repetition, frequency and presence penalties (on greedy rows too); a row at
temperature 0 takes the argmax; the others divide by their temperature, drop tokens by min_p, top_k
and top_p (in that order) and draw with a key from their seed and position, so a seeded request
draws the same tokens alone or batched. A batch of plain greedy rows is one argmax, as ever."""

from __future__ import annotations

import math
from typing import Protocol

import mlx.core as mx
from batchsim.scheduler.request import SamplingParams

_NEG_INF = float("-inf")


class History(Protocol):
    """What the sampler reads of a row (the MLX executor's SeqState)."""

    sampling: SamplingParams
    token_ids: list[int]  # prompt + every token sampled so far
    num_prompt_tokens: int


def sample(logits: mx.array, rids: list[int], seqs: list[History], ahead: int = 0,
           pending: mx.array | None = None) -> mx.array:
    """(B,) tokens for the (B, V) logits of rows `rids`. `ahead`: tokens of each row not yet in
    its token_ids; `pending`: (B,) those tokens (the step run ahead), which the penalties count."""
    if all(s.sampling.is_plain_greedy for s in seqs):
        return mx.argmax(logits, axis=-1)
    params = [s.sampling for s in seqs]
    # float32 first: float16 logits over a small temperature (1e-4) overflow to inf.
    logits = logits.astype(mx.float32)
    adjusted = [i for i, p in enumerate(params) if p.adjusts_logits]
    if adjusted:
        rows = mx.array(adjusted)
        sub_pending = None if pending is None else pending.reshape(-1)[rows]
        logits[rows] = adjust_logits(logits[rows], [seqs[i] for i in adjusted], sub_pending)
    greedy = mx.argmax(logits, axis=-1)
    drawn = [i for i, p in enumerate(params) if p.temperature > 0]
    if not drawn:
        return greedy
    drawn_params = [params[i] for i in drawn]
    temperatures = mx.array([p.temperature for p in drawn_params])[:, None]
    scaled = filter_logits(logits[mx.array(drawn)] / temperatures, drawn_params)
    picks = {}
    for j, i in enumerate(drawn):
        key = row_key(params[i], rids[i], len(seqs[i].token_ids) + ahead)
        picks[i] = mx.random.categorical(scaled[j : j + 1], key=key)
    return mx.concatenate([picks[i] if i in picks else greedy[i : i + 1]
                           for i in range(len(params))])


def row_key(sampling: SamplingParams, rid: int, position: int) -> mx.array:
    """The key a row draws its token at `position` (its index in prompt + output) with: from the
    request's seed, else its id, so a seeded request draws the same tokens alone or batched."""
    seed = sampling.seed if sampling.seed is not None else rid
    return mx.random.key(seed * 1_000_003 + position)


def probabilities(logits: mx.array, params: list[SamplingParams]) -> mx.array:
    """(n, V) float32 probabilities a row at temperature > 0 draws from: its (adjusted) logits
    over its temperature, min_p, top_k and top_p applied."""
    temperatures = mx.array([p.temperature for p in params])[:, None]
    return mx.softmax(filter_logits(logits.astype(mx.float32) / temperatures, params), axis=-1)


def adjust_logits(logits: mx.array, seqs: list[History],
                  pending: mx.array | None = None) -> mx.array:
    """logit_bias, then the penalties, of (n, V) float32 logits, one row per seq. Repetition
    counts prompt and output tokens; frequency and presence the output only (as vLLM)."""
    n, vocab = logits.shape
    params = [s.sampling for s in seqs]
    counts = _occurrences(n, vocab, [s.token_ids[s.num_prompt_tokens:] for s in seqs])
    if pending is not None:
        counts = counts.at[mx.arange(n), pending].add(1)
    in_output = counts > 0
    if any(p.logit_bias for p in params):
        logits = logits + _bias(n, vocab, params)
    if any(p.repetition_penalty != 1 for p in params):
        in_prompt = _occurrences(n, vocab, [s.token_ids[: s.num_prompt_tokens] for s in seqs]) > 0
        penalty = mx.array([p.repetition_penalty for p in params])[:, None]
        penalized = mx.where(logits > 0, logits / penalty, logits * penalty)
        logits = mx.where(in_output | in_prompt, penalized, logits)
    frequency = mx.array([p.frequency_penalty for p in params])[:, None]
    presence = mx.array([p.presence_penalty for p in params])[:, None]
    return logits - frequency * counts - presence * in_output


def filter_logits(scaled: mx.array, params: list[SamplingParams]) -> mx.array:
    """min_p, top_k and top_p of (n, V) temperature-scaled logits: dropped tokens get -inf."""
    vocab = scaled.shape[-1]
    if any(p.min_p > 0 for p in params):
        floor = mx.array([math.log(p.min_p) if p.min_p > 0 else _NEG_INF for p in params])
        top = mx.max(scaled, axis=-1, keepdims=True)
        scaled = mx.where(scaled - top < floor[:, None], _NEG_INF, scaled)
    if any(0 < p.top_k < vocab for p in params):
        k = mx.array([p.top_k if 0 < p.top_k < vocab else vocab for p in params])[:, None]
        descending = -mx.sort(-scaled, axis=-1)
        scaled = mx.where(scaled < mx.take_along_axis(descending, k - 1, axis=-1), _NEG_INF,
                          scaled)
    if any(p.top_p < 1 for p in params):
        ascending = mx.sort(scaled, axis=-1)
        mass = mx.cumsum(mx.softmax(ascending, axis=-1), axis=-1)[:, :-1]  # the top always stays
        tail = mx.array([1 - p.top_p for p in params])[:, None]
        dropped = mx.sum(mass <= tail, axis=-1, keepdims=True)
        scaled = mx.where(scaled < mx.take_along_axis(ascending, dropped, axis=-1), _NEG_INF,
                          scaled)
    return scaled


def _occurrences(n: int, vocab: int, tokens: list[list[int]]) -> mx.array:
    """(n, V) float32: how often each token occurs in each row's list."""
    counts = mx.zeros((n, vocab), mx.float32)
    rows = [i for i, ids in enumerate(tokens) for _ in ids]
    if not rows:
        return counts
    flat = [t for ids in tokens for t in ids]
    return counts.at[mx.array(rows), mx.array(flat)].add(1)


def _bias(n: int, vocab: int, params: list[SamplingParams]) -> mx.array:
    rows = [i for i, p in enumerate(params) for _ in p.logit_bias]
    tokens = [t for p in params for t, _ in p.logit_bias]
    values = mx.array([v for p in params for _, v in p.logit_bias], mx.float32)
    return mx.zeros((n, vocab), mx.float32).at[mx.array(rows), mx.array(tokens)].add(values)
