"""The batched sampler (server/executors/sampler.py) against a per-row NumPy reference of vLLM's
semantics: logit_bias, then the penalties (repetition on prompt and output, frequency and presence
on the output), a temperature, then min_p, top_k and top_p. Rows with different parameters share
one batch; plain greedy rows stay the argmax."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest
from batchsim.scheduler.request import SamplingParams
from batchsim.server.executors import sampler
from batchsim.server.executors.mlx_executor import SeqState

VOCAB = 64


def _reference_adjust(row: np.ndarray, seq: SeqState, pending: int | None) -> np.ndarray:
    p, row = seq.sampling, row.astype(np.float64).copy()
    output = list(seq.token_ids[seq.num_prompt_tokens:]) + ([] if pending is None else [pending])
    for token, bias in p.logit_bias:
        row[token] += bias
    seen = set(seq.token_ids) | set(output)
    for t in seen:
        row[t] = row[t] / p.repetition_penalty if row[t] > 0 else row[t] * p.repetition_penalty
    for t in set(output):
        row[t] -= p.frequency_penalty * output.count(t) + p.presence_penalty
    return row


def _reference_kept(row: np.ndarray, p: SamplingParams) -> set[int]:
    """Tokens a sampled row may draw, as vLLM's min_p, top-k and top-p leave them."""
    logits = row / p.temperature
    probs = np.exp(logits - logits.max())
    keep = probs >= p.min_p * probs.max()
    if p.top_k:
        keep &= logits >= np.sort(logits)[::-1][p.top_k - 1]
    masked = np.where(keep, logits, -np.inf)
    probs = np.exp(masked - masked.max())
    probs /= probs.sum()
    order = np.argsort(masked)  # ascending
    tail = np.cumsum(probs[order]) <= 1 - p.top_p
    tail[-1] = False
    keep[order[tail]] = False
    return set(np.flatnonzero(keep).tolist())


PARAMS = [
    SamplingParams(8),
    SamplingParams(8, temperature=0.7, top_k=3),
    SamplingParams(8, temperature=1.3, top_p=0.6),
    SamplingParams(8, temperature=1.0, min_p=0.3),
    SamplingParams(8, temperature=0.9, top_k=10, top_p=0.8, min_p=0.05),
    SamplingParams(8, presence_penalty=1.5, frequency_penalty=0.5),
    SamplingParams(8, temperature=1.0, repetition_penalty=1.7, logit_bias=((4, 3.0), (9, -50.0))),
]


def _seqs() -> list[SeqState]:
    rng = np.random.default_rng(0)
    return [SeqState(rng.integers(0, VOCAB, 12).tolist(), p, num_prompt_tokens=5) for p in PARAMS]


def test_penalties_and_bias_match_the_reference():
    seqs = _seqs()
    logits = mx.random.normal((len(seqs), VOCAB), key=mx.random.key(1)) * 3
    pending = mx.array([7] * len(seqs))
    got = np.array(sampler.adjust_logits(logits, seqs, pending))
    for i, seq in enumerate(seqs):
        want = _reference_adjust(np.array(logits[i]), seq, 7)
        np.testing.assert_allclose(got[i], want, rtol=1e-5, atol=1e-5)
    plain = np.array(sampler.adjust_logits(logits[:1], seqs[:1]))
    np.testing.assert_array_equal(plain, np.array(logits[:1]))  # no penalty: untouched


def test_filters_keep_what_vllm_keeps_row_by_row():
    seqs = _seqs()
    logits = mx.random.normal((len(seqs), VOCAB), key=mx.random.key(2)) * 2
    temperatures = mx.array([s.sampling.temperature or 1.0 for s in seqs])[:, None]
    kept = sampler.filter_logits(logits / temperatures, [s.sampling for s in seqs])
    for i, seq in enumerate(seqs):
        p = seq.sampling
        if p.temperature == 0:
            continue
        want = _reference_kept(np.array(logits[i]), p)
        got = set(np.flatnonzero(np.isfinite(np.array(kept[i]))).tolist())
        assert got == want, (i, p)
        assert p.top_k == 0 or len(got) <= p.top_k


def test_every_draw_is_a_kept_token_and_greedy_rows_are_the_argmax():
    seqs = _seqs()
    logits = mx.random.normal((len(seqs), VOCAB), key=mx.random.key(3)) * 2
    adjusted = np.stack([_reference_adjust(np.array(logits[i]), s, None)
                         for i, s in enumerate(seqs)])
    allowed = [_reference_kept(adjusted[i], s.sampling) if s.sampling.temperature else
               {int(np.argmax(adjusted[i]))} for i, s in enumerate(seqs)]
    drawn: list[set[int]] = [set() for _ in seqs]
    for rid_offset in range(40):  # unseeded rows draw by request id: vary it
        rids = [rid_offset * 100 + i for i in range(len(seqs))]
        for i, t in enumerate(sampler.sample(logits, rids, seqs).tolist()):
            drawn[i].add(t)
    for i, s in enumerate(seqs):
        assert drawn[i] <= allowed[i], (i, s.sampling)
    assert len(drawn[2]) > 1  # top_p 0.6 at temperature 1.3 still draws more than one token


