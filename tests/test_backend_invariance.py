"""How far a row's logits move between running alone and in a batch, on this backend: the fact
behind what the executor suites' token comparisons demand (tests/backend.py)."""

from __future__ import annotations

import mlx.core as mx
import pytest

from tests.backend import CPU_BATCH_REL, NEAR_TIE_REL, exact_tokens, log, model_dtype


def _batched_vs_single_rel(model, vocab: int, rows: int = 8, tokens: int = 33) -> float:
    """Prefill `rows` prompts as one batch and one by one, then one decode token each the same
    two ways: the largest logit difference relative to the largest |logit|."""
    mx.random.seed(0)
    ids = mx.random.randint(0, vocab, (rows, tokens))
    batched = model(ids)
    single = mx.concatenate([model(ids[i:i + 1]) for i in range(rows)])
    return (mx.abs(batched - single).max() / mx.abs(batched).max()).item()


@pytest.mark.parametrize("name", ["tiny", "tiny_q4"])
def test_batched_logits_stay_within_what_the_token_checks_allow(name, request):
    ref, model, _ = request.getfixturevalue(name)
    rel = _batched_vs_single_rel(model, ref.spec.vocab_size)
    dtype = model_dtype(model)
    log(kind="batched_vs_single", model=name, dtype=dtype, rel=rel, exact_tokens=exact_tokens())
    if exact_tokens():  # the CPU: exact token equality is a fair demand
        assert rel <= CPU_BATCH_REL, rel
    else:  # elsewhere a near-tie is NEAR_TIE_REL wide: four times what a batch moves a logit
        assert rel <= NEAR_TIE_REL[dtype] / 4, rel


def test_off_the_cpu_a_token_may_differ_only_at_a_near_tie(tiny, monkeypatch):
    """The GPU rule, run here: a first difference where the reference's top two logits are within
    the margin passes; the same difference with a tighter margin, or a far-off token, fails."""
    from mlx_lm.models.cache import make_prompt_cache

    from tests import backend

    _ref, model, _ = tiny
    prompt = list(range(5, 25))
    logits = model(mx.array(prompt)[None], cache=make_prompt_cache(model))[0, -1]
    order = mx.argsort(logits).tolist()
    first, second, last = order[-1], order[-2], order[0]
    gap_rel = (logits[first] - logits[second]).item() / mx.abs(logits).max().item()
    monkeypatch.setattr(backend, "exact_tokens", lambda: False)
    dtype = model_dtype(model)
    want = {0: [first, 7]}  # a flip at token 0; what follows is not compared
    monkeypatch.setitem(backend.NEAR_TIE_REL, dtype, gap_rel * 1.01)
    backend.assert_same_tokens(model, {0: prompt}, {0: [second, 9]}, want)
    with pytest.raises(AssertionError, match="not a near-tie"):
        backend.assert_same_tokens(model, {0: prompt}, {0: [last, 9]}, want)
    monkeypatch.setitem(backend.NEAR_TIE_REL, dtype, gap_rel * 0.99)
    with pytest.raises(AssertionError, match="not a near-tie"):
        backend.assert_same_tokens(model, {0: prompt}, {0: [second, 9]}, want)
