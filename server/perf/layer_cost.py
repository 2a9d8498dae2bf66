"""Every model's forward pass priced layer by layer from the per-layer description
(server/models/arch.py), with StepCost's building blocks (its linear-layer terms, byte rates and
fixed costs). A dense model is the case "every layer alike, full attention": one layer priced
once, times the layer count. Identical layers (and identical attentions) are priced once; the
integer work (bytes, scores, FLOPs) of a group is summed before it becomes seconds.

Per layer, a decode step of B rows padded to `width` cached tokens reads:
- linear layers: every non-routed matrix once (attention projections, router, shared experts);
  routed experts: the expected distinct experts E(1 - (1 - k/E)^B), each streamed once and
  multiplying the B*k/D tokens routed to it, where MLX runs one mat-vec per (token, expert) pair
  (gather_qmv) each pair past its expert's first a qmv row, or on a calibrated device each pair
  at its measured cost (`experts_s`);
- attention: full and MLA layers `width` tokens, sliding layers min(width, W), linear-attention
  layers their fixed state, read and written every step; MLA adds the absorbed attention's FLOPs;
  in the paged layout, full and MLA layers' read costs PAGED_READ_RATIO times the padded read
  (the gather of each row's blocks, as measured).
Assumptions (no Metal here to fit them) are the named constants below."""

from __future__ import annotations

from collections import Counter
from functools import cached_property, lru_cache
from typing import Protocol

from batchsim.server.models.arch_cache import STATE_BYTES, Attention
from batchsim.server.models.arch_families import Layer, Mat
from batchsim.server.models.spec import ModelSpec
from batchsim.server.perf.profile import (
    KV_DEQUANT_OPS_PER_ELEMENT,
    Calibration,
    DeviceProfile,
    GemmFit,
    log_interp,
)
from batchsim.server.perf.qmv import mlx_release


class Blocks(Protocol):
    """What LayerCost uses of StepCost (its building blocks)."""

    spec: ModelSpec
    profile: DeviceProfile
    cal: Calibration | None
    gemm: GemmFit | None
    act_dtype: str
    act_bytes: int
    kv_bits: int | None
    paged: bool  # the paged KV layout: full and MLA layers' decode reads gather blocks

    def linear_parts(self, m: int, k: int, n: int) -> tuple[float, float, float]: ...
    def matrix_s(self, m: int, k: int, n: int) -> float: ...
    def linear_terms(self, m: float, k: int, n: int) -> tuple[float, float]: ...
    def bytes_s(self, nbytes: float) -> float: ...
    def weight_stream_s(self, k: int, n: int) -> float: ...
    def qmv_rows_s(self, rows: float, k: int, n: int) -> float: ...


