"""The performance model: seconds of one engine step from a model's shapes, its weight format and
a device profile. `size`, `sweep`, `validate` and the simulated executor all ask it.

With a calibrated profile each term is measured on the device: the linear layers from a fitted
GEMM model, attention per K/V byte (decode) or FLOP (prefill), elementwise ops per byte, and
fixed costs per layer and per forward pass. Without one (a Mac from the catalog) each linear layer
is its bytes at the achievable bandwidth and its FLOPs at the achievable matmul rate (one row: the
larger; several rows: both, layer_cost.roofline_split), the other terms move their bytes at the
achievable bandwidth, and the profile's fixed time per layer and per forward pass (fitted on
published MLX measurements: server.perf.mac_fit) is `fixed_s`.

`step_time` returns the named parts (`StepTime`); the simulator's fast path (`decode_parts`,
`prefill_forward_s`) adds up the same building blocks without building them."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable
from functools import cached_property, lru_cache
from typing import Protocol

from batchsim.scheduler import prefill_groups
from batchsim.server.models.spec import ModelSpec, dtype_bytes
from batchsim.server.perf.cluster import Cluster
from batchsim.server.perf.engines import EngineProfile, load_engine
from batchsim.server.perf.kernels import kernel_layers
from batchsim.server.perf.layer_cost import LayerCost, roofline_split
from batchsim.server.perf.profile import Calibration, DeviceProfile, compute_dtype
from batchsim.server.perf.qmv import on_neural_accelerators, qmm_rows, qmv_parts, runs_qmv
from batchsim.server.perf.step_time import StepTime
from batchsim.server.perf.weight_bytes import (
    matrix_weight_bytes,
    quantized_ceilings,
    weight_format,
)


class Chunk(Protocol):
    """A prefill chunk as the step cost reads it (scheduler.plan.PrefillChunk is one)."""

    num_tokens: int
    start: int
    sample: bool
    fresh: bool  # its request has no token yet (False: a recompute): host_request_us is paid


class StepCost:
    def __init__(self, spec: ModelSpec, profile: DeviceProfile, dtype: str,
                 quantize_bits: int | None, kv_bits: int | None = None,
                 cluster: Cluster | None = None, engine: EngineProfile | None = None,
                 paged: bool = False):
        self.spec = spec
        self.paged = paged  # the paged KV layout (layer_cost.PAGED_READ_RATIO)
        self.profile = profile
        self.cal: Calibration | None = profile.calibration
        self.base_engine = engine or load_engine()  # as given: another StepCost scales it again
        self.engine = self.base_engine
        if profile.host_scale != 1.0:  # the engine's host work on this Mac's CPU
            self.engine = dataclasses.replace(
                self.engine, host_step_us=self.engine.host_step_us * profile.host_scale,
                host_token_us=self.engine.host_token_us * profile.host_scale,
                host_request_us=self.engine.host_request_us * profile.host_scale)
        # An engine that runs this model one row at a time: a B-row step is B one-row passes;
        # unless it evaluates their graphs together (weights read once, B fixed costs).
        self.serial_prefill = self.engine.serial_for(spec.model_type)
        self.row_graphs = (self.serial_prefill and self.engine.batches
                           and self.engine.serial_rows_together)
        self.serial = self.serial_prefill and not self.row_graphs
        self.quantize_bits = quantize_bits
        self.fmt = weight_format(dtype, quantize_bits)
        self.act_dtype = compute_dtype(dtype, quantize_bits)
        self.act_bytes = dtype_bytes(self.act_dtype)
        self.kv_bits = kv_bits  # None: float K/V; 4 or 8: mlx-lm's QuantizedKVCache
        # N Macs sharing the model (step_time prices one rank's share plus the link); None: one.
        self.cluster = cluster if cluster is not None and cluster.ranks > 1 else None
        self.kv_bytes_per_token = spec.kv_bytes_per_token(self.act_dtype, kv_bits)
        self.ceilings = quantized_ceilings(profile, quantize_bits)
        self.gemm = None
        # A calibrated device prices a format its GEMM fit lacks at its quantized ceilings, if any.
        if self.cal is not None and not (any(self.ceilings) and self.fmt not in self.cal.gemm):
            if self.fmt not in self.cal.gemm:
                raise ValueError(f"profile {profile.name} has no GEMM calibration for {self.fmt}; "
                                 f"calibrated: {', '.join(self.cal.gemm)}")
            self.gemm = self.cal.gemm[self.fmt]
        self.row_s = self._per_row_s()
        self._decode_cached = lru_cache(maxsize=None)(self._decode_parts)
        self._elementwise_s = lru_cache(maxsize=4096)(self._elementwise_s)  # per instance
        self._prefill_base_s = lru_cache(maxsize=8192)(self._prefill_base_s)
        self.layers = LayerCost(self)  # every model priced layer by layer (layer_cost.py)

    # -- linear layers -------------------------------------------------------------------------
    @cached_property
    def matmul_rates(self) -> tuple[float, float]:
        """(bytes/s, FLOP/s) of a linear layer on a roofline: the quantized ceilings where the
        profile has them, else the float ones."""
        gemv, gemm = self.ceilings
        return (gemv or self.profile.bytes_per_s,
                gemm or self.profile.flops_per_s(self.act_dtype))

    def _roofline_terms(self, m: int, k: int, n: int) -> tuple[float, float]:
        """(seconds moving the bytes, seconds doing the FLOPs) of one (m x k) @ (k x n)."""
        moved = matrix_weight_bytes(self.fmt, k, n) + m * (k + n) * self.act_bytes
        bytes_per_s, flops_per_s = self.matmul_rates
        return moved / bytes_per_s, 2 * m * k * n / flops_per_s

    def matrix_s(self, m: int, k: int, n: int) -> float:
        """One (m x k) @ (k x n): the GEMM fit's seconds or the roofline's (linear_split's terms
        summed)."""
        if self.gemm is not None:
            return self.gemm.seconds(m, k, n)
        return sum(self.linear_split(m, k, n))

    def linear_terms(self, m: float, k: int, n: int) -> tuple[float, float]:
        """(seconds of the weights' bytes, seconds of the FLOPs) of one linear layer: the GEMM
        fit's terms (they add up) or the roofline's (the larger binds)."""
        if self.gemm is not None:
            weights_ns, flops_ns = self.gemm.terms_ns(m, k, n)
            return weights_ns * 1e-9, flops_ns * 1e-9
        return self._roofline_terms(m, k, n)

    def linear_split(self, m: int, k: int, n: int) -> tuple[float, float]:
        """matrix_s as (weights_s, matmul_s): linear_parts with qmv's rows in the arithmetic."""
        weights_s, matmul_s, gemv_s = self.linear_parts(m, k, n)
        return weights_s, matmul_s + gemv_s

    def linear_parts(self, m: int, k: int, n: int) -> tuple[float, float, float]:
        """(weights_s, matmul_s, gemv_rows_s) of one linear layer: the GEMM fit's two terms, or
        the roofline's (roofline_split: one row binding, several adding up), a quantized layer
        MLX runs as qmv over several rows paying its FLOPs at qmv's rate (qmv.qmv_parts), as qmm
        those of its tiles' padded rows (server.perf.qmv)."""
        if self.gemm is not None:
            weights_ns, flops_ns = self.gemm.terms_ns(m, k, n)
            return weights_ns * 1e-9, flops_ns * 1e-9, 0.0
        moved_s, flops_s = self._roofline_terms(m, k, n)
        rows_s = self.qmv_rows_s(m, k, n)
        if rows_s:
            family = self.profile.gpu_family
            if runs_qmv(family, m, k, n, self.profile.mlx_version):
                return qmv_parts(family, self.profile.mlx_version, moved_s, rows_s, m)
            if m > 1:  # qmm: its tiles' padded rows, off the Neural Accelerators at shader rate
                nax = on_neural_accelerators(family, m, k, n, self.profile.mlx_version)
                flops_s *= qmm_rows(family, m, nax) / m
                flops_s /= 1.0 if nax else self.profile.shader_flops_share
        return (*roofline_split(moved_s, flops_s, overlapped=m <= 1), 0.0)

    def qmv_rows_s(self, rows: float, k: int, n: int) -> float:
        """qmv's arithmetic over `rows` rows at its rate (0: not priced apart: float weights)."""
        gflops = self.profile.quantized_gemv_row_gflops if self.quantize_bits else 0.0
        return 2 * rows * k * n / (gflops * 1e9) if gflops else 0.0

    def linear_layers_s(self, m: int) -> float:
        """Every linear layer of a forward over m rows, routed experts included, not the lm head."""
        return self.layers.linear_s(m)

    def lm_head_s(self, m: int) -> float:
        return self.matrix_s(m, self.spec.hidden_size, self.spec.vocab_size)

    # -- everything else in a forward pass -----------------------------------------------------
    def elementwise_bytes(self, m: int, logits: bool) -> float:
        """Elementwise bytes of a forward over m rows, the top-p sampler's passes included."""
        return self.layers.elementwise_bytes(m, logits) + (
            self.layers.sampler_bytes(m) if logits else 0.0)

    def _elementwise_s(self, m: int, logits: bool) -> float:
        """Elementwise bytes' seconds, the top-p sampler's passes apart (top_p_s)."""
        return self.bytes_s(self.layers.elementwise_bytes(m, logits))

    def top_p_s(self, m: int) -> float:
        """The top-p sampler's passes over m rows' logits (StepTime.top_p_s): their bytes at the
        peak bandwidth times the profile's top_p_slowdown; as elementwise bytes (bytes_s) on a
        calibrated device or where no slowdown is fitted (0)."""
        nbytes, slowdown = self.layers.sampler_bytes(m), self.profile.top_p_slowdown
        if not nbytes or not slowdown or self.cal is not None:
            return self.bytes_s(nbytes)
        return nbytes / self.profile.top_p_bytes_per_s

    def weight_stream_s(self, k: int, n: int) -> float:
        """Seconds to stream one (k -> n) weight matrix from memory at the achievable bandwidth
        (a quantized GEMV's own where the profile has it)."""
        return matrix_weight_bytes(self.fmt, k, n) / self.matmul_rates[0]

    def bytes_s(self, nbytes: float) -> float:
        """Seconds of elementwise-style traffic: the calibrated rate or the achievable bandwidth."""
        if self.cal is not None:
            return nbytes * self.cal.elementwise_ns_per_byte * 1e-9
        return nbytes / self.profile.bytes_per_s

    def _sampled_logits_s(self) -> float:
        """What a prefill chunk that samples adds to its elementwise time: one row's logits."""
        return self._elementwise_s(1, logits=True) - self._elementwise_s(1, False)

    def _fixed_s(self) -> float:
        """A forward pass's fixed cost: its dispatches, and (a catalog Ultra) its MoE layers'."""
        return sum(self._fixed_parts_s)

    def loop_dispatch_s(self) -> float:
        """The dispatch a per-row attention loop repeats: each layer's at the reference layer's
        (its attention; the FFN, MoE or dense, runs batched) and the forward's."""
        cal, p, n = self.cal, self.profile, self.spec.num_layers
        return ((n * cal.layer_overhead_us + cal.forward_overhead_us) * 1e-6 if cal is not None
                else n * p.layer_overhead_s + p.forward_overhead_s)

    @cached_property
    def _fixed_parts_s(self) -> tuple[float, float]:
        """(dispatch, MoE layers') of a forward: a calibrated device's (no MoE term) or catalog's"""
        if self.cal is not None:
            return (self._layers_overhead_us + self.cal.forward_overhead_us) * 1e-6, 0.0
        p, layers = self.profile, kernel_layers(self.spec, self.quantize_bits)
        return (layers * p.layer_overhead_s + p.forward_overhead_s,
                self.layers.moe_layers * p.moe_layer_overhead_s)

    @cached_property
    def _layers_overhead_us(self) -> float:
        """Every layer's fixed cost in one forward pass: a measured architecture's layers at its own
        cost (an MoE architecture's dense-FFN layers, like any other, at the dense one)."""
        cal = self.cal
        arch_us = cal.layer_overhead_us_by_arch.get(self.spec.model_type)
        if arch_us is None:
            return self.spec.num_layers * cal.layer_overhead_us
        layers = self.spec.arch.layers
        moe = any(layer.ffn.kind == "moe" for layer in layers)
        return sum(arch_us if layer.ffn.kind == "moe" or not moe else cal.layer_overhead_us
                   for layer in layers)

    # -- work per row and per token, whatever its bytes ----------------------------------------
    def _per_row_s(self) -> tuple[float, float, float, float, float]:
        """Seconds per decode row past the first of attention's fixed kernel cost, per token of
        elementwise kernels' (every layer), per sampled row of sampling (a catalog Mac: an engine
        calling its sampler per row only) and of the engine's host work, and the engine's host
        work per request started."""
        layers, cal, p = self.spec.num_layers, self.cal, self.profile
        host = self.engine.host_token_s
        if cal is not None:
            attention, token, sample = (cal.attention_row_ns * 1e-9, cal.token_layer_ns * 1e-9,
                                        cal.sampling_row_us * 1e-6)
            host += cal.host_token_us * 1e-6  # batchsim's engine on this device, as step_overhead
        else:
            attention, token = p.attention_row_s, p.token_layer_s
            sample = p.sampling_row_s if self.engine.sampler == "per_row" else 0.0
        return layers * attention, layers * token, sample, host, self.engine.host_request_s

    def _row_parts(self, decode_rows: int, tokens: int, sampled: int,
                   started: int = 0) -> dict[str, float]:
        """StepTime's per-row parts of a forward over `tokens` tokens, `decode_rows` of them
        decoding, `sampled` rows sampling a token, `started` of them a request's first."""
        attention, token, sample, host, request = self.row_s
        attention_s = max(decode_rows - 1, 0) * (self._row_attention_s(attention)
                                                 + self._row_loop_s)
        return {"attention_rows_s": attention_s, "token_ops_s": tokens * token,
                "sampling_s": sampled * sample, "host_token_s": sampled * host,
                "host_request_s": started * request, "top_p_s": self.top_p_s(sampled)}

    def _row_attention_s(self, attention_s: float) -> float:
        """Attention's fixed kernel cost of a decode row past the first (a one-row forward's is in
        the per-layer fixed cost, as is each row's where the engine builds a graph per row)."""
        return 0.0 if self.row_graphs else attention_s

    @cached_property
    def _row_loop_s(self) -> float:
        """An engine's per-sequence attention loop: its cost per decode row past the first."""
        return 0.0 if self.row_graphs or not self.engine.attention_loop else (
            self.engine.row_dispatch_forwards * self.loop_dispatch_s())

    # -- the simulator's fast path: the same blocks, summed ------------------------------------
    def _decode_parts(self, batch: int) -> tuple[float, float]:
        if self.serial and batch > 1:  # one row at a time
            base, per_width = self._decode_cached(1)
            return batch * base, batch * per_width
        base = (self.linear_layers_s(batch) + self.lm_head_s(batch)
                + self._elementwise_s(batch, logits=True) + self._graphs_fixed_s(batch))
        base += sum(self._row_parts(batch, batch, batch).values())
        return base, (self.layers.per_width_s(batch) if self.layers.linear_in_width else 0.0)

    def _graphs_fixed_s(self, batch: int) -> float:
        """The fixed cost of a decode forward: one per row's graph where the engine builds one."""
        return self._fixed_s() * (batch if self.row_graphs else 1)

    def decode_parts(self, batch: int) -> tuple[float, float]:
        """(seconds independent of the attention width, seconds per token of width): models whose
        every layer's attention grows with the width (no window, no fixed state)."""
        if not self.layers.linear_in_width:
            raise ValueError(f"decode_parts prices attention linear in the width; "
                             f"{self.spec.name} has {'+'.join(self.spec.families)} layers: "
                             f"use decode_forward_s")
        return self._decode_cached(batch)

    def decode_forward_s(self, batch: int, width: int) -> float:
        if self.serial and batch > 1 and not self.layers.linear_in_width:
            return batch * self.decode_forward_s(1, width)
        base, per_width = self._decode_cached(batch)
        if self.layers.linear_in_width:
            return base + per_width * width
        return base + self.layers.decode_attention_s(batch, width)

    def _prefill_base_s(self, n: int, sample: bool) -> float:
        """The part of a prefill chunk that does not depend on its start (no attention)."""
        t = self.linear_layers_s(n) + self._elementwise_s(n, logits=False) + self._fixed_s()
        if sample:  # one row's lm head and logits (summed as before, for byte-identical runs)
            t += (self.lm_head_s(1) + self._elementwise_s(1, logits=True)
                  - self._elementwise_s(1, False))
        return t + sum(self._row_parts(0, n, int(sample), int(sample)).values())

    def prefill_forward_s(self, n: int, start: int, sample: bool, rows: int = 1,
                          started: int | None = None) -> float:
        if rows > 1:
            return self.prefill_time(n, start, sample, rows, started).total_s
        return (self._prefill_base_s(n, sample) + self.layers.prefill_attention_s(n, start)
                - (sample and started == 0) * self.engine.host_request_s)  # a recompute: none

    def copy_s(self, nbytes: float) -> float:
        p = self.profile
        gbs = (self.cal.copy_gbs if self.cal is not None
               else p.bandwidth_gbs * p.bandwidth_efficiency / 2)
        return nbytes / (gbs * 1e9)

    @property
    def device_overhead_s(self) -> float:
        """batchsim's engine work per step as calibrated on the device (0 on a catalog Mac)."""
        return self.cal.step_overhead_us * 1e-6 if self.cal is not None else 0.0

    @property
    def step_overhead_s(self) -> float:
        """What every step costs beyond its forward passes: the device's calibrated overhead
        plus the engine profile's host work per step (StepTime's step_overhead_s + host_step_s)."""
        return self.device_overhead_s + self.engine.host_step_s

    # -- the named parts -----------------------------------------------------------------------
    def decode_time(self, batch: int, width: int) -> StepTime:
        """One decode forward over `batch` rows padded to `width` cached tokens (no step
        overhead); an engine running this model one row at a time: `batch` one-row forwards."""
        if self.serial and batch > 1:
            return self.decode_time(1, width).times(batch)
        weights_s, matmul_s, experts_s, attention_s, gemv_s = self.layers.decode(batch, width)
        return StepTime(weights_s, matmul_s, attention_s, self._elementwise_s(batch, logits=True),
                        self._graphs_fixed_s(batch), 0.0, experts_s=experts_s,
                        gemv_rows_s=gemv_s, **self._row_parts(batch, batch, batch))

    def prefill_time(self, n: int, start: int, sample: bool, rows: int = 1,
                     started: int | None = None) -> StepTime:
        """One prefill forward of `n` tokens after `start` cached ones, for `rows` prompts at once
        (prefill_groups.py: their linear layers one GEMM over rows x n tokens, one fixed cost;
        no step overhead; an engine running this model one row at a time: one prompt a pass).
        `started`: the sampling rows that pay host_request_us (None: all; not a recompute's)."""
        if sample and started not in (None, rows):
            return dataclasses.replace(self.prefill_time(n, start, sample, rows),
                                       host_request_s=started * self.engine.host_request_s)
        if self.serial_prefill and rows > 1:
            return self.prefill_time(n, start, sample).times(rows)
        weights_s, matmul_s, experts_s, attention_s, gemv_s = self.layers.prefill(n, start,
                                                                                 sample, rows)
        elementwise_s = rows * (self._elementwise_s(n, logits=False)
                                + (self._sampled_logits_s() if sample else 0.0))
        return StepTime(weights_s, matmul_s, attention_s, elementwise_s, self._fixed_s(), 0.0,
                        experts_s=experts_s, gemv_rows_s=gemv_s,
                        **self._row_parts(0, rows * n, *(rows if sample else 0,) * 2))

    def step_time(self, decode_rows: int = 0, width: int = 0, prefills: Iterable[Chunk] = (),
                  copy_bytes: float = 0.0) -> StepTime:
        """One engine step: its prefill chunks, a decode forward over `decode_rows` rows padded to
        `width` tokens, the pool copies before them and the engine's overhead."""
        total = StepTime(0.0, 0.0, 0.0, 0.0, 0.0, self.device_overhead_s, self.copy_s(copy_bytes),
                         host_step_s=self.engine.host_step_s)
        rows = head_rows = 0
        for group in prefill_groups.groups(list(prefills)):
            c, g = group[0], len(group)
            total += self.prefill_time(c.num_tokens, c.start, c.sample, g,
                                       sum(x.fresh for x in group))
            rows, head_rows = rows + g * c.num_tokens, head_rows + (g if c.sample else 0)
        if decode_rows:
            total += self.decode_time(decode_rows, width)
            rows, head_rows = rows + decode_rows, head_rows + decode_rows
        return self._on_cluster(total, rows, head_rows) if self.cluster else total

    def _on_cluster(self, one: StepTime, rows: int, head_rows: int) -> StepTime:
        """One rank's step: tensor parallel splits the linear layers, experts and (but for MLA's
        latent cache) attention N ways, not the lm head, norms or fixed costs; pipeline splits
        nothing in time. Both add the link's time (cluster.py)."""
        c, s = self.cluster, self.spec
        comm_s = c.comm_s(s, rows, self.act_bytes)
        if c.parallel == "pipeline":
            return dataclasses.replace(one, comm_s=comm_s)
        head_w, head_m, head_g = (self.linear_parts(head_rows, s.hidden_size, s.vocab_size)
                                  if head_rows else (0, 0, 0))
        n = c.ranks
        return dataclasses.replace(
            one, weights_s=(one.weights_s - head_w) / n + head_w,
            matmul_s=(one.matmul_s - head_m) / n + head_m, experts_s=one.experts_s / n,
            gemv_rows_s=(one.gemv_rows_s - head_g) / n + head_g,
            attention_s=one.attention_s * c.kv_share(s), comm_s=comm_s)
