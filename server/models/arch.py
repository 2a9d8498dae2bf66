"""A model as a list of layers read from its config.json, the way mlx-lm 0.32 builds it: each
layer's attention kind (full, sliding window, linear attention, MLA latent) and FFN kind (dense or
MoE), its weight matrices, and the cache it keeps. Pure Python: params, active params, weight bytes
and cache bytes all come from here (the cache arithmetic is in arch_cache.py)."""

from __future__ import annotations

import dataclasses
from typing import Any

from batchsim.configs import ConfigError
from batchsim.server.models.arch_cache import cache_bytes, check_kv_bits
from batchsim.server.models.arch_families import BUILDERS, NEVER_TIED, TIED_DEFAULT, Layer, Mat

# mlx-lm's default affine quantization: one fp16 scale and one fp16 bias per group of 64 weights.
QUANT_GROUP_SIZE = 64
SMALL_BYTES = 2  # scales, biases and unquantized small params stay float16 in a quantized model


@dataclasses.dataclass(frozen=True)
class Arch:
    """The whole model: layers plus embedding, final norm and (untied) output projection."""

    model_type: str
    layers: tuple[Layer, ...]
    vocab_size: int
    hidden_size: int
    tied_embeddings: bool

    @property
    def families(self) -> list[str]:
        kinds = {lay.attention.kind for lay in self.layers}
        fam = ["moe"] if any(lay.ffn.kind == "moe" for lay in self.layers) else []
        fam += [f for k, f in (("sliding", "sliding"), ("linear", "hybrid"), ("mla", "mla"))
                if k in kinds]
        return fam or ["dense"]

    @property
    def embedding_params(self) -> int:
        return self.vocab_size * self.hidden_size

    @property
    def outer_mats(self) -> tuple[Mat, ...]:
        emb = Mat(self.vocab_size, self.hidden_size)
        return (emb,) if self.tied_embeddings else (emb, emb)

    @property
    def params(self) -> int:
        outer = sum(m.params for m in self.outer_mats) + self.hidden_size  # + final norm
        return sum(lay.params for lay in self.layers) + outer

    @property
    def active_params(self) -> int:
        """Params a token touches, embedding table included (Qwen's convention for "A3B")."""
        return self.params - sum(lay.params - lay.active_params for lay in self.layers)

    def weight_bytes(self, dtype_bytes: int, quantize_bits: int | None = None) -> int:
        """Bytes as mlx-lm holds the weights; quantized: mlx-lm's default predicate (every matrix
        whose input dim divides the group size), small params in float16."""
        if quantize_bits is None:
            return self.params * dtype_bytes
        mats = [m for lay in self.layers for m in lay.mats] + list(self.outer_mats)
        total = sum(_quantized_bytes(m, quantize_bits) for m in mats)
        small = sum(lay.small_params for lay in self.layers) + self.hidden_size
        return total + small * SMALL_BYTES

    def cache_bytes(self, calls: list[int], act_bytes: int, kv_bits: int | None = None) -> int:
        """Bytes of one sequence's mlx-lm prompt cache after model calls of these token counts."""
        return sum(cache_bytes(lay.attention, calls, act_bytes, kv_bits) for lay in self.layers)

    def cache_layout_check(self, kv_bits: int) -> None:
        """Raises ConfigError if some layer's cache cannot be quantized to kv_bits by mlx-lm."""
        check_kv_bits((lay.attention for lay in self.layers), kv_bits)

    def kv_bytes_per_token(self, act_bytes: int, kv_bits: int | None = None) -> int:
        """Bytes each further token adds once windows are full: full-attention and MLA layers."""
        return sum(lay.attention.token_bytes(act_bytes, kv_bits) for lay in self.layers
                   if lay.attention.kind in ("full", "mla"))


def _quantized_bytes(m: Mat, bits: int) -> int:
    return m.count * quantized_matrix_bytes(m.out_dim, m.in_dim, bits)


def quantized_matrix_bytes(out_dim: int, in_dim: int, bits: int) -> int:
    """One (out x in) matrix as mlx-lm quantizes it: packed weights plus a float16 scale and bias
    per group of 64 along the input; an input dim the group does not divide stays float16."""
    if in_dim % QUANT_GROUP_SIZE:
        return out_dim * in_dim * SMALL_BYTES
    groups = out_dim * (in_dim // QUANT_GROUP_SIZE)
    return out_dim * in_dim * bits // 8 + 2 * SMALL_BYTES * groups


def describe(name: str, config: dict[str, Any]) -> Arch:
    """The per-layer description of a config.json; an unknown model_type is a one-line error."""
    mt = config.get("model_type")
    builder = BUILDERS.get(mt)
    if builder is None:
        raise ConfigError(
            f"model {name}: model_type {mt!r} is not supported; supported: "
            f"{', '.join(BUILDERS)} (families: dense, moe, sliding, hybrid, mla)"
        )
    try:
        layers = builder(config)
    except (KeyError, TypeError, ValueError) as exc:
        raise ConfigError(f"model {name}: config for {mt} is incomplete or malformed "
                          f"({exc!r})") from None
    tied = bool(config.get("tie_word_embeddings", TIED_DEFAULT.get(mt, True)))
    tied = tied and mt not in NEVER_TIED
    return Arch(str(mt), tuple(layers), int(config["vocab_size"]), int(config["hidden_size"]), tied)