def test_plain_greedy_batches_are_one_argmax_and_rows_keep_their_tokens_batched():
    logits = mx.random.normal((4, VOCAB), key=mx.random.key(4)).astype(mx.float16)
    greedy = [SeqState([1, 2, 3], SamplingParams(8)) for _ in range(4)]
    assert sampler.sample(logits, [0, 1, 2, 3], greedy).tolist() == \
        mx.argmax(logits, axis=-1).tolist()
    sampled = SeqState([1, 2, 3], SamplingParams(8, temperature=1.0, top_k=5, seed=11))
    alone = sampler.sample(logits[1:2], [1], [sampled]).item()
    mixed = sampler.sample(logits, [0, 1, 2, 3], [greedy[0], sampled, *greedy[2:]]).tolist()
    argmax = mx.argmax(logits, axis=-1).tolist()
    assert mixed[1] == alone  # a seeded row draws the same token alone or batched
    assert [mixed[i] for i in (0, 2, 3)] == [argmax[i] for i in (0, 2, 3)]


def test_a_pending_token_counts_as_output():
    """The step run ahead samples before its input token joins token_ids: the penalty sees it."""
    row = mx.zeros((1, VOCAB))
    row[0, 5], row[0, 6] = 10.0, 9.0
    seq = SeqState([1, 2], SamplingParams(8, presence_penalty=2.0))
    assert sampler.sample(row, [0], [seq]).item() == 5
    assert sampler.sample(row, [0], [seq], ahead=1, pending=mx.array([[5]])).item() == 6


@pytest.mark.parametrize("field,value", [
    ("top_p", 0.0), ("top_p", 1.5), ("top_k", -1), ("min_p", 1.5), ("repetition_penalty", 0.0),
    ("temperature", -1.0),
])
def test_sampling_params_refuse_out_of_range_values(field, value):
    with pytest.raises(ValueError, match=field):
        SamplingParams(8, **{field: value})


def test_plain_greedy_is_what_the_fast_path_checks():
    assert SamplingParams(8).is_plain_greedy
    assert not SamplingParams(8, temperature=0.5).is_plain_greedy
    assert not SamplingParams(8, presence_penalty=0.1).is_plain_greedy
    assert not SamplingParams(8, logit_bias=((1, 1.0),)).is_plain_greedy
    assert SamplingParams(8, top_p=0.5, top_k=3).is_plain_greedy  # filters never move an argmax


# -- on the real executor: batched, run ahead, alone and preempted draw the same tokens ---------
MIXED = [
    {},
    {"presence_penalty": 1.5, "frequency_penalty": 0.5},
    {"temperature": 1.0, "top_k": 8, "seed": 3, "frequency_penalty": 1.0},
    {"temperature": 0.8, "top_p": 0.7, "min_p": 0.05, "seed": 4, "repetition_penalty": 1.3},
    {"logit_bias": ((17, 0.3),), "presence_penalty": 1.0},
]


def _run(model, kvt: int, specs, run_ahead=True, **cfg) -> dict[int, list[int]]:
    from batchsim.scheduler.request import Request
    from batchsim.scheduler.scheduler import Scheduler
    from batchsim.server.executors.mlx_executor import MLXExecutor

    from tests.drivers import config, drive

    sched = Scheduler(config(kv_bytes_per_token=kvt, **cfg))
    arrivals = [(step, Request(rid, len(ids), SamplingParams(out, ignore_eos=True, **fields), 0.0,
                               prompt_token_ids=list(ids)))
                for rid, (step, ids, out, fields) in specs]
    trace = drive(sched, MLXExecutor(model, run_ahead=run_ahead), arrivals)
    _run.preemptions = sched.num_preemptions
    return {rid: r.output_token_ids for rid, r in trace.requests.items()}


def test_mixed_rows_draw_the_same_tokens_batched_alone_and_preempted(tiny):
    from batchsim.scheduler.pool_geometry import KV_STEP

    ref, model, _ = tiny
    kvt = ref.spec.kv_bytes_per_token("float32")
    rng = np.random.default_rng(5)
    specs = [(rid, (0, rng.integers(0, 512, int(rng.integers(3, 240))).tolist(), 60,
                    MIXED[rid % 5])) for rid in range(10)]
    batched = _run(model, kvt, specs, max_num_seqs=6)
    assert batched == _run(model, kvt, specs, run_ahead=False, max_num_seqs=6)
    alone = {rid: _run(model, kvt, [(rid, (0, *spec[1:]))], max_num_seqs=1)[rid]
             for rid, spec in specs}
    assert batched == alone
    preempted = _run(model, kvt, specs, max_num_seqs=6, kv_budget_bytes=kvt * 3 * KV_STEP,
                     row_step=1)
    assert _run.preemptions > 0 and preempted == alone
    greedy = _run(model, kvt, [(0, (0, specs[1][1][1], 60, {}))])[0]
    assert alone[1] != greedy  # the penalties did change that row
