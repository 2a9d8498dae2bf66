"""The draft-model drafter batched across the rows: every row drafts in the same forward passes of
the draft model (K a step, whatever the batch), on its own decode pool with each row at its own
position; at temperature 0 the output is plain greedy decoding's, with rows of different lengths
joining and leaving mid-run and drafts rejected."""

from __future__ import annotations

import random

import pytest
from batchsim.scheduler.pool_geometry import PoolGeometry
from batchsim.scheduler.request import Request, SamplingParams
from batchsim.scheduler.scheduler import Scheduler
from batchsim.server.executors.draft_model import DraftModelDrafter
from batchsim.server.executors.mlx_executor import MLXExecutor

from tests.drivers import config, drive


class _Counted:
    """A model whose full forward passes (with logits) are counted."""

    def __init__(self, model) -> None:
        self.inner, self.calls = model, 0

    def __call__(self, *args, **kw):
        self.calls += 1
        return self.inner(*args, **kw)

    def __getattr__(self, name):
        return getattr(self.inner, name)


def _arrivals(vocab: int) -> list[tuple[int, Request]]:
    """Six rows: prompts of 3-40 tokens, 9-24 tokens out, three arriving later (joins while
    others draft; leaves at different steps)."""
    rng = random.Random(11)
    out = []
    for i in range(6):
        ids = [rng.randrange(vocab) for _ in range(rng.randint(3, 40))]
        sampling = SamplingParams(max_tokens=rng.randint(9, 24), ignore_eos=True)
        out.append(((0, 0, 0, 2, 3, 7)[i], Request(i, len(ids), sampling, 0.0,
                                                   prompt_token_ids=ids)))
    return out


def _outputs(model, kvt: int, drafter=None):
    executor = MLXExecutor(model, drafter=drafter)  # its layout: the draft model's rows too
    sched = Scheduler(config(kv_bytes_per_token=kvt, max_num_seqs=6, cache_layout=(
        executor.cache_layout if drafter else None), spec_tokens=3 if drafter else 0,
        spec_policy="fixed"))
    trace = drive(sched, executor, _arrivals(512))
    return {rid: r.output_token_ids for rid, r in trace.requests.items()}, trace


@pytest.mark.parametrize("draft", ["self", "tiny-moe"])
def test_batched_drafts_give_plain_greedy_tokens_at_6_rows_of_different_lengths(
        tiny, tiny_moe, draft):
    ref, model, _ = tiny
    kvt = ref.spec.kv_bytes_per_token("float32")
    plain, _ = _outputs(model, kvt)
    counted = _Counted(model if draft == "self" else tiny_moe[1])
    drafter = DraftModelDrafter(counted)
    counted.calls = 0  # (reading the model's layers ran one)
    spec, trace = _outputs(model, kvt, drafter)
    assert spec == plain
    verify = [p for p in trace.plans if any(p.decode_spec_tokens)]
    assert max(len(p.decode_ids) for p in verify) >= 4
    assert any(len(set(p.decode_positions)) > 1 for p in verify if len(p.decode_ids) >= 4)
    # One draft-model forward per draft token for all rows together (a row at a time: B x K).
    assert counted.calls == sum(max(p.decode_spec_tokens) for p in verify)
    if draft == "self":  # the model as its own draft: nearly every draft is kept
        assert len(trace.plans) < sum(map(len, plain.values())) / 3
    assert not drafter.pool.row_ids  # every row left the draft pool with its request


def test_a_row_cut_back_after_rejections_drafts_what_a_fresh_row_drafts(tiny, tiny_moe):
    # Rows holding rejected drafts are cut back to the target's tokens before drafting: their
    # drafts equal those of a drafter seeing the same tokens for the first time.
    _, draft, _ = tiny_moe
    rng = random.Random(4)
    seqs = [_Seq([rng.randrange(512) for _ in range(rng.randint(3, 30))]) for _ in range(5)]
    warm = DraftModelDrafter(draft)
    warm.resize(PoolGeometry(8, 256))  # the target pool's geometry (the executor hands it)
    first = warm.propose(list(range(5)), seqs, [3, 3, 0, 2, 3])
    assert [len(d.tokens) for d in first] == [3, 3, 0, 2, 3]
    for s, d in zip(seqs, first):  # the target kept one draft (or none) and sampled a token
        s.token_ids += d.tokens[:1] + [rng.randrange(512)]
    again = warm.propose(list(range(5)), seqs, [3] * 5)
    assert [d.tokens for d in again] == [d.tokens for d in _fresh(draft, seqs, [3] * 5)]


