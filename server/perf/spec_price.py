"""Speculative decoding priced by the step cost: a verify step of B rows x (K+1) tokens is the
plain decode step of B rows (StepCost.step_time: weights, each row's cache read once, per-row
work) plus what K more tokens a row add, the step cost's own prefill price of K+1 tokens after
the row's cached ones less that of 1 (StepCost.prefill_time over B rows: the GEMM over the extra
B x K tokens and their attention), plus the drafter's time (draft_s). At K = 0 it is the decode
step. A row emits on average 1 + the sum of its per-position acceptance rates tokens per step
(spec_acceptance.py, at the step's batch); with one rate a accepted independently per draft,
E = (1 - a^(K+1)) / (1 - a) (Leviathan et al. 2023). The simulated executor prices its verify
steps with verify_extra_s and draft_s, and a draft model's prefill of each row new to it with
catch_up_s (the real drafter's, draft_model.py)."""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING, NamedTuple

from batchsim.configs import ConfigError
from batchsim.scheduler.kv_bytes import CacheLayout
from batchsim.server.models.spec import ModelSpec, dtype_bytes
from batchsim.server.perf.profile import compute_dtype
from batchsim.server.perf.spec_acceptance import Acceptance
from batchsim.server.perf.step_time import StepTime
from batchsim.server.perf.stepcost import StepCost

if TYPE_CHECKING:
    from batchsim.server.models.loader import ModelRef

# The n-gram drafter's host time per row and step (vLLM's prompt lookup, speculative.py): process
# CPU time of ngram_proposal finding no match (its usual case, and its dearest: every n from 5 to
# 2 tried) on W tokens, a + b x W fitted over W = 128..8192. `benchmarks/ngram_host_cost.py`,
# 2026-12-04, AMD EPYC VM, numpy 2.4.6, load average 4.5: 174 / 250 / 578 / 1,739 us at W = 128 /
# 512 / 2048 / 8192. Applied as measured on every device (the project does not scale host costs
# between CPUs; an Apple core is likely faster, so on a Mac it is an upper bound).
NGRAM_ROW_US = 158.8
NGRAM_TOKEN_NS = 193.5


class Drafter(NamedTuple):
    """Who drafts: a draft model (its step cost on the same device and engine) or, with none, the
    n-gram drafter."""

    cost: StepCost | None = None  # the draft model's; None: the n-gram drafter
    name: str = "ngram"  # the draft model's name, or ngram


NGRAM = Drafter()


ROLLBACK_KINDS = ("full", "mla")  # layer kinds whose cache a verify step can cut back


def check_layers(spec: ModelSpec, method: str) -> None:
    """ConfigError, in one line naming the layer kind, for a model whose cache cannot roll back
    rejected drafts: a sliding ring overwrites the slots they would free, a linear-attention
    state has taken them in."""
    kinds = sorted({lay.attention.kind for lay in spec.arch.layers} - set(ROLLBACK_KINDS))
    if kinds:
        raise ConfigError(f"--spec-method {method}: the model has {kinds[0]}-attention layers, "
                          "whose cache cannot roll back rejected drafts; speculative decoding "
                          "needs full-attention or MLA layers only")


def check_speculation(target: ModelSpec, draft: ModelSpec | None) -> ModelSpec | None:
    """Speculation on `target` (drafted by `draft`, None: n-gram) as a run checks it: layers that
    roll back, a draft model's vocabulary; returns the draft."""
    check_layers(target, "ngram" if draft is None else "draft")
    if draft is not None:
        check_draft_model(draft, target)
    return draft


def check_draft_model(draft: ModelSpec, target: ModelSpec) -> None:
    """A draft model's caches are cut back as the target's are, and it proposes the target's
    token ids (the same vocabulary); else a one-line error. Real runs, the simulator and `size`
    alike."""
    check_layers(draft, "draft")
    if draft.vocab_size != target.vocab_size:
        raise ConfigError(f"--draft-model {draft.name}: a vocabulary of {draft.vocab_size} "
                          f"tokens, {target.name}'s has {target.vocab_size}; a draft model must "
                          "share the tokenizer")


def model_drafter(cost: StepCost, draft: ModelSpec, dtype: str) -> Drafter:
    """The draft model priced by the target's step cost's device, engine, weight format and KV
    bits (the real executor loads it so: factory._drafter); its K/V padded, whatever the
    target's layout: the draft model keeps mlx-lm caches of its own, never the paged pool."""
    return Drafter(StepCost(draft, cost.profile, dtype, cost.quantize_bits, cost.kv_bits,
                            engine=cost.base_engine), draft.name)


