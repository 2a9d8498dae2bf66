"""Speculative decoding priced by the step cost: a verify step of B rows x (K+1) tokens is the
plain decode step of B rows (StepCost.step_time: weights, each row's cache read once, per-row
work) plus what K more tokens a row add, the step cost's own prefill price of K+1 tokens after
the row's cached ones less that of 1 (StepCost.prefill_time over B rows: the GEMM over the extra
B x K tokens and their attention). At K = 0 it is the decode step. A row emits on average
1 + the sum of its per-position acceptance rates tokens per step (spec_acceptance.py, at the
step's batch); with one rate a accepted independently per draft, E = (1 - a^(K+1)) / (1 - a)
(Leviathan et al. 2023). The drafter's own time is not priced (the n-gram drafter's is host work,
a few microseconds a row). The simulated executor prices its verify steps with verify_extra_s."""

from __future__ import annotations

from batchsim.server.perf.spec_acceptance import Acceptance
from batchsim.server.perf.stepcost import StepCost


def verify_extra_s(cost: StepCost, batch: int, spec_tokens: int, width: int) -> float:
    """What K more tokens a row add to a decode step of `batch` rows after `width` tokens."""
    if not spec_tokens:
        return 0.0
    return (cost.prefill_forward_s(spec_tokens + 1, width, True, batch)
            - cost.prefill_forward_s(1, width, True, batch))


def verify_step(cost: StepCost, batch: int, spec_tokens: int, width: int) -> float:
    """Seconds of B rows x (K+1) tokens in one forward pass, each row after `width` cached
    tokens."""
    return (cost.step_time(decode_rows=batch, width=width).total_s
            + verify_extra_s(cost, batch, spec_tokens, width))


def spec_tok_s(cost: StepCost, batch: int, spec_tokens: int, acceptance: Acceptance,
               width: int) -> float:
    """A step verifies K more tokens a row when any of its rows drafted (each with the draft
    share's chance), else it is the plain decode step."""
    drafting = 1.0 - (1.0 - acceptance.draft_share) ** batch
    step_s = (cost.step_time(decode_rows=batch, width=width).total_s
              + drafting * verify_extra_s(cost, batch, spec_tokens, width))
    return batch * acceptance.expected_tokens(spec_tokens, batch) / step_s


def gain(cost: StepCost, batch: int, spec_tokens: int, acceptance: Acceptance,
         width: int) -> float:
    """Speculative over plain decode tok/s at this batch."""
    plain = batch / cost.step_time(decode_rows=batch, width=width).total_s
    return spec_tok_s(cost, batch, spec_tokens, acceptance, width) / plain


def break_even_batch(cost: StepCost, spec_tokens: int, acceptance: Acceptance, width: int,
                     max_batch: int) -> int | None:
    """The smallest batch (<= max_batch) at which speculation no longer beats plain decoding;
    None if it beats it at every batch tried. Tried: powers of two and max_batch, then bisection
    below the first that loses. (The gain is not monotone: it falls while batching amortizes the
    weights, and can rise again where long contexts make decode read mostly KV, which a verify
    step reads once for K+1 tokens.)"""
    def loses(b: int) -> bool:
        return gain(cost, b, spec_tokens, acceptance, width) <= 1.0

    tried = [b for b in (2 ** i for i in range(max_batch.bit_length())) if b < max_batch]
    first = next((b for b in [*tried, max_batch] if b >= 1 and loses(b)), None)
    if first is None or first == 1:
        return first
    lo, hi = first // 2 if first & (first - 1) == 0 else 2 ** (first.bit_length() - 1), first
    while hi - lo > 1:  # wins at lo, loses at hi
        mid = (lo + hi) // 2
        lo, hi = (lo, mid) if loses(mid) else (mid, hi)
    return hi
