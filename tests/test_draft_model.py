"""The draft-model drafter batched across the rows: every row drafts in the same forward passes of
the draft model (K a step, whatever the batch), on its own decode pool with each row at its own
position; at temperature 0 the output is plain greedy decoding's, with rows of different lengths
joining and leaving mid-run and drafts rejected."""

from __future__ import annotations

import random

import pytest
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
    sched = Scheduler(config(kv_bytes_per_token=kvt, max_num_seqs=6,
                             spec_tokens=3 if drafter else 0, spec_policy="fixed"))
    trace = drive(sched, MLXExecutor(model, drafter=drafter), _arrivals(512))
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
    first = warm.propose(list(range(5)), seqs, [3, 3, 0, 2, 3])
    assert [len(d.tokens) for d in first] == [3, 3, 0, 2, 3]
    for s, d in zip(seqs, first):  # the target kept one draft (or none) and sampled a token
        s.token_ids += d.tokens[:1] + [rng.randrange(512)]
    again = warm.propose(list(range(5)), seqs, [3] * 5)
    fresh = DraftModelDrafter(draft).propose(list(range(5)), seqs, [3] * 5)
    assert [d.tokens for d in again] == [d.tokens for d in fresh]


class _Seq:
    def __init__(self, token_ids: list[int]) -> None:
        self.token_ids = token_ids
        self.sampling = SamplingParams(max_tokens=64)
        self.num_prompt_tokens = len(token_ids)


def test_the_draft_pool_shrinks_only_to_what_its_rows_hold(tiny):
    # A long row leaves; the one left holds drafts of a larger K than this step asks for, past
    # the smaller pool the new K alone would need: the pool keeps room for them.
    _, model, _ = tiny
    long_row, short_row = _Seq([7] * 1000), _Seq([5] * 250)
    drafter = DraftModelDrafter(model)
    drafter.propose([0, 1], [long_row, short_row], [8, 8])
    assert drafter.pool.lengths[1] == 250 + 7  # its context and 7 of its 8 drafts
    drafter.forget(0)
    short_row.token_ids.append(3)  # no draft kept
    assert len(drafter.propose([1], [short_row], [1])[0].tokens) == 1
    assert drafter.pool.geometry.capacity_tokens == 256 * 2 and drafter.pool.lengths == [251]
