"""config.json -> layers, one builder per mlx-lm model file (mlx_lm/models/<model_type>.py, 0.32):
the same keys, defaults and layer rules mlx-lm uses to build the model."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

from batchsim.server.models.arch_cache import Attention


@dataclasses.dataclass(frozen=True)
class Mat:
    """`count` weight matrices of (out, in); `routed`: MoE experts, of which a token uses top_k."""

    out_dim: int
    in_dim: int
    count: int = 1
    routed: bool = False

    @property
    def params(self) -> int:
        return self.out_dim * self.in_dim * self.count


@dataclasses.dataclass(frozen=True)
class Ffn:
    kind: str  # "dense" or "moe"
    intermediate: int = 0  # dense MLP width
    experts: int = 0  # routed experts E
    top_k: int = 0
    expert_intermediate: int = 0
    shared_intermediate: int = 0  # width of the always-on shared expert(s), 0 if none


@dataclasses.dataclass(frozen=True)
class Layer:
    attention: Attention
    ffn: Ffn
    mats: tuple[Mat, ...]  # every quantizable matrix (Linear, SwitchLinear, MultiLinear)
    small_params: int  # norms, biases, sinks, convolutions, gates mlx-lm does not quantize

    @property
    def params(self) -> int:
        return sum(m.params for m in self.mats) + self.small_params

    @property
    def active_params(self) -> int:
        """Params one token uses: a top_k / E share of the routed experts."""
        routed = sum(m.params for m in self.mats if m.routed)
        share = routed * self.ffn.top_k // self.ffn.experts if self.ffn.experts else 0
        return self.params - routed + share


Config = dict[str, Any]

# Whether the output projection shares the embedding when config.json does not say.
TIED_DEFAULT = {"qwen3_moe": False, "qwen3_next": False, "gemma3_text": True}
NEVER_TIED = ("gpt_oss", "deepseek_v3")  # these mlx-lm models always keep their own lm_head


def _heads(c: Config) -> tuple[int, int, int]:
    n = int(c["num_attention_heads"])
    kv = int(c.get("num_key_value_heads") or n)
    hd = c.get("head_dim")
    if c["model_type"] == "qwen2" or not hd:
        hd = int(c["hidden_size"]) // n
    return n, kv, int(hd)


def _gqa(c: Config, q_mult: int = 1, window: int = 0) -> tuple[Attention, list[Mat]]:
    """Standard attention: q, k, v, o projections and a K/V cache row of kv_heads x head_dim."""
    h = int(c["hidden_size"])
    n, kv, hd = _heads(c)
    mats = [Mat(n * hd * q_mult, h), Mat(kv * hd, h), Mat(kv * hd, h), Mat(h, n * hd)]
    kind = "sliding" if window else "full"
    return Attention(kind, heads=kv, k_dim=hd, v_dim=hd, window=window), mats


def _mlp(h: int, i: int) -> tuple[Ffn, list[Mat]]:
    return Ffn("dense", intermediate=i), [Mat(i, h), Mat(i, h), Mat(h, i)]


def _experts(h: int, i: int, e: int) -> list[Mat]:
    return [Mat(i, h, e, True), Mat(i, h, e, True), Mat(h, i, e, True)]


def dense(c: Config) -> list[Layer]:
    """llama, qwen2, qwen3: the existing zoo, byte for byte."""
    h, i = int(c["hidden_size"]), int(c["intermediate_size"])
    n, kv, hd = _heads(c)
    att, amats = _gqa(c)
    ffn, fmats = _mlp(h, i)
    small = 2 * h
    if c["model_type"] == "qwen2" or c.get("attention_bias", False):
        small += (n + 2 * kv) * hd
    if c["model_type"] == "qwen3":
        small += 2 * hd  # q_norm, k_norm
    return [Layer(att, ffn, (*amats, *fmats), small)] * int(c["num_hidden_layers"])


def qwen3_moe(c: Config) -> list[Layer]:
    h, e, k = int(c["hidden_size"]), int(c["num_experts"]), int(c["num_experts_per_tok"])
    mi, step = int(c["moe_intermediate_size"]), int(c.get("decoder_sparse_step", 1))
    dense_only = set(c.get("mlp_only_layers") or [])
    att, amats = _gqa(c)
    hd = _heads(c)[2]
    layers = []
    for li in range(int(c["num_hidden_layers"])):
        if li not in dense_only and e > 0 and (li + 1) % step == 0:
            ffn = Ffn("moe", experts=e, top_k=k, expert_intermediate=mi)
            fmats = [Mat(e, h), *_experts(h, mi, e)]
        else:
            ffn, fmats = _mlp(h, int(c["intermediate_size"]))
        layers.append(Layer(att, ffn, (*amats, *fmats), 2 * h + 2 * hd))
    return layers


def gpt_oss(c: Config) -> list[Layer]:
    h, e, k = int(c["hidden_size"]), int(c["num_local_experts"]), int(c["num_experts_per_tok"])
    i, n_layers = int(c["intermediate_size"]), int(c["num_hidden_layers"])
    n, kv, hd = _heads(c)
    types = c.get("layer_types") or ["sliding_attention", "full_attention"] * (n_layers // 2)
    ffn = Ffn("moe", experts=e, top_k=k, expert_intermediate=i)
    fmats = [Mat(e, h), *_experts(h, i, e)]
    # biases of q, k, v, o, router and experts; attention sinks; two norms
    small = (n + 2 * kv) * hd + h + e + e * (2 * i + h) + n + 2 * h
    layers = []
    for t in types:
        att, amats = _gqa(c, window=int(c["sliding_window"]) if t == "sliding_attention" else 0)
        layers.append(Layer(att, ffn, (*amats, *fmats), small))
    return layers


def gemma3_text(c: Config) -> list[Layer]:
    h, pattern = int(c["hidden_size"]), int(c.get("sliding_window_pattern", 6))
    hd = _heads(c)[2]
    ffn, fmats = _mlp(h, int(c["intermediate_size"]))
    layers = []
    for li in range(int(c["num_hidden_layers"])):
        full = li % pattern == pattern - 1
        att, amats = _gqa(c, window=0 if full else int(c.get("sliding_window", 512)))
        layers.append(Layer(att, ffn, (*amats, *fmats), 4 * h + 2 * hd))
    return layers


def qwen3_next(c: Config) -> list[Layer]:
    h, e, k = int(c["hidden_size"]), int(c["num_experts"]), int(c["num_experts_per_tok"])
    hd, interval = _heads(c)[2], int(c.get("full_attention_interval", 4))
    nk, nv = int(c["linear_num_key_heads"]), int(c["linear_num_value_heads"])
    dk, dv, kernel = (int(c["linear_key_head_dim"]), int(c["linear_value_head_dim"]),
                      int(c["linear_conv_kernel_dim"]))
    key_dim, value_dim = nk * dk, nv * dv
    conv_dim = 2 * key_dim + value_dim
    linear = Attention("linear", conv_shape=(kernel - 1, conv_dim), state_shape=(nv, dv, dk))
    lmats = [Mat(2 * key_dim + 2 * value_dim, h), Mat(2 * nv, h), Mat(h, value_dim)]
    lsmall = conv_dim * kernel + 2 * nv + dv  # conv1d, dt_bias, A_log, gated norm
    full, fmats_att = _gqa(c, q_mult=2)  # q_proj also yields the output gate
    mi, si, step = (int(c["moe_intermediate_size"]), int(c["shared_expert_intermediate_size"]),
                    int(c.get("decoder_sparse_step", 1)))
    dense_only = set(c.get("mlp_only_layers") or [])
    layers = []
    for li in range(int(c["num_hidden_layers"])):
        is_linear = (li + 1) % interval != 0
        att, amats, small = (linear, lmats, lsmall) if is_linear else (full, fmats_att, 2 * hd)
        if li not in dense_only and e > 0 and (li + 1) % step == 0:
            ffn = Ffn("moe", experts=e, top_k=k, expert_intermediate=mi, shared_intermediate=si)
            fmats = [Mat(e, h), *_experts(h, mi, e), *_mlp(h, si)[1], Mat(1, h)]
        else:
            ffn, fmats = _mlp(h, int(c["intermediate_size"]))
        layers.append(Layer(att, ffn, (*amats, *fmats), small + 2 * h))
    return layers


def deepseek_v3(c: Config) -> list[Layer]:
    h, n = int(c["hidden_size"]), int(c["num_attention_heads"])
    rank, rope = int(c.get("kv_lora_rank", 512)), int(c.get("qk_rope_head_dim", 64))
    nope, vd = int(c.get("qk_nope_head_dim", 128)), int(c.get("v_head_dim", 128))
    q_rank = c.get("q_lora_rank", 1536)
    qd = n * (nope + rope)
    amats = [Mat(qd, h)] if q_rank is None else [Mat(int(q_rank), h), Mat(qd, int(q_rank))]
    amats += [Mat(rank + rope, h), Mat(rank, nope, n), Mat(vd, rank, n), Mat(h, n * vd)]
    asmall = rank + (0 if q_rank is None else int(q_rank))  # kv_a and q_a layernorms
    if c.get("attention_bias", False):
        asmall += rank + rope + h + (0 if q_rank is None else int(q_rank))
    att = Attention("mla", heads=1, k_dim=rank, v_dim=rope)  # KVCache of (latent, RoPE key)
    e, mi = c.get("n_routed_experts"), int(c.get("moe_intermediate_size", 1407))
    first_dense, freq = int(c.get("first_k_dense_replace", 0)), int(c.get("moe_layer_freq", 1))
    layers = []
    for li in range(int(c["num_hidden_layers"])):
        if e is not None and li >= first_dense and li % freq == 0:
            shared = mi * int(c["n_shared_experts"]) if c.get("n_shared_experts") else 0
            ffn = Ffn("moe", experts=int(e), top_k=int(c.get("num_experts_per_tok", 1)),
                      expert_intermediate=mi, shared_intermediate=shared)
            fmats = [*_experts(h, mi, int(e)), *(_mlp(h, shared)[1] if shared else [])]
            small = int(e) * h + int(e)  # the router (MoEGate: weight and score bias, unquantized)
        else:
            (ffn, fmats), small = _mlp(h, int(c["intermediate_size"])), 0
        layers.append(Layer(att, ffn, (*amats, *fmats), asmall + small + 2 * h))
    return layers


BUILDERS: dict[str, Callable[[Config], list[Layer]]] = {
    "llama": dense, "qwen2": dense, "qwen3": dense, "qwen3_moe": qwen3_moe, "gpt_oss": gpt_oss,
    "gemma3_text": gemma3_text, "qwen3_next": qwen3_next, "deepseek_v3": deepseek_v3,
}