def draft_spec(cfg, target: ModelRef) -> ModelSpec | None:
    """A run config's draft model (--spec-method draft --draft-model M), checked against the
    target as a real run checks it (check_draft_ref) before anything loads; None: no draft
    model."""
    if getattr(cfg, "spec_method", "none") != "draft":
        return None
    from batchsim.server.models.loader import stored_ref

    draft = stored_ref(cfg.draft_model, target.dtype, target.quantize_bits)
    check_draft_ref(draft, target, cfg.kv_bits)
    return draft.spec


def check_draft_ref(draft: ModelRef, target: ModelRef, kv_bits: int | None) -> None:
    """check_draft_model, its K/V quantizable at --kv-bits, and its weights in the form every
    account prices them (the target's dtype and weight format: draft_weight_bytes, model_drafter,
    draft_cache): a zoo draft is built so; a directory or hub draft is loaded as stored, so one
    stored otherwise is refused in one line."""
    check_draft_model(draft.spec, target.spec)
    draft.spec.check_kv_bits(kv_bits)
    if _priced_as(draft) != _priced_as(target):
        raise ConfigError(f"--draft-model {draft.name}: stored as {_weight_format(draft)} "
                          f"weights, {target.name} runs in {_weight_format(target)}; a draft "
                          "model directory or hub id is loaded as stored, so give one in the "
                          "target's format (or a zoo model)")


def _priced_as(ref: ModelRef) -> tuple[int | None, int]:
    """What the account prices a model's weights by: its bits and its (scales') dtype's bytes (a
    bfloat16 and a float16 draft hold the same bytes)."""
    return ref.quantize_bits, dtype_bytes(ref.dtype)


def _weight_format(ref: ModelRef) -> str:
    bits = ref.quantize_bits
    return f"{bits}-bit ({ref.dtype} scales)" if bits else ref.dtype


def draft_weights(cfg, target: ModelRef) -> int:
    """The draft model's weights under run config `cfg`, held beside the target's in its format
    (weights_beside, as draft_account and a simulated session count them); 0: no draft model.
    What a session checks before the target loads and counts where no drafter is loaded."""
    return weights_beside(draft_spec(cfg, target), target)


def weights_beside(draft: ModelSpec | None, target: ModelRef) -> int:
    """`draft`'s weights held beside `target`'s, in its dtype and weight format; 0: None."""
    return draft_weight_bytes(draft, target.dtype, target.quantize_bits)


def draft_account(cfg, target: ModelRef) -> tuple[int, CacheLayout | None]:
    """The draft model's weights (draft_weights') and its cache per pool row (draft_cache at the
    target's activation dtype and --kv-bits) under run config `cfg`, its spec resolved once;
    (0, None): no draft model. Sweep's analytic limit counts it by."""
    draft = draft_spec(cfg, target)
    act = compute_dtype(target.dtype, target.quantize_bits)
    return weights_beside(draft, target), draft_cache(draft, act, cfg.kv_bits)


def priced_cache(cfg, target: ModelRef, draft: ModelSpec | None) -> CacheLayout:
    """The target's cache per sequence at its activation dtype and --kv-bits, with `draft`'s rows
    beside it (draft_cache): the one layout the simulator and a simulated session price."""
    act = compute_dtype(target.dtype, target.quantize_bits)
    return target.spec.cache_layout(act, cfg.kv_bits).with_draft(
        draft_cache(draft, act, cfg.kv_bits))


def draft_cache(draft: ModelSpec | None, dtype: str,
                kv_bits: int | None = None) -> CacheLayout | None:
    """The draft model's cache per pool row (CacheLayout.draft): its layers in the target's
    activation dtype, at the target's --kv-bits (the real drafter's DecodePool quantizes its K/V
    as the target's pool does); None: no draft model. Scheduler, simulator and `size` add it
    through CacheLayout.seq_bytes."""
    return None if draft is None else draft.cache_layout(dtype, kv_bits)


def draft_weight_bytes(draft: ModelSpec | None, dtype: str, quantize_bits: int | None) -> int:
    """The draft model's weights in the target's dtype and weight format, as the real executor
    loads it (factory._drafter: quantized like the target, mlx-lm's group of 64) and
    model_drafter prices its forwards (session and `size` alike); 0: no draft model."""
    return 0 if draft is None else draft.weight_bytes(dtype, quantize_bits)


def draft_s(drafter: Drafter, batch: int, spec_tokens: int, width: int) -> float:
    """The drafter's seconds in a step where `batch` rows each ask for K drafts after `width`
    tokens: a draft model's K decode forwards over the B rows (StepCost.decode_time), or the
    n-gram lookup per row (paid whether it finds a match or not). No drafts asked: none."""
    if not spec_tokens or not batch:
        return 0.0
    if drafter.cost is None:
        return batch * (NGRAM_ROW_US * 1e-6 + NGRAM_TOKEN_NS * 1e-9 * width)
    return spec_tokens * drafter.cost.decode_time(batch, width).total_s


