"""How many drafted tokens speculative decoding may verify per row in one decode step. They count
against max_num_batched_tokens and widen the pool's rows for the step (the executor writes their
K/V before it knows which it keeps), so speculation is turned down before it could preempt anyone.

Policies: `fixed` verifies up to spec_tokens drafts per row at any batch (to measure); `shrink`
(the default) keeps a verify step near SHRINK_STEP_TOKENS tokens, so K falls as the batch grows:
decode is memory-bound while a step's tokens are few, and batching spends the same headroom."""

from __future__ import annotations

from typing import Literal

from batchsim.scheduler.plan import StepResult
from batchsim.scheduler.request import Request, stop_string

SpecPolicy = Literal["shrink", "fixed"]
SPEC_POLICIES: tuple[str, ...] = ("shrink", "fixed")
# Tokens a shrinking verify step aims at: K = this // rows - 1 (B=1..8: K up to 7, B=16: 3,
# B=32: 1, B>32: 0). A default, not a measurement: `fixed` measures the real trade.
SHRINK_STEP_TOKENS = 64


def step_spec_tokens(max_spec_tokens: int, policy: str, num_rows: int, tokens_left: int) -> int:
    """K for every decoding row of a step of `num_rows` rows, within `tokens_left` (the step's
    token budget before decode)."""
    if max_spec_tokens <= 0 or num_rows <= 0:
        return 0
    k = max_spec_tokens
    if policy == "shrink":
        k = min(k, SHRINK_STEP_TOKENS // num_rows - 1)
    return max(0, min(k, tokens_left // num_rows - 1))


def row_spec_tokens(request: Request, k: int) -> int:
    """Drafts this row may verify at the step's K: none past its max_tokens (the sampled token
    comes after them)."""
    if k <= 0:
        return 0
    left = request.sampling.max_tokens - request.num_output_tokens - 1
    return k if left >= k else max(left, 0)


def until_stop(request: Request, new: list[int]) -> list[int]:
    """A verify step's accepted drafts and sampled token, cut after the first that ends the
    request (EOS, a stop token), as plain decoding would have stopped there."""
    stops = request.sampling.stop_token_ids
    if not request.sampling.ignore_eos:
        stops = stops | request.eos_token_ids
    for j, t in enumerate(new[:-1]):
        if t in stops:
            return new[: j + 1]
    return new


def kept_tokens(r: Request, new: list[int], drafts: tuple[int, ...], cut: dict[int, int]
                ) -> tuple[list[int], str | None]:
    """A row's tokens this step (its accepted drafts first) cut after the first that ends it,
    and a stop string's reason; a row whose drafts were cut goes in `cut` (request id -> drafts
    kept: Scheduler.cut_drafts)."""
    reason = None
    if drafts:
        new = until_stop(r, [*drafts, *new])
    if r.stop_checker is not None:  # asked first: it sees every token
        new, reason = stop_string(r, new)
    if len(new) <= len(drafts):
        cut[r.request_id] = len(new)
    return new, reason


def cut_drafts(result: StepResult, kept: dict[int, int]) -> StepResult:
    """`result` with the rows of `kept` (request id -> drafts the scheduler kept: a stop inside
    a verify step's drafts) holding only those accepted drafts, so the counts agree with the
    output."""
    accepted = result.accepted_ids or ()
    return result._replace(accepted_ids=tuple(
        a[: kept[rid]] if rid in kept else a for rid, a in zip(result.sampled_ids, accepted)))