def _fresh(model, seqs, ks):
    """What a drafter seeing these rows for the first time drafts (a roomy pool)."""
    fresh = DraftModelDrafter(model)
    fresh.resize(PoolGeometry(8, 4096))
    return fresh.propose(list(range(len(seqs))), seqs, ks)


class _Seq:
    def __init__(self, token_ids: list[int]) -> None:
        self.token_ids = token_ids
        self.sampling = SamplingParams(max_tokens=64)
        self.num_prompt_tokens = len(token_ids)


def test_the_draft_pool_takes_the_target_geometry_and_counts_its_bytes(tiny):
    # The draft pool is the target pool's rows x capacity (padded), whatever rows it holds: the
    # bytes the scheduler prices as CacheLayout.draft. A row holding drafts past a smaller
    # capacity is cut to it, and then drafts what a fresh row drafts.
    _, model, _ = tiny
    long_row, short_row = _Seq([7] * 1000), _Seq([5] * 250)
    drafter = DraftModelDrafter(model)
    drafter.resize(PoolGeometry(2, 1024 + 256, 40))  # a paged target's: blocks are not rows
    drafter.propose([0, 1], [long_row, short_row], [8, 8])
    assert drafter.pool.lengths[1] == 250 + 7  # its context and 7 of its 8 drafts
    assert drafter.nbytes == 2 * drafter.cache.seq_bytes(1024 + 256) > 0
    drafter.forget(0)
    short_row.token_ids.append(3)  # no draft kept
    drafter.resize(PoolGeometry(1, 256))  # the target's row: 251 tokens + 1 draft
    assert drafter.pool.lengths == [256] and drafter.nbytes == drafter.cache.seq_bytes(256)
    got = drafter.propose([1], [short_row], [1])
    assert [d.tokens for d in got] == [d.tokens for d in _fresh(model, [short_row], [1])]
    drafter.forget(1)
    drafter.resize(PoolGeometry(0, 0))
    assert drafter.nbytes == 0


def test_a_lagging_row_is_fed_in_pieces_that_fit_the_capacity(tiny):
    # A row that missed drafting steps (K = 0 at a large batch) has many tokens to catch up on,
    # beside a row near the capacity: fed in forwards the capacity leaves room for, the drafts
    # are those of a fresh drafter.
    _, model, _ = tiny
    rng = random.Random(5)
    near, lagging = _Seq([rng.randrange(512) for _ in range(250)]), _Seq([9] * 10)
    drafter = _Counted(model)
    d = DraftModelDrafter(drafter)
    d.resize(PoolGeometry(2, 256))
    d.propose([0, 1], [near, lagging], [2, 2])
    near.token_ids.append(rng.randrange(512))
    lagging.token_ids += [rng.randrange(512) for _ in range(30)]
    drafter.calls = 0
    got = d.propose([0, 1], [near, lagging], [2, 2])
    assert drafter.calls > 2  # more than one feeding forward, then one more for draft 2
    assert max(d.pool.lengths) <= 256
    assert [x.tokens for x in got] == [x.tokens for x in _fresh(model, [near, lagging], [2, 2])]


def test_with_kv_bits_the_draft_pool_holds_what_the_account_prices(smollm2):
    # --kv-bits 8: the draft model's K/V are quantized as the target's (QuantizedKVCache's
    # words, scales and biases), and its measured bytes are spec_price.draft_cache's, the price
    # the simulator, the session and `size` add per pool row.
    from batchsim.server.perf.spec_price import draft_cache

    ref, model, _ = smollm2  # head_dim 64: mlx-lm's KV group
    drafter = DraftModelDrafter(model, kv_bits=8)
    drafter.resize(PoolGeometry(2, 512))
    got = drafter.propose([0, 1], [_Seq([7] * 60), _Seq([5] * 20)], [3, 3])
    assert all(len(d.tokens) == 3 for d in got)
    assert drafter.cache == draft_cache(ref.spec, "float32", 8) != draft_cache(ref.spec, "float32")
    assert drafter.nbytes == 2 * draft_cache(ref.spec, "float32", 8).seq_bytes(512)