# Assumed: a gathered expert matmul (mlx's gather_qmm) reaches half the dense GEMM rate per FLOP
# (small per-expert tiles, index gathers). Only compute-bound (large-batch) steps feel it.
GATHER_MATMUL_EFFICIENCY = 0.5
# How MLX runs routed experts (mlx-lm switch_layers.py SwitchGLU, mlx-swift-lm SwitchLayers.swift
# SwitchGLU: both `indices.size >= 64`, mlx-swift-lm's from 2.30.3 (51723b33; `> 64` before: 64
# pairs stay unsorted, as no published row's, so one gate for both; an engine that never sorts
# never reaches gather_qmm_rhs, which runs_gather_qmv does not ask); ml-explore/mlx
# mlx/backend/metal/quantized.cpp
# GatherQMM::eval_gpu): SwitchGLU gives every (token, expert) pair its own one-row matrix (M = 1)
# and sorts the pairs by expert from SORT_PAIRS on. P pairs over E experts run gather_qmm_rhs (one
# grouped matmul per expert) only where P >= 16, the pairs are sorted and P / E >= 8
# (ml-explore/mlx#2078 and #2082, first in v0.25.0) or >= 4 (#2609, v0.29.2; before v0.25.0 no
# such kernel): qwen3-30b-a3b's 128 experts top-8 from B = 64 tokens, gpt-oss-20b's 32 top-4 from
# B = 32, qwen3-next-80b-a3b's 512 top-10 from B = 205. Otherwise gather_qmv runs one mat-vec per
# pair (grid (M, N/8, P)): each pair dequantizes and multiplies its expert's whole matrix, sorted
# or not. Priced as that: distinct experts' bytes once (a repeat read of an expert assumed to hit
# the cache: sorted pairs run back to back, unsorted ones at small P together), and under
# gather_qmv each pair past its expert's first a qmv row at the profile's quantized_gemv_row_gflops
# (as a dense qmv's rows past the first: StepCost.linear_parts), in the step's gemv_rows_s (its
# expert's FLOPs in _experts_s one row's). '0.29.2.dev' takes the 8 gate, though #2609 landed in
# its dev cycle (its only rows are B = 1: no effect). Unvalidated at the gate: no published decode
# row reaches it, and the step drops there (`size` notes it; docs/models.md, MoE).
SORT_PAIRS = 64
GATHER_RHS_MIN_PAIRS = 16
GATHER_RHS_PAIRS_PER_EXPERT = (((0, 29, 2, 0), 4), ((0, 25, 0, 0), 8))  # (MLX since, P / E)
# Assumed: the gated-delta update touches each recurrent-state element ~6 times per token.
LINEAR_FLOPS_PER_STATE_ELEMENT = 6
# Measured on the CPU only: one full-attention layer's decode read in the paged layout (mx.take
# of each row's blocks into (B, heads, width, dim), then attention) over the padded pool's slice,
# by batch: `benchmarks/paged_gather.py --batch 1,8,32 --context 256` (2026-12-04, MLX 0.32.4 CPU
# backend, 2-core EPYC VM under load). Between and beyond: linear in log2(B), held at the ends.
# Other backends (Metal, CUDA): not measured; the simulator charges these CPU ratios on every
# device profile. There the gather reads and writes the rows' K/V once more before attention
# reads them, so a bandwidth-bound step could pay up to about 3x the padded read (an estimate
# by bytes moved, not a measurement). Charged only where the real executor gathers: the
# target's full and MLA layers in a paged pool (not sliding or linear layers, prefill's private
# caches, or a draft model's own caches).
PAGED_READ_RATIO = ((1, 1.36), (8, 1.41), (32, 1.59))


def paged_read_ratio(batch: int) -> float:
    """PAGED_READ_RATIO at `batch` rows."""
    return log_interp(PAGED_READ_RATIO, batch)


def roofline_split(moved_s: float, flops_s: float, overlapped: bool) -> tuple[float, float]:
    """(weights_s, matmul_s) of a linear layer on a catalog Mac. A matrix-vector kernel (MLX's
    gemv / qmv for one row) hides its math under the weight stream: the binding term alone. A
    matrix-matrix kernel (several rows: MLX's tiled gemm / qmm) loads a tile, then multiplies it,
    and does not overlap the two: both terms. (The published M4 bf16 ladder, vllmcpp_m4_mlx, grows
    by its FLOPs from B=2 on, where the binding term alone stays flat.) Routed experts keep the
    binding term (a few tokens per expert; no published ladder separates the two)."""
    if overlapped:
        return (moved_s, 0.0) if moved_s >= flops_s else (0.0, flops_s)
    return moved_s, flops_s


def runs_gather_qmv(pairs: int, experts: int, mlx: str = "") -> bool:
    """Whether MLX `mlx` ('': the newest) runs `pairs` routed (token, expert) pairs over `experts`
    as gather_qmv (a mat-vec per pair), not gather_qmm_rhs (a grouped matmul per expert)."""
    if pairs < max(SORT_PAIRS, GATHER_RHS_MIN_PAIRS):
        return True
    release = mlx_release(mlx)
    per = next((p for since, p in GATHER_RHS_PAIRS_PER_EXPERT if release >= since), None)
    return per is None or pairs // experts < per


def gather_rhs_batch(spec: ModelSpec, mlx: str = "", cap: int = 4096) -> int | None:
    """The first decode batch (tokens) up to `cap` whose routed pairs MLX `mlx` runs as
    gather_qmm_rhs, where the priced step drops (None: a dense model, or past `cap`)."""
    ffn = next((lay.ffn for lay in spec.arch.layers if lay.ffn.kind == "moe"), None)
    return None if ffn is None else next(
        (b for b in range(2, cap + 1) if not runs_gather_qmv(b * ffn.top_k, ffn.experts, mlx)),
        None)


