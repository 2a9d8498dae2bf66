"""The MLX executor's temperature sampling on a float16 model: logits are divided by the
temperature in float32, so a small temperature (1e-4) cannot overflow float16 to inf (which made
the top tokens tie and the draw random), and seeded draws stay reproducible."""

from __future__ import annotations

import mlx.core as mx
import pytest
from batchsim.scheduler.request import SamplingParams
from batchsim.server.executors.mlx_executor import MLXExecutor, SeqState


@pytest.fixture(scope="module")
def fp16_executor(batchsim_home):
    from batchsim.server.models.loader import load, resolve

    ref = resolve("tiny", "float16", None)
    return MLXExecutor(load(ref)[0], cache_limit_bytes=None), ref.spec.vocab_size


def _seqs(ex: MLXExecutor, temperature: float, seeds: list[int]) -> list[int]:
    ex.seqs.clear()
    for rid, seed in enumerate(seeds):
        ex.seqs[rid] = SeqState([1, 2, 3], SamplingParams(8, temperature=temperature, seed=seed))
    return list(range(len(seeds)))


def test_a_tiny_temperature_on_float16_logits_picks_the_top_token(fp16_executor):
    ex, vocab = fp16_executor
    assert ex.dtype == mx.float16
    rids = _seqs(ex, 1e-4, list(range(16)))
    row = mx.zeros((vocab,), mx.float16)
    row[5], row[9] = 10.0, 9.99  # / 1e-4 passes float16's 65504: both were inf, a coin toss
    logits = mx.broadcast_to(row, (len(rids), vocab))
    assert (logits / 1e-4)[0, 5].item() == float("inf")  # what the division in float16 gives
    assert ex._sample(logits, rids).tolist() == [5] * len(rids)


def test_seeded_sampling_on_a_float16_model_is_reproducible(fp16_executor):
    ex, vocab = fp16_executor
    logits = ex.model(mx.array([[1, 2, 3]] * 8))[:, -1, :]
    assert logits.dtype == mx.float16 and mx.all(mx.isfinite(logits)).item()
    first = ex._sample(logits, _seqs(ex, 1.0, list(range(8)))).tolist()
    again = ex._sample(logits, _seqs(ex, 1.0, list(range(8)))).tolist()
    assert first == again and all(0 <= t < vocab for t in first)
    assert len(set(first)) > 1  # a temperature of 1 on random weights: not all the argmax
    cold = ex._sample(logits, _seqs(ex, 1e-4, list(range(8)))).tolist()
    assert cold == mx.argmax(logits, axis=-1).tolist()