def catch_up_s(drafter: Drafter, contexts: Iterable[int]) -> float:
    """A draft model catching up on rows new to it: each row's context but its last token (which
    the first draft forward feeds) prefilled alone, no logits, at the draft model's price of a
    prefill (StepCost.prefill_forward_s, the target's formula). The n-gram drafter: nothing."""
    if drafter.cost is None:
        return 0.0
    return sum(drafter.cost.prefill_forward_s(n, 0, False) for n in contexts if n)


def verify_extra_s(cost: StepCost, batch: int, spec_tokens: int, width: int) -> float:
    """What K more tokens a row add to a decode step of `batch` rows after `width` tokens."""
    if not spec_tokens:
        return 0.0
    return (cost.prefill_forward_s(spec_tokens + 1, width, True, batch)
            - cost.prefill_forward_s(1, width, True, batch))


def verify_time(cost: StepCost, batch: int, spec_tokens: int, width: int,
                drafter: Drafter = NGRAM, verified: float = 1.0) -> StepTime:
    """A verify step by named part: the decode step, K more tokens a row (the prefill parts of
    K+1 tokens less those of 1) and the drafter (`draft_s`). `verified`: the chance the step
    verifies drafts at all (spec_tok_s), which weighs the K more tokens."""
    step = cost.step_time(decode_rows=batch, width=width)
    if not spec_tokens:
        return step
    more, one = (cost.prefill_time(n, width, True, batch).values() for n in (spec_tokens + 1, 1))
    extra = StepTime(*(verified * (a - b) for a, b in zip(more, one)))
    return step + extra + StepTime(*(0.0,) * 6, draft_s=draft_s(drafter, batch, spec_tokens,
                                                                 width))


def verify_step(cost: StepCost, batch: int, spec_tokens: int, width: int,
                drafter: Drafter = NGRAM) -> float:
    """Seconds of B rows x (K+1) tokens in one forward pass, each row after `width` cached
    tokens, and their drafting: verify_time's total."""
    return verify_time(cost, batch, spec_tokens, width, drafter).total_s


def spec_tok_s(cost: StepCost, batch: int, spec_tokens: int, acceptance: Acceptance,
               width: int, drafter: Drafter = NGRAM) -> float:
    """Every row asks the drafter each step; a step verifies K more tokens a row when any of its
    rows drafted (each with the draft share's chance), else it is the plain decode step."""
    drafting = 1.0 - (1.0 - acceptance.draft_share) ** batch
    step_s = verify_time(cost, batch, spec_tokens, width, drafter, drafting).total_s
    return batch * acceptance.expected_tokens(spec_tokens, batch) / step_s


def gain(cost: StepCost, batch: int, spec_tokens: int, acceptance: Acceptance,
         width: int, drafter: Drafter = NGRAM) -> float:
    """Speculative over plain decode tok/s at this batch."""
    plain = batch / cost.step_time(decode_rows=batch, width=width).total_s
    return spec_tok_s(cost, batch, spec_tokens, acceptance, width, drafter) / plain


def break_even_batch(cost: StepCost, spec_tokens: int, acceptance: Acceptance, width: int,
                     max_batch: int, drafter: Drafter = NGRAM) -> int | None:
    """The smallest batch (<= max_batch) at which speculation no longer beats plain decoding;
    None if it beats it at every batch tried. Tried: powers of two and max_batch, then bisection
    below the first that loses. (The gain is not monotone: it falls while batching amortizes the
    weights, and can rise again where long contexts make decode read mostly KV, which a verify
    step reads once for K+1 tokens.)"""
    def loses(b: int) -> bool:
        return gain(cost, b, spec_tokens, acceptance, width, drafter) <= 1.0

    tried = [b for b in (2 ** i for i in range(max_batch.bit_length())) if b < max_batch]
    first = next((b for b in [*tried, max_batch] if b >= 1 and loses(b)), None)
    if first is None or first == 1:
        return first
    lo, hi = first // 2 if first & (first - 1) == 0 else 2 ** (first.bit_length() - 1), first
    while hi - lo > 1:  # wins at lo, loses at hi
        mid = (lo + hi) // 2
        lo, hi = (lo, mid) if loses(mid) else (mid, hi)
    return hi


def break_even_verdict(batch: int | None, computed: bool = True) -> str:
    """What spec_break_even_batch means: stops_paying (plain batching is as fast from that
    batch), never_pays (it is at batch 1), pays_at_every_batch (null: speculation still wins at
    the largest batch tried) or not_computed (null: no batch was priced)."""
    if not computed:
        return "not_computed"
    if batch is None:
        return "pays_at_every_batch"
    return "never_pays" if batch == 1 else "stops_paying"