def expected_experts(experts: int, top_k: int, tokens: int) -> float:
    """Distinct experts B tokens route to, each picking top_k of E uniformly: E(1-(1-k/E)^B).
    Real routers are skewed, so this is an upper bound on the experts (bytes) a step reads."""
    return experts * (1.0 - (1.0 - top_k / experts) ** tokens)


class LayerCost:
    """Per-layer parts of a model's forward passes, as plain seconds."""

    def __init__(self, cost: Blocks):
        self.cost = cost
        self.spec = cost.spec
        self.layers = Counter(cost.spec.arch.layers)  # identical layers are priced once
        self.attentions = Counter(layer.attention for layer in cost.spec.arch.layers)
        # Decode attention grows linearly with the width (no window, no fixed state): a decode
        # forward is a base plus seconds per token of width (StepCost.decode_parts).
        self.linear_in_width = all(att.kind in ("full", "mla") for att in self.attentions)
        self.linear_split_s = lru_cache(maxsize=4096)(self._linear_split_s)  # per instance
        self.linear_s = lru_cache(maxsize=4096)(self._linear_s)
        self.per_width_s = lru_cache(maxsize=4096)(self._per_width_s)

    # -- linear layers and routed experts ------------------------------------------------------
    def _linear_split_s(self, m: int) -> tuple[float, float, float, float]:
        """(weights_s, matmul_s, experts_s, gemv_rows_s) of every layer's matrices over m rows
        (lm head excluded): each distinct layer's sum, times its count."""
        total = [0.0, 0.0, 0.0, 0.0]
        for layer, count in self.layers.items():
            per = [0, 0, 0, 0]
            for mat in layer.mats:
                if mat.routed:
                    experts_s, repeats_s = self.routed_parts_s(mat, layer, m)
                    per[2] += experts_s
                    per[3] += repeats_s
                    continue
                w, f, g = self.cost.linear_parts(m, mat.in_dim, mat.out_dim)
                per[0] += mat.count * w
                per[1] += mat.count * f
                per[3] += mat.count * g
            for j in (0, 1, 2, 3):
                total[j] += per[j] * count
        return total[0], total[1], total[2], total[3]

    def _linear_s(self, m: int) -> float:
        """Every layer's matrices over m rows in seconds (lm head excluded): the simulator's sum
        (StepCost.matrix_s per matrix; the routed experts' stacks as in `_linear_split_s`)."""
        total = 0.0
        for layer, count in self.layers.items():
            per = sum(sum(self.routed_parts_s(mat, layer, m))  # experts_s + repeats_s
                      if mat.routed
                      else mat.count * self.cost.matrix_s(m, mat.in_dim, mat.out_dim)
                      for mat in layer.mats)
            total += per * count
        return total

    @cached_property
    def moe_layers(self) -> int:
        """Layers with routed experts."""
        return sum(n for layer, n in self.layers.items() if any(m.routed for m in layer.mats))

    def routed_parts_s(self, mat: Mat, layer: Layer, m: int) -> tuple[float, float]:
        """One routed-expert matrix stack over m tokens: (experts_s, repeats_s), the experts' and
        the qmv rows of their repeat pairs (StepCost.qmv_rows_s), the pairs counted once. Rows it
        prices at 0 (float weights, no fitted qmv row rate) are not priced apart: _experts_s
        keeps all the pairs' FLOPs (as StepCost.linear_parts does with its rows)."""
        repeats = self.repeat_pairs(layer, m)
        repeats_s = self.cost.qmv_rows_s(repeats, mat.in_dim, mat.out_dim) if repeats else 0.0
        return self._experts_s(mat, layer, m, repeats if repeats_s else 0.0), repeats_s

    def _experts_s(self, mat: Mat, layer: Layer, m: int, repeats: float) -> float:
        """D distinct experts, each streaming its weights once (at the profile's
        expert_bandwidth_efficiency of the achievable rate), and the m*k (token, expert) pairs'
        gathered mat-vecs. A calibrated device prices each pair at its measured cost
        (expert_cost.py: what mlx-lm's SwitchGLU takes per pair and per routed multiply-add);
        otherwise each expert moves its m*k/D tokens and multiplies them (one under gather_qmv,
        `repeats` > 0: the repeats' qmv rows have the rest) at GATHER_MATMUL_EFFICIENCY of the
        GEMM rate."""
        ffn = layer.ffn
        distinct = expected_experts(ffn.experts, ffn.top_k, m)
        cal = self.cost.cal
        if cal is not None and cal.experts_ns_per_mac > 0:
            moved_s = self.cost.weight_stream_s(mat.in_dim, mat.out_dim)
            per_pair_ns = (cal.experts_ns_per_pair
                           + mat.in_dim * mat.out_dim * cal.experts_ns_per_mac)
            return (distinct * moved_s / self.cost.profile.expert_bandwidth_efficiency
                    + m * ffn.top_k * per_pair_ns * 1e-9)
        moved_s, flops_s = self.cost.linear_terms(m * ffn.top_k / distinct, mat.in_dim, mat.out_dim)
        if repeats:  # gather_qmv: the FLOPs of the pairs past an expert's
            flops_s = self.cost.linear_terms(1.0, mat.in_dim, mat.out_dim)[1]  # first: qmv rows
        moved_s /= self.cost.profile.expert_bandwidth_efficiency
        flops_s /= GATHER_MATMUL_EFFICIENCY
        if self.cost.gemm is not None:
            return distinct * (moved_s + flops_s)
        return distinct * max(moved_s, flops_s)

    def repeat_pairs(self, layer: Layer, m: int) -> float:
        """The (token, expert) pairs of m tokens past their experts' first that MLX runs as
        gather_qmv rows (0 where it does not, or where they are not priced apart: one token's
        top_k experts are distinct; a calibrated device's per-pair cost has them)."""
        ffn, cost = layer.ffn, self.cost
        pairs = m * ffn.top_k
        if (m <= 1 or cost.cal is not None
                or not runs_gather_qmv(pairs, ffn.experts, cost.profile.mlx_version)):
            return 0.0
        return pairs - expected_experts(ffn.experts, ffn.top_k, m)

    def _head_split(self, rows: int) -> tuple[float, float, float]:
        if not rows:
            return 0.0, 0.0, 0.0
        return self.cost.linear_parts(rows, self.spec.hidden_size, self.spec.vocab_size)

    # -- attention by layer kind ---------------------------------------------------------------
    def attention_decode_s(self, att: Attention, batch: int, width: int, count: int = 1) -> float:
        """`count` such layers' decode attention: K/V (or latent) of the tokens they keep (a
        sliding layer at most its window), or their state."""
        if att.kind == "linear":
            return self._state_s(att, batch, tokens=batch, count=count)
        tokens = min(width, att.window) if att.kind == "sliding" else width
        return self._per_token_s(att, batch, count) * tokens

    def _per_token_s(self, att: Attention, batch: int, count: int) -> float:
        """`count` full, sliding or MLA layers' decode attention per cached token they read."""
        kv_bits = self.cost.kv_bits
        nbytes = count * batch * att.token_bytes(self.cost.act_bytes, kv_bits)
        scores = count * batch * self.spec.num_heads
        seconds = self._kv_read_s(nbytes, scores)
        if kv_bits is not None:  # dequantize what was read (an assumption, not measured)
            elements = count * batch * att.heads * (att.k_dim + att.v_dim)
            seconds += elements * KV_DEQUANT_OPS_PER_ELEMENT / self._flops_per_s
        if att.kind == "mla":  # absorbed: q.latent+rope scores, then scores.latent, per head
            seconds = max(seconds, 2 * scores * (2 * att.k_dim + att.v_dim) / self._flops_per_s)
        if self.cost.paged and att.kind != "sliding":
            seconds *= paged_read_ratio(batch)
        return seconds

    def _per_width_s(self, batch: int) -> float:
        """Decode attention's seconds per token of width (every layer full attention or MLA)."""
        return sum(self._per_token_s(att, batch, count) for att, count in self.attentions.items())

    def decode_attention_s(self, batch: int, width: int) -> float:
        if self.linear_in_width:
            return self.per_width_s(batch) * width
        return sum(self.attention_decode_s(att, batch, width, count)
                   for att, count in self.attentions.items())

    def attention_prefill_s(self, att: Attention, n: int, start: int, count: int = 1) -> float:
        """`count` such layers' attention over a chunk of n tokens after `start` cached ones (a
        sliding layer computes over the window - 1 tokens it kept plus the chunk)."""
        if att.kind == "linear":
            return self._state_s(att, 1, tokens=n, count=count)
        s, cost = self.spec, self.cost
        ctx = (min(start, att.window - 1) if att.kind == "sliding" else start) + n
        if att.kind == "mla":  # priced in the absorbed form (mlx-lm expands the latent for L > 1)
            flops = count * 2 * s.num_heads * n * ctx * (2 * att.k_dim + att.v_dim)
        else:
            flops = 4 * count * s.num_heads * s.head_dim * n * ctx
        if cost.cal is not None:
            score_bytes = count * s.num_heads * n * ctx * 4
            return (flops * cost.cal.attention_prefill_ns_per_flop
                    + score_bytes * cost.cal.attention_prefill_ns_per_score_byte) * 1e-9
        kv_read = ctx * count * att.token_bytes(cost.act_bytes, cost.kv_bits)
        return max(flops / self._flops_per_s, kv_read / cost.profile.bytes_per_s)

    def prefill_attention_s(self, n: int, start: int) -> float:
        return sum(self.attention_prefill_s(att, n, start, count)
                   for att, count in self.attentions.items())

    def _state_s(self, att: Attention, rows: int, tokens: int, count: int = 1) -> float:
        """Linear-attention layers: conv and recurrent state read and written once per call per
        row, whatever the context; the update's FLOPs per token."""
        nbytes = 2 * count * rows * (att.conv_elems * self.cost.act_bytes
                                     + att.state_elems * STATE_BYTES)
        flops = count * tokens * att.state_elems * LINEAR_FLOPS_PER_STATE_ELEMENT
        return max(self.cost.bytes_s(nbytes), flops / self._flops_per_s)

    def _kv_read_s(self, nbytes: int, scores: int) -> float:
        cal = self.cost.cal
        if cal is not None:
            return (nbytes * cal.attention_decode_ns_per_byte
                    + scores * cal.attention_decode_ns_per_score) * 1e-9
        return nbytes / self.cost.profile.kv_bytes_per_s

    @property
    def _flops_per_s(self) -> float:
        return self.cost.profile.flops_per_s(self.cost.act_dtype)

    # -- elementwise ---------------------------------------------------------------------------
    def elementwise_bytes(self, m: int, logits: bool) -> float:
        """Norms, RoPE, activations and residuals of every layer (the FFN width being the active
        one: top_k experts plus shared; plus the router's scores) and the logits (float32; the
        engine's sampler's passes over them are sampler_bytes)."""
        s = self.spec
        attn = 2 * (s.num_heads + 2 * s.num_kv_heads) * s.head_dim
        per_row = 0
        for layer, count in self.layers.items():
            f = layer.ffn
            width = (f.intermediate if f.kind == "dense"
                     else f.top_k * f.expert_intermediate + f.shared_intermediate)
            per_row += count * (6 * s.hidden_size + 3 * width + attn + f.experts)
        return m * per_row * self.cost.act_bytes + (m * s.vocab_size * 4 if logits else 0)

    def sampler_bytes(self, m: int) -> float:
        """The engine's top-p sampler's passes over m rows' logits (StepCost.top_p_s), beyond
        elementwise_bytes(m, logits=True); StepCost.elementwise_bytes adds them."""
        return m * self.spec.vocab_size * self.cost.engine.sampler_bytes_per_logit(
            self.spec.vocab_size, self.cost.act_dtype)

    # -- whole passes: (weights_s, matmul_s, experts_s, attention_s, gemv_rows_s) --------------
    def decode(self, batch: int, width: int) -> tuple[float, float, float, float, float]:
        weights_s, matmul_s, experts_s, gemv_s = self.linear_split_s(batch)
        head = self._head_split(batch)
        return (weights_s + head[0], matmul_s + head[1], experts_s,
                self.decode_attention_s(batch, width), gemv_s + head[2])

    def prefill(self, n: int, start: int, sample: bool,
                rows: int = 1) -> tuple[float, float, float, float, float]:
        """`rows` prompts' chunks of n tokens in one forward pass (one GEMM over rows x n)."""
        weights_s, matmul_s, experts_s, gemv_s = self.linear_split_s(rows * n)
        head = self._head_split(rows if sample else 0)
        return (weights_s + head[0], matmul_s + head[1], experts_s,
                rows * self.prefill_attention_s(n, start), gemv_s + head[2])
