"""Arithmetic of `batchsim size` (pure, no MLX): per Mac and memory size, the memory the GPU may
use, how many sequences fit before the KV cache overruns it (padded vs paged layout), and the
decode tok/s the performance model (server.perf.stepcost, the simulator's) predicts at batch 1
and at the largest batch that fits. A model with sliding-window or linear-attention layers holds
per sequence its exact mlx-lm cache bytes (`ModelSpec.kv_bytes_per_seq`), told apart by kind."""

from __future__ import annotations

import dataclasses
from collections import Counter

import numpy as np
from batchsim.configs import ConfigError
from batchsim.scheduler.kv_bytes import CacheLayout
from batchsim.scheduler.pool_geometry import KV_STEP, PAGE_TOKENS, round_down, round_up
from batchsim.server.models.arch_cache import cache_bytes, generate_calls
from batchsim.server.models.spec import ModelSpec, dtype_bytes
from batchsim.server.perf import macs, spec_price
from batchsim.server.perf.cluster import Cluster
from batchsim.server.perf.engines import DEFAULT_ENGINE, EngineProfile
from batchsim.server.perf.gpu_fit import GpuFit, mac_profile
from batchsim.server.perf.profile import DeviceProfile, compute_dtype
from batchsim.server.perf.qmv import QMM_TILE_ROWS
from batchsim.server.perf.spec_acceptance import Acceptance
from batchsim.server.perf.stepcost import StepCost, StepTime
from batchsim.workloads.lengths import parse_length

MAX_BATCH_CAP = 4096  # no Mac in the catalog decodes more rows usefully; keeps the search bounded
BEST_EVERY_BATCH_TO = 256  # best_batch tries every batch to here, then each qmm tile's last row
FIT_TRIALS = 256  # seeded batches drawn per batch size for a length distribution


@dataclasses.dataclass(frozen=True)
class ContextFit:
    """Tokens of KV a batch of B sequences occupies, for B = 0..cap, at the fit quantile."""

    label: str  # the context spec as given
    fixed: bool  # one length for every sequence: each batch size has one exact answer
    mean_tokens: float  # mean sequence length (the decode width of the tok/s estimate)
    padded_tokens: np.ndarray  # B x round_up(longest of the B, KV_STEP)
    longest_tokens: np.ndarray  # the longest of the B (the row every padded row is as long as)
    paged_tokens: np.ndarray  # sum over the B of round_up(length, PAGE_TOKENS)
    quantile: float
    trials: int
    # Paged, when every sequence starts with the same shared_prefix_tokens: the prefix's whole
    # blocks stored once (a prefix cache), each sequence's other tokens in its own blocks.
    shared_tokens: np.ndarray | None = None  # None: no prefix shared (paged_tokens)
    shared_prefix_tokens: int = 0

    @property
    def paged_shared_tokens(self) -> np.ndarray:
        return self.paged_tokens if self.shared_tokens is None else self.shared_tokens


def context_fit(text: str, max_tokens: int, quantile: float = 0.95, seed: int = 0,
                cap: int = MAX_BATCH_CAP, trials: int = FIT_TRIALS,
                shared_prefix_tokens: int = 0) -> ContextFit:
    """Batch i of size B is the first B lengths of trial row i, so bytes grow with B in every trial
    and the quantile curve is monotone (the max batch is one searchsorted)."""
    spec = parse_length(text)
    if spec.dist == "fixed" and spec.upper > max_tokens:
        raise ConfigError(f"context {spec.upper} exceeds the model's {max_tokens}-token context")
    if spec.dist == "fixed" and shared_prefix_tokens > spec.upper:
        raise ConfigError(f"--shared-prefix {shared_prefix_tokens} exceeds the context "
                          f"{spec.upper} (the prefix is part of every sequence's context)")
    n = 1 if spec.dist == "fixed" else trials
    lengths = spec.sample(n * cap, np.random.default_rng(seed)).reshape(n, cap)
    lengths = np.minimum(lengths, max_tokens)  # a server would not admit longer sequences
    batch = np.arange(1, cap + 1)
    longest = np.maximum.accumulate(lengths, axis=1)
    padded = batch * round_up(longest, KV_STEP)
    paged = np.cumsum(round_up(lengths, PAGE_TOKENS), axis=1)

    def curve(tokens: np.ndarray) -> np.ndarray:
        # "higher": the value of a drawn batch, never an interpolation between two.
        q = np.quantile(tokens, quantile, axis=0, method="higher")
        return np.concatenate([[0], q]).astype(np.int64)

    shared = (curve(shared_paged_tokens(lengths, shared_prefix_tokens))
              if shared_prefix_tokens else None)
    return ContextFit(text, n == 1, float(lengths.mean()), curve(padded), curve(longest),
                      curve(paged), quantile, n, shared, shared_prefix_tokens)


