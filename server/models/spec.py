"""Model shapes and the arithmetic that follows from them: parameter count, weight bytes per dtype or
quantization, KV bytes per token, FLOPs per token. Pure Python: `size`, the roofline executor and the
scheduler use it without MLX."""

from __future__ import annotations

import dataclasses
from functools import cached_property
from pathlib import Path
from typing import Any

from batchsim.configs import CONFIG_DIR, ConfigError, from_dict, load_yaml

MODELS_DIR = CONFIG_DIR / "models"

DTYPE_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2}
FLOAT_DTYPES = tuple(DTYPE_BYTES)
QUANT_BITS = (4, 8)
# mlx-lm's default affine quantization: one fp16 scale and one fp16 bias per group of 64 weights.
QUANT_GROUP_SIZE = 64
# mlx-lm's QuantizedKVCache: K and V packed into uint32 at 4 or 8 bits, with a scale and a bias in
# the cache's dtype per group of 64 elements along head_dim (its default group_size).
KV_BITS = (4, 8)
KV_GROUP_SIZE = 64
SUPPORTED_MODEL_TYPES = ("llama", "qwen2", "qwen3")


@dataclasses.dataclass(frozen=True)
class ModelSpec:
    """One architecture: `config` is the Hugging Face config.json subset mlx-lm needs."""

    name: str
    config: dict[str, Any]
    hf_id: str | None = None
    source: str = ""

    def __post_init__(self) -> None:
        mt = self.config.get("model_type")
        if mt not in SUPPORTED_MODEL_TYPES:
            raise ConfigError(
                f"model {self.name}: model_type {mt!r} is not supported; "
                f"allowed: {', '.join(SUPPORTED_MODEL_TYPES)}"
            )
        for key in ("hidden_size", "num_hidden_layers", "num_attention_heads", "vocab_size",
                    "intermediate_size"):
            if not isinstance(self.config.get(key), int) or self.config[key] <= 0:
                raise ConfigError(f"model {self.name}: config.{key} must be a positive integer")

    # Shapes, with the defaults mlx-lm applies.
    @property
    def model_type(self) -> str:
        return str(self.config["model_type"])

    @property
    def num_layers(self) -> int:
        return int(self.config["num_hidden_layers"])

    @property
    def hidden_size(self) -> int:
        return int(self.config["hidden_size"])

    @property
    def intermediate_size(self) -> int:
        return int(self.config["intermediate_size"])

    @property
    def num_heads(self) -> int:
        return int(self.config["num_attention_heads"])

    @property
    def num_kv_heads(self) -> int:
        return int(self.config.get("num_key_value_heads") or self.num_heads)

    @property
    def head_dim(self) -> int:
        # qwen2's mlx-lm model always derives head_dim from hidden_size.
        if self.model_type == "qwen2" or not self.config.get("head_dim"):
            return self.hidden_size // self.num_heads
        return int(self.config["head_dim"])

    @property
    def vocab_size(self) -> int:
        return int(self.config["vocab_size"])

    @property
    def tied_embeddings(self) -> bool:
        return bool(self.config.get("tie_word_embeddings", True))

    @property
    def max_context(self) -> int:
        return int(self.config.get("max_position_embeddings") or 4096)

    @property
    def qkv_bias(self) -> bool:
        return self.model_type == "qwen2" or bool(self.config.get("attention_bias", False))

    # Parameter groups. `linear_shapes` lists every matrix a decode step multiplies (out, in).
    @cached_property
    def layer_linear_shapes(self) -> tuple[tuple[int, int], ...]:
        h, i = self.hidden_size, self.intermediate_size
        q, kv = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        return ((q, h), (kv, h), (kv, h), (h, q), (i, h), (i, h), (h, i))

    @cached_property
    def num_params(self) -> int:
        return self.num_matmul_params_per_layer * self.num_layers + self.num_other_params

    @cached_property
    def num_matmul_params_per_layer(self) -> int:
        return sum(o * i for o, i in self.layer_linear_shapes)

    @property
    def num_embedding_params(self) -> int:
        return self.vocab_size * self.hidden_size

    @property
    def num_lm_head_params(self) -> int:
        """Weights of the output projection (shared with the embedding when tied)."""
        return self.vocab_size * self.hidden_size

    @cached_property
    def num_small_params_per_layer(self) -> int:
        """Norm weights and biases: kept in float16 by quantization."""
        n = 2 * self.hidden_size
        if self.qkv_bias:
            n += (self.num_heads + 2 * self.num_kv_heads) * self.head_dim
        if self.model_type == "qwen3":
            n += 2 * self.head_dim  # q_norm, k_norm
        return n

    @cached_property
    def num_other_params(self) -> int:
        n = self.num_embedding_params + self.hidden_size  # embedding, final norm
        if not self.tied_embeddings:
            n += self.num_lm_head_params
        return n + self.num_small_params_per_layer * self.num_layers

    def weight_bytes(self, dtype: str = "float16", quantize_bits: int | None = None) -> int:
        """Bytes of the weights as mlx-lm holds them (quantization: mlx-lm's default predicate,
        every Linear and Embedding whose input dim divides the group size)."""
        if quantize_bits is None:
            return self.num_params * dtype_bytes(dtype)
        if quantize_bits not in QUANT_BITS:
            raise ConfigError(f"quantize: {quantize_bits} is not allowed; allowed: 4, 8")
        small = 2  # scales, biases and unquantized small params stay float16
        quantized = [(o, i) for o, i in self.layer_linear_shapes] * self.num_layers
        quantized.append((self.vocab_size, self.hidden_size))
        if not self.tied_embeddings:
            quantized.append((self.vocab_size, self.hidden_size))
        total = 0
        for o, i in quantized:
            if i % QUANT_GROUP_SIZE == 0:
                total += o * i * quantize_bits // 8 + 2 * small * o * (i // QUANT_GROUP_SIZE)
            else:
                total += o * i * small
        total += (self.num_small_params_per_layer * self.num_layers + self.hidden_size) * small
        return total

    def kv_bytes_per_token(self, dtype: str = "float16", kv_bits: int | None = None) -> int:
        """K and V of one token across all layers: 2 x layers x kv_heads x (head_dim x bytes, or
        with kv_bits what QuantizedKVCache holds per head: packed data + scales + biases)."""
        if kv_bits is None:
            return 2 * self.num_layers * self.num_kv_heads * self.head_dim * dtype_bytes(dtype)
        head_bytes = self.quantized_kv_head_bytes(dtype, kv_bits)
        return 2 * self.num_layers * self.num_kv_heads * head_bytes

    def quantized_kv_head_bytes(self, dtype: str, kv_bits: int) -> int:
        """One head's K (or V) of one token in mlx-lm's QuantizedKVCache."""
        if kv_bits not in KV_BITS:
            raise ConfigError(f"kv_bits: {kv_bits} is not allowed; allowed: 4, 8")
        if self.head_dim % KV_GROUP_SIZE:
            raise ConfigError(f"model {self.name}: kv_bits needs head_dim to be a multiple of "
                              f"{KV_GROUP_SIZE} (mlx-lm's KV group); it is {self.head_dim}")
        groups = self.head_dim // KV_GROUP_SIZE
        return self.head_dim * kv_bits // 8 + 2 * groups * dtype_bytes(dtype)

    def summary(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "hf_id": self.hf_id,
            "model_type": self.model_type,
            "params": self.num_params,
            "layers": self.num_layers,
            "hidden_size": self.hidden_size,
            "heads": self.num_heads,
            "kv_heads": self.num_kv_heads,
            "head_dim": self.head_dim,
            "vocab_size": self.vocab_size,
            "max_context": self.max_context,
            "weight_bytes": {
                **{dt: self.weight_bytes(dt) for dt in FLOAT_DTYPES},
                **{f"q{b}": self.weight_bytes("float16", b) for b in QUANT_BITS},
            },
            "kv_bytes_per_token": {dt: self.kv_bytes_per_token(dt) for dt in FLOAT_DTYPES},
        }


def dtype_bytes(dtype: str) -> int:
    try:
        return DTYPE_BYTES[dtype]
    except KeyError:
        raise ConfigError(
            f"dtype {dtype!r} is not allowed; allowed: {', '.join(FLOAT_DTYPES)}"
        ) from None


def zoo_names() -> list[str]:
    return sorted(p.stem for p in MODELS_DIR.glob("*.yaml"))


def load_spec(path: str | Path) -> ModelSpec:
    data = load_yaml(path)
    spec = from_dict(ModelSpec, data, str(path))
    if spec.name != Path(path).stem:
        raise ConfigError(f"{path}: name {spec.name!r} must match the file name")
    return spec


def zoo_spec(name: str) -> ModelSpec:
    path = MODELS_DIR / f"{name}.yaml"
    if not path.exists():
        raise ConfigError(f"unknown model {name!r}; zoo models: {', '.join(zoo_names())}")
    return load_spec(path)


def spec_from_hf_config(name: str, config: dict[str, Any]) -> ModelSpec:
    """A spec for a model given by path or hub id, from its config.json."""
    keep = {k: v for k, v in config.items() if k != "quantization"}
    return ModelSpec(name=name, config=keep, hf_id=None, source="config.json")
