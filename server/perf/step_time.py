"""One step's seconds by named part: what the performance model (server.perf.stepcost) returns
and `size --explain` prints."""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class StepTime:
    """One step's seconds by part; `total_s` is their sum."""

    weights_s: float  # linear layers and lm head streaming their weights (roofline: bytes-bound)
    matmul_s: float  # linear layers and lm head doing arithmetic (roofline: FLOP-bound ones)
    attention_s: float  # decode: K/V reads (+ scores); prefill: score/value FLOPs, score bytes
    elementwise_s: float  # norms, RoPE, activations, residuals, logits
    fixed_s: float  # per layer and per forward pass (op dispatch, graph building)
    step_overhead_s: float  # the engine's own work per step (scheduling, hand-off, sync)
    copy_s: float = 0.0  # KV pool copies: joins, compaction, regrowth
    experts_s: float = 0.0  # MoE: routed experts' gathered matmuls (their weights and FLOPs)
    comm_s: float = 0.0  # between ranks: all-reduces (tensor parallel) or sends (pipeline)
    # Work that grows with the rows, whatever their bytes (profile.py: zero unless set or measured):
    attention_rows_s: float = 0.0  # decode attention's fixed kernel cost per row past the first
    token_ops_s: float = 0.0  # elementwise kernels' fixed cost per token per layer
    sampling_s: float = 0.0  # sampling per sampled row
    # The serving engine's host work (server.perf.engines): per step and per generated token.
    host_step_s: float = 0.0
    host_token_s: float = 0.0
    # Quantized linear layers MLX runs as qmv over several rows (server.perf.qmv): the rows'
    # dequantize-and-multiply at the kernel's own rate past what hides under their weights' bytes
    # (weights_s): plain qmv's rows past the first; qmv_wide's rows where they outlast the bytes.
    gemv_rows_s: float = 0.0
    # Speculative decoding's drafter (spec_price.draft_s): a draft model's K forwards, or the
    # n-gram drafter's lookups on the host.
    draft_s: float = 0.0
    # The serving engine's host work per request started (its first token's prefill chunk).
    host_request_s: float = 0.0
    # A top-p sampler's passes over its rows' logits (engines.top_p_bytes_per_logit) at their own
    # rate (StepCost.top_p_s, GpuFit.top_p_slowdown).
    top_p_s: float = 0.0

    @property
    def total_s(self) -> float:
        return sum(self.values())

    def values(self) -> tuple[float, ...]:
        """The parts in field order (dataclasses.astuple deep-copies: too slow per step)."""
        return tuple(getattr(self, name) for name in _PARTS)

    def __add__(self, other: StepTime) -> StepTime:
        return StepTime(*(a + b for a, b in zip(self.values(), other.values())))

    def times(self, k: float) -> StepTime:
        """k of these one after another (an engine running rows one at a time; a share of one)."""
        return StepTime(*(k * a for a in self.values()))

    def as_dict(self) -> dict[str, float]:
        return {**dict(zip(_PARTS, self.values())), "total_s": self.total_s}

    def shares(self) -> dict[str, float] | None:
        """Each part's fraction of the total (None for a zero total)."""
        total = self.total_s
        return {k: v / total for k, v in zip(_PARTS, self.values())} if total > 0 else None


_PARTS = tuple(f.name for f in dataclasses.fields(StepTime))