def shared_paged_tokens(lengths: np.ndarray, prefix_tokens: int) -> np.ndarray:
    """Tokens of KV the first B sequences of each row hold in PAGE_TOKENS blocks when each starts
    with the same prefix_tokens: the prefix's whole blocks once (a partial block is not shared),
    the rest per sequence. A sequence shorter than the prefix shares its own whole blocks."""
    shared = np.minimum(round_down(prefix_tokens, PAGE_TOKENS), round_down(lengths, PAGE_TOKENS))
    own = round_up(lengths - shared, PAGE_TOKENS)
    return np.maximum.accumulate(shared, axis=1) + np.cumsum(own, axis=1)


def max_batch(tokens_curve: np.ndarray, budget_bytes: int, kv_bytes_per_token: int) -> int:
    """The largest B whose KV bytes fit the budget (0 when not even one sequence fits)."""
    if budget_bytes <= 0:
        return 0
    return int(np.searchsorted(tokens_curve * kv_bytes_per_token, budget_bytes, side="right")) - 1


@dataclasses.dataclass(frozen=True)
class KvComposition:
    """One sequence's mlx-lm cache bytes by what bounds them."""

    full_kv_bytes: int  # full-attention and MLA layers: grow with the context
    window_kv_bytes: int  # sliding-window layers: capped at their window
    state_bytes: int  # linear-attention layers: fixed, whatever the context

    @property
    def total_bytes(self) -> int:
        return self.full_kv_bytes + self.window_kv_bytes + self.state_bytes


KIND_PART = {"full": 0, "mla": 0, "sliding": 1, "linear": 2}


def kv_composition(spec: ModelSpec, context_tokens: int, dtype: str,
                   kv_bits: int | None = None) -> KvComposition:
    """The per-layer cache bytes of `ModelSpec.kv_bytes_per_seq`, summed by kind."""
    calls, act = generate_calls(context_tokens), dtype_bytes(dtype)
    parts = [0, 0, 0]
    for att, count in Counter(lay.attention for lay in spec.arch.layers).items():
        parts[KIND_PART[att.kind]] += count * cache_bytes(att, calls, act, kv_bits)
    return KvComposition(*parts)


