"""Speculative decoding at temperature > 0: the rejection rule (acceptance.py) emits tokens with the
target's distribution whatever the drafts, n-gram (one-hot q) or drawn from a draft model's q; and
real runs that sample speculate and accept drafts."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest
from batchsim.scheduler.request import SamplingParams
from batchsim.server.executors.acceptance import accept
from batchsim.server.executors.mlx_executor import SeqState
from batchsim.server.executors.speculative import Draft

VOCAB = 8
ROWS = 2000  # draws: every row is one independent draw (its own seed)
# chi-square, 7 degrees of freedom: P(X > 24.3) = 0.001
CHI2_7_999 = 24.3


def _softmax(x: np.ndarray) -> np.ndarray:
    e = np.exp(x - x.max())
    return e / e.sum()


def _chi2(samples: list[int], p: np.ndarray) -> float:
    counts = np.bincount(samples, minlength=VOCAB)
    expected = p * len(samples)
    seen = expected > 0
    assert counts[~seen].sum() == 0, "a token the target gives probability 0 was emitted"
    return float(((counts[seen] - expected[seen]) ** 2 / expected[seen]).sum())


def _verify(logits: np.ndarray, sampling: SamplingParams, drafts: list[Draft]):
    """Each row's emitted tokens (kept drafts, then its token) for (n, V) logits shared by every
    row (position i's logits do not depend on the drafts before it)."""
    rows = len(drafts)
    seqs = [SeqState([1, 2, 3], SamplingParams(**{**_fields(sampling), "seed": i}))
            for i in range(rows)]
    batch = mx.broadcast_to(mx.array(logits, mx.float32)[None], (rows, *logits.shape))
    kept, tokens = accept(batch, list(range(rows)), seqs, drafts)
    return [d.tokens[:a] + [t] for d, a, t in zip(drafts, kept, tokens.tolist())]


def _fields(s: SamplingParams) -> dict:
    return {"max_tokens": s.max_tokens, "temperature": s.temperature, "top_k": s.top_k}


def _target(logits: np.ndarray, temperature: float, top_k: int) -> np.ndarray:
    """The sampler's p, computed here independently: top_k of logits / temperature."""
    out = []
    for row in logits / temperature:
        cut = np.sort(row)[-top_k]
        out.append(_softmax(np.where(row >= cut, row, -np.inf)))
    return np.array(out)


@pytest.mark.parametrize("drafter", ["ngram", "draft"])
def test_rejection_sampling_emits_the_target_distribution(drafter):
    rng = np.random.default_rng(0)
    logits = rng.normal(0, 1.5, (3, VOCAB))  # positions 0, 1 (after draft 0), 2 (the bonus)
    sampling = SamplingParams(max_tokens=8, temperature=0.8, top_k=6)
    p = _target(logits, 0.8, 6)
    if drafter == "ngram":  # one fixed guess per position, one likely and one the target drops
        guess = [int(np.argmax(p[0])), int(np.argmin(p[1]))]
        drafts = [Draft(guess) for _ in range(ROWS)]
    else:  # drawn from a q unlike p
        q = np.array([_softmax(rng.normal(0, 1, VOCAB)) for _ in range(2)], np.float32)
        tokens = np.stack([rng.choice(VOCAB, ROWS, p=q[i] / q[i].sum()) for i in range(2)], 1)
        drafts = [Draft(list(map(int, t)), mx.array(q)) for t in tokens]
    out = _verify(logits, sampling, drafts)
    assert _chi2([o[0] for o in out], p[0]) < CHI2_7_999
    second = [o[1] for o in out if len(o) > 1]  # the first draft was kept
    assert len(second) > 300 and _chi2(second, p[1]) < CHI2_7_999
    third = [o[2] for o in out if len(o) > 2]  # both drafts kept: the bonus
    if drafter == "draft":
        assert len(third) > 300 and _chi2(third, p[2]) < CHI2_7_999
    else:  # the second guess is outside top_k: never kept
        assert not third


def test_acceptance_is_min_one_p_over_q():
    # A one-hot draft is kept with probability p(x): here p(x) = 0.3 exactly.
    p = np.array([0.3, 0.7] + [0.0] * (VOCAB - 2))
    logits = np.log(np.maximum(np.stack([p, p]), 1e-30))
    out = _verify(logits, SamplingParams(max_tokens=8, temperature=1.0),
                  [Draft([0]) for _ in range(ROWS)])
    kept = sum(len(o) == 2 for o in out) / ROWS
    assert abs(kept - 0.3) < 4 * np.sqrt(0.3 * 0.7 / ROWS)
    assert all(o[0] == 1 for o in out if len(o) == 1)  # a rejection draws from p without x


def test_rejection_draws_are_seeded_per_row():
    rng = np.random.default_rng(1)
    logits = rng.normal(0, 1, (3, VOCAB))
    sampling = SamplingParams(max_tokens=8, temperature=1.0)
    drafts = [Draft([1, 2]) for _ in range(64)]
    batched = _verify(logits, sampling, drafts)
    assert _verify(logits, sampling, drafts) == batched
    assert len({tuple(o) for o in batched}) > 1  # rows draw with their own keys


def _runs(model, kvt: int, samplings: list[SamplingParams], prompts, drafter=None):
    from batchsim.scheduler.request import Request
    from batchsim.scheduler.scheduler import Scheduler
    from batchsim.server.executors.mlx_executor import MLXExecutor

    from tests.drivers import config, drive

    arrivals = [(0, Request(i, len(ids), s, 0.0, prompt_token_ids=list(ids)))
                for i, (ids, s) in enumerate(zip(prompts, samplings))]
    ex = MLXExecutor(model, drafter=drafter)  # its layout: a draft model's rows too
    sched = Scheduler(config(kv_bytes_per_token=kvt, max_num_seqs=len(prompts),
                             cache_layout=ex.cache_layout if drafter else None,
                             spec_tokens=4 if drafter else 0, spec_policy="fixed"))
    # drive checks the KV account and the executor's bytes after every step
    trace = drive(sched, ex, arrivals)
    return {rid: r.output_token_ids for rid, r in trace.requests.items()}, trace


def _prompts(vocab: int, n: int) -> list[list[int]]:
    rng = np.random.default_rng(3)
    return [list(map(int, rng.integers(0, vocab, rng.integers(5, 30)))) * 3 for _ in range(n)]


def test_sampled_rows_speculate_beside_greedy_ones(tiny):
    # One batch: plain greedy, greedy with penalties (their drafts counted at each position),
    # and two rows at temperature 0.8 (one with top_p and a penalty). The greedy rows give
    # plain decoding's tokens; every row verified drafts.
    from batchsim.server.executors.speculative import NgramDrafter

    ref, model, _ = tiny
    kvt = ref.spec.kv_bytes_per_token("float32")
    samplings = [SamplingParams(max_tokens=20, ignore_eos=True),
                 SamplingParams(max_tokens=20, ignore_eos=True, repetition_penalty=1.3,
                                frequency_penalty=0.2),
                 SamplingParams(max_tokens=20, ignore_eos=True, temperature=0.8, seed=1),
                 SamplingParams(max_tokens=20, ignore_eos=True, temperature=0.8, top_p=0.9,
                                presence_penalty=0.5)]
    prompts = _prompts(ref.spec.vocab_size, 4)
    plain, _ = _runs(model, kvt, samplings, prompts)
    spec, trace = _runs(model, kvt, samplings, prompts, NgramDrafter())
    assert (spec[0], spec[1]) == (plain[0], plain[1])
    assert all(len(spec[i]) == 20 for i in spec)
    drafted = {rid for p in trace.plans for rid, k in zip(p.decode_ids, p.decode_spec_tokens) if k}
    assert drafted == {0, 1, 2, 3}


def test_draft_model_speculation_at_temperature_keeps_drafts(tiny):
    # The model as its own draft at the same temperature: q equals p, so drafts are kept.
    from batchsim.server.executors.draft_model import DraftModelDrafter

    ref, model, _ = tiny
    kvt = ref.spec.kv_bytes_per_token("float32")
    samplings = [SamplingParams(max_tokens=16, ignore_eos=True, temperature=0.8, seed=i)
                 for i in range(3)]
    spec, trace = _runs(model, kvt, samplings, _prompts(ref.spec.vocab_size, 3),
                        DraftModelDrafter(model))
    assert all(len(t) == 16 for t in spec.values())
    assert len(trace.plans) < 16  # several tokens per verify step
