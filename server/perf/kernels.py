"""Kernels a decode layer launches, by architecture: what a layer's fixed cost (a GPU's kernel
dispatch, server.perf.stepcost) is priced by. A catalog profile's `layer_overhead_s` is one
reference layer's, llama's REFERENCE_LAYER_KERNELS kernels; a layer launching more or fewer costs
that share of it (`kernel_layers`: the model's layers in reference layers).

Counted by hand from mlx-lm's model files (mlx_lm/models/<model_type>.py, mlx-lm 0.32.2) for one
decode token on Metal, as one kernel each: a fast op (rms_norm, rope, scaled_dot_product_attention),
a (quantized, gathered) matmul, an mx.compile'd function (swiglu, gelu_approx, clip_residual), an
elementwise op or reduction, an argpartition or gather, a KV cache slice update. Reshapes,
transposes and slices are views (no kernel). A quantized Linear's bias is its own add; a float
Linear's fuses into addmm (mlx.nn.Linear), so only quantized layers count them. The counts follow
the source alone: none was chosen by its held-out score.
Llama (llama.py): input norm, q/k/v, rope on q and k, K and V cache writes, attention, o_proj,
residual; post-attention norm, gate and up, swiglu, down, residual: 17.
qwen2.py: + q/k/v biases (20). qwen3.py: + q_norm, k_norm (19).
gemma3_text.py: four layer norms plus q/k norms, each `rms_norm(x, 1.0 + weight)` (2 kernels),
MLP `gelu_approx(gate) * up` (2), clip_residual compiled (1 each): 28.
qwen3_moe.py: qwen3's attention; the sparse block: router, softmax, argpartition,
take_along_axis, top-k renormalisation (sum, divide), SwitchGLU's 3 gather_qmm and swiglu, weigh
and sum (12 for the dense MLP's 4): 27.
gpt_oss.py: q/k/v/o biases; router and its bias, argpartition, take_along_axis, softmax, 3
gather_qmm each with its bias (a gather and an add), SwigluOAI, weigh and sum (17): 34.
qwen3_next.py (and gated_delta.py): a full-attention layer is qwen3's plus its output gate
(sigmoid, multiply); a gated-delta layer's mixer: in_proj_qkvz and in_proj_ba, two concatenates
and the conv state's copy, conv1d, silu, normalize_qk (2 rms_norm, 2 multiplies), sigmoid(b),
compute_g (mx.compile(shapeless=True) in gated_delta.py: 1), the gated-delta kernel, the gated
RMSNorm (rms_norm, precise_swiglu), out_proj (17); the sparse block is qwen3_moe's plus the shared
expert (gate, up, swiglu, down), its gate, sigmoid, multiply and add (20): 41 and 37.
Not counted: SwitchGLU sorts its tokens by expert when batch x top-k >= 64 (switch_layers.py: two
argsorts, gathers and an unsort, ~6 kernels a MoE layer from that batch on); the count is the
batch-1 layer's, so a large MoE batch is priced a few kernels short.
deepseek_v3.py (no reference row runs one): the MLA mixer at decode, q_a_proj, q_a_layernorm,
q_b_proj, kv_a_proj_with_mqa, kv_a_layernorm, rope on q_pe and k_pe, the latent and k_pe cache
writes, the RoPE scores (scale, matmul), embed_q, attention, unembed_out, o_proj (16); the MoE
block: the router's matmul and group_expert_select (mx.compile: its elementwise ops fuse; topk,
sum, argpartition, put_along_axis, negate, argpartition, take_along_axis, sum, the scaling: 10 with
the matmul), SwitchGLU's 4, weigh, sum, the shared experts' MLP (4) and their add (21): 41; its
first dense layers 24."""

from __future__ import annotations

import dataclasses

from batchsim.server.models.arch_families import Layer
from batchsim.server.models.spec import ModelSpec


@dataclasses.dataclass(frozen=True)
class Family:
    """What a family's decoder layer runs beyond the reference (llama) layer's kernels."""

    layer_norms: int = 2  # RMSNorms on the residual stream per layer
    norm_kernels: int = 1  # kernels per norm (gemma's 1 + weight: 2)
    qk_norm: bool = False  # RMSNorm on queries and keys
    proj_biases: int = 0  # attention projections with a bias (an add when quantized)
    activation_kernels: int = 1  # the dense MLP's activation (swiglu compiled: 1)
    moe_kernels: int = 0  # a routed-expert block's kernels (router to weighted sum)
    attention_gate: int = 0  # kernels gating the attention output (sigmoid, multiply)
    linear_kernels: int = 0  # a linear-attention (gated delta) mixer's kernels
    mla_kernels: int = 0  # an MLA mixer's kernels (its own latent norms included)


ATTENTION_KERNELS = 9  # q, k, v, rope on q and k, K and V cache writes, attention, o_proj
RESIDUAL_ADDS = 2
DENSE_MATMULS = 3  # gate, up, down
FAMILIES = {
    "llama": Family(),
    "qwen2": Family(proj_biases=3),
    "qwen3": Family(qk_norm=True),
    "qwen3_moe": Family(qk_norm=True, moe_kernels=12),
    "gemma3_text": Family(layer_norms=4, norm_kernels=2, qk_norm=True, activation_kernels=2),
    "gpt_oss": Family(proj_biases=4, moe_kernels=17),
    "qwen3_next": Family(qk_norm=True, moe_kernels=20, attention_gate=2, linear_kernels=17),
    "deepseek_v3": Family(moe_kernels=21, mla_kernels=16),
}


def layer_kernels(model_type: str, layer: Layer, quantized: bool = True) -> int:
    """Kernels one decode token's pass through `layer` launches (the reference count where its
    family or attention kind is not counted); `quantized`: its Linears' biases are separate adds."""
    f, kind = FAMILIES.get(model_type), layer.attention.kind
    mixers = {"linear": f.linear_kernels, "mla": f.mla_kernels} if f else {}
    if f is None or mixers.get(kind) == 0 or (layer.ffn.kind == "moe" and not f.moe_kernels):
        return REFERENCE_LAYER_KERNELS
    if kind in mixers:  # their q/k normalisation is in the mixer's count
        mixer = f.norm_kernels * f.layer_norms + mixers[kind]
    else:
        mixer = (f.norm_kernels * (f.layer_norms + (2 if f.qk_norm else 0)) + ATTENTION_KERNELS
                 + (f.proj_biases if quantized else 0) + f.attention_gate)
    ffn = f.moe_kernels if layer.ffn.kind == "moe" else DENSE_MATMULS + f.activation_kernels
    return mixer + ffn + RESIDUAL_ADDS


REFERENCE_LAYER_KERNELS = 17  # llama's; layer_kernels("llama", layer) computes the same


def kernel_layers(spec: ModelSpec, quantize_bits: int | None) -> float:
    """The model's layers in reference layers: its layers' kernels / REFERENCE_LAYER_KERNELS."""
    quantized = bool(quantize_bits)
    total = sum(layer_kernels(spec.model_type, layer, quantized) for layer in spec.arch.layers)
    return total / REFERENCE_LAYER_KERNELS