def layered_curves(spec: ModelSpec, ctx: ContextFit, dtype: str, kv_bytes_per_token: int,
                   kv_bits: int | None = None) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(padded, paged, paged with the prefix shared) KV bytes of B sequences, B = 0..cap, for a
    model whose cache is not all full attention: padded, B x one sequence's exact bytes at the
    longest; paged, the full-attention tokens in pages plus B x the window and state bytes at the
    longest (an upper bound; windows and states are never shared)."""
    seq = {int(n): kv_composition(spec, int(n), dtype, kv_bits)
           for n in np.unique(ctx.longest_tokens[1:])}
    batch = np.arange(len(ctx.longest_tokens))
    longest = [seq.get(int(n)) for n in ctx.longest_tokens]
    whole = np.array([c.total_bytes if c else 0 for c in longest], dtype=np.int64)
    bounded = np.array([c.window_kv_bytes + c.state_bytes if c else 0 for c in longest],
                       dtype=np.int64)
    per_seq = batch * bounded
    return (batch * whole, ctx.paged_tokens * kv_bytes_per_token + per_seq,
            ctx.paged_shared_tokens * kv_bytes_per_token + per_seq)


def draft_curve(ctx: ContextFit, draft: CacheLayout) -> np.ndarray:
    """A draft model's cache beside B sequences, B = 0..cap: B rows at the padded capacity of the
    longest (CacheLayout.seq_bytes, the scheduler's and the simulator's price of a draft row;
    padded whatever the target's layout, as draft_model.py holds it)."""
    caps = round_up(ctx.longest_tokens, KV_STEP)
    row = {int(c): draft.seq_bytes(int(c)) for c in np.unique(caps)}
    return np.arange(len(caps)) * np.array([row[int(c)] for c in caps], dtype=np.int64)


def _scaled(c: KvComposition, share: float) -> KvComposition:
    if share == 1.0:
        return c
    return KvComposition(*(round(v * share) for v in dataclasses.astuple(c)))


@dataclasses.dataclass(frozen=True)
class Settings:
    dtype: str
    quantize_bits: int | None
    bandwidth_efficiency: float | None  # None: the fit's for this weight format
    compute_efficiency: float | None  # None: the fit's
    os_reserve_gb: float
    kv_bits: int | None = None  # K/V held as mlx-lm's QuantizedKVCache at 4 or 8 bits
    # The fitted GPU step (server.perf.gpu_fit); None: a plain roofline at the efficiencies above.
    fit: GpuFit | None = None
    engine: EngineProfile | None = None  # the serving engine (server.perf.engines); None: batchsim
    spec_tokens: int = 0  # speculative decoding: K drafted tokens a row verifies per step (0: off)
    acceptance: Acceptance | None = None  # per-position rates and their curve (spec_acceptance)
    draft: ModelSpec | None = None  # the draft model's shapes (None: the n-gram drafter)


def mac_profile_for(mac: macs.Mac, s: Settings) -> DeviceProfile:
    """What `--device-profile` gives for this Mac (efficiencies given in `s` replace the fit's)."""
    if s.fit is not None:
        return mac_profile(mac, s.fit, s.quantize_bits, s.bandwidth_efficiency,
                           s.compute_efficiency)
    return mac.profile(s.bandwidth_efficiency, s.compute_efficiency)


def mac_cost(spec: ModelSpec, mac: macs.Mac, s: Settings,
             cluster: Cluster | None = None) -> StepCost:
    """The simulator's step cost on this Mac; with `cluster`, one rank's share on N such Macs plus
    the link."""
    return StepCost(spec, mac_profile_for(mac, s), s.dtype, s.quantize_bits, s.kv_bits,
                    cluster=cluster, engine=s.engine)


def decode_step(cost: StepCost, batch: int, context_tokens: int) -> StepTime | None:
    """A pure-decode step of `batch` rows, each reading `context_tokens` cached tokens (the
    simulator's width: the new token included). None for batch 0."""
    return cost.step_time(decode_rows=batch, width=context_tokens) if batch else None


def tok_s(step: StepTime | None, batch: int) -> float | None:
    return batch / step.total_s if step is not None else None


def best_batch(cost: StepCost, max_batch: int, width: int) -> tuple[int | None, float | None]:
    """The batch up to `max_batch` whose decode step makes the most tokens per second, and that
    rate (the smallest such batch on a tie; None, None for max_batch 0). Tried: every batch to
    BEST_EVERY_BATCH_TO, then each multiple of the 32-row qmm tile, and max_batch (past the
    small batches a step's time jumps at a tile's first row, so the rate peaks at a tile's last;
    tests/test_size_best.py checks the answer against trying every batch)."""
    if max_batch < 1:
        return None, None
    tried = [*range(1, min(max_batch, BEST_EVERY_BATCH_TO) + 1),
             *range(round_up(BEST_EVERY_BATCH_TO + 1, QMM_TILE_ROWS), max_batch, QMM_TILE_ROWS),
             max_batch]
    rate, batch = max((tok_s(decode_step(cost, b, width), b), -b) for b in tried)
    return -batch, rate


def bound(step: StepTime | None) -> str | None:
    """Which side of the roofline sets the linear layers' time: their FLOPs or their bytes."""
    if step is None:
        return None
    return "compute" if step.matmul_s > step.weights_s else "bandwidth"


def mac_row(spec: ModelSpec, mac: macs.Mac, memory_gb: float, ctx: ContextFit, s: Settings,
            ws: macs.MetalWorkingSet, explain: bool = False,
            cluster: Cluster | None = None) -> dict:
    """One table row: a Mac with `memory_gb` of RAM running `spec` under `s` (with `explain`,
    the predicted step's parts at batch 1 and at the max batch too). With `cluster`: N such
    Macs, each holding its share of the weights and of every sequence's KV (bytes per Mac)."""
    act_dtype = compute_dtype(s.dtype, s.quantize_bits)
    kv_per_token = spec.kv_bytes_per_token(act_dtype, s.kv_bits)
    weights = (cluster.weight_bytes_per_rank(spec, s.dtype, s.quantize_bits) if cluster
               else spec.weight_bytes(s.dtype, s.quantize_bits))
    share = cluster.kv_share(spec) if cluster else 1.0
    kv_tok = round(kv_per_token * share)
    usable = macs.default_working_set_bytes(memory_gb, ws)
    raised = macs.raised_working_set_bytes(memory_gb, ws, s.os_reserve_gb)
    width = round(ctx.mean_tokens)
    if spec.is_dense:  # every layer's K/V grows with the tokens
        curves, unit = (ctx.padded_tokens, ctx.paged_tokens, ctx.paged_shared_tokens), kv_tok
        per_seq = KvComposition(round(ctx.mean_tokens * kv_tok), 0, 0)
    else:
        curves = layered_curves(spec, ctx, act_dtype, kv_per_token, s.kv_bits)
        curves, unit = tuple((c * share).astype(np.int64) for c in curves), 1
        per_seq = _scaled(kv_composition(spec, width, act_dtype, s.kv_bits), share)
    draft = spec_price.draft_cache(s.draft, act_dtype, s.kv_bits)
    if draft is not None:  # a draft model's weights, and its padded row beside every sequence
        weights += spec_price.draft_weight_bytes(s.draft, s.dtype, s.quantize_bits)
        curves, unit = tuple(c * unit + draft_curve(ctx, draft) for c in curves), 1
    (padded, paged, shared), (padded_r, paged_r, shared_r) = (
        [max_batch(curve, limit - weights, unit) for curve in curves] for limit in (usable, raised)
    )
    row = {
        "chip": mac.chip, "gpu_cores": mac.gpu_cores, "label": mac.label, "memory_gb": memory_gb,
        "bandwidth_gbs": mac.bw_gbs, "peaks_estimated": mac.estimate,
        "compute_known": mac.compute_known,
        "usable_bytes": usable, "usable_bytes_raised": raised, "weight_bytes": weights,
        "kv_bytes_per_token": kv_tok, "kv_bytes_per_seq": per_seq.total_bytes,
        # The draft model's K/V per token (its rows padded to the longest; in max_batch*).
        "draft_kv_bytes_per_token": draft.full_token_bytes if draft is not None else None,
        "kv_per_seq": dataclasses.asdict(per_seq),  # at the mean context, by what bounds it
        "max_batch": padded, "max_batch_padded": padded, "max_batch_paged": paged,
        "max_batch_padded_raised": padded_r, "max_batch_paged_raised": paged_r,
        # Paged, every sequence starting with the same shared_prefix_tokens (stored once).
        "max_batch_shared": shared, "max_batch_shared_raised": shared_r,
        "capped": MAX_BATCH_CAP in (padded, paged, shared, padded_r, paged_r, shared_r),
        # Fits: the weights and one sequence (the tightest layout) fit.
        "fits": paged >= 1, "fits_raised": paged_r >= 1,
    }
    return {**row, **_speed(spec, mac, s, cluster, (1 if paged else 0, padded), width, explain)}


def _speed(spec: ModelSpec, mac: macs.Mac, s: Settings, cluster: Cluster | None,
           batches: tuple[int, int], width: int, explain: bool) -> dict:
    """A row's predicted decode at batch 1 and at the max batch (`batches`), its profile and
    engine; a Mac without FLOP/s figures gets no prediction and says why."""
    if not mac.compute_known:
        refused = f"{mac.label}: no FLOP/s figure in configs/macs.yaml, tok/s not predicted"
        none = {"decode_tok_s_b1": None, "decode_tok_s_max_batch": None, "bound_at_max_batch": None,
                "best_batch": None, "decode_tok_s_best": None}
        return {"profile": None, "profile_fitted_on": None, "engine": s.engine.name if s.engine
                else DEFAULT_ENGINE, **none, "refused": refused,
                **({"parts": None, "parts_b1": None} if explain else {})}
    profile, cost = mac_profile_for(mac, s), mac_cost(spec, mac, s, cluster)
    (b1, b_max), steps = batches, [decode_step(cost, b, width) for b in batches]
    out = {"profile": profile.name, "profile_fitted_on": profile.fitted_on or profile.source,
           "engine": cost.engine.name, "decode_tok_s_b1": tok_s(steps[0], b1),
           "decode_tok_s_max_batch": tok_s(steps[1], b_max), "bound_at_max_batch": bound(steps[1])}
    out["best_batch"], out["decode_tok_s_best"] = best_batch(cost, b_max, width)
    if explain:  # StepTime's parts in seconds by name, at the max batch and at batch 1 (None: none)
        out["parts"], out["parts_b1"] = (t.as_dict() if t else None for t in reversed(steps))
    if s.spec_tokens and s.acceptance is not None:
        out.update(_spec_speed(cost, s, b1, b_max, width, explain))
    return out


def _spec_speed(cost: StepCost, s: Settings, b1: int, max_batch: int, width: int,
                explain: bool) -> dict:
    """Speculative decoding at batch 1, the batch where it stops paying and what that answer is
    (spec_price.py); with `explain`, the verify step's parts at batch 1 (the drafter's: draft_s)."""
    k, a = s.spec_tokens, s.acceptance
    drafter = (spec_price.model_drafter(cost, s.draft, s.dtype) if s.draft
               else spec_price.NGRAM)
    fits = b1 >= 1
    b = spec_price.break_even_batch(cost, k, a, width, max_batch, drafter) if fits else None
    out = {"decode_tok_s_b1_spec": spec_price.spec_tok_s(cost, 1, k, a, width, drafter)
           if fits else None, "spec_break_even_batch": b,
           "spec_break_even": spec_price.break_even_verdict(b, computed=fits)}
    if explain:
        out["parts_spec_b1"] = (spec_price.verify_time(cost, 1, k, width, drafter).as_dict()
                                if fits else None)
    return out
