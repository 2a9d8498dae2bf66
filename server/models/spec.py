"""Model shapes and the arithmetic that follows from them: parameter count, weight bytes per dtype
or quantization, KV bytes per token, FLOPs per token. Pure Python: `size`, the roofline executor
and the scheduler use it without MLX."""

from __future__ import annotations

import dataclasses
from functools import cached_property
from pathlib import Path
from typing import Any, Literal

from batchsim.configs import CONFIG_DIR, ConfigError, from_dict, load_yaml
from batchsim.scheduler.kv_bytes import CacheLayout
from batchsim.server.models.arch import Arch, describe
from batchsim.server.models.arch_cache import cache_layout, generate_calls
from batchsim.server.models.arch_families import BUILDERS
from batchsim.server.models.packaged import Package

MODELS_DIR = CONFIG_DIR / "models"

DTYPE_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2}
FLOAT_DTYPES = tuple(DTYPE_BYTES)
QUANT_BITS = (4, 8)
SUPPORTED_MODEL_TYPES = tuple(BUILDERS)
SUMMARY_CONTEXTS = (4096, 32768)  # `batchsim models` reports KV bytes per sequence at these
# mlx-lm's QuantizedKVCache: K and V packed into uint32 at 4 or 8 bits, with a scale and a bias in
# the cache's dtype per group of elements along head_dim (arch_cache.KV_GROUP_SIZE).
KV_BITS = (4, 8)


@dataclasses.dataclass(frozen=True)
class ModelSpec:
    """One architecture: `config` is the Hugging Face config.json subset mlx-lm needs."""

    name: str
    config: dict[str, Any]
    hf_id: str | None = None
    source: str = ""
    weights: Literal["random", "real"] = "random"  # real: imported from `package`'s GGUF
    package: Package | None = None  # the PyPI package that ships the real weights

    def __post_init__(self) -> None:
        if (self.weights == "real") != (self.package is not None):
            raise ConfigError(f"model {self.name}: weights 'real' comes with a package (and only "
                              "then); random weights are built from the config")
        if self.config.get("model_type") not in SUPPORTED_MODEL_TYPES:
            describe(self.name, self.config)  # raises the one-line error naming the families
        for key in ("hidden_size", "num_hidden_layers", "num_attention_heads", "vocab_size",
                    "intermediate_size"):
            if not isinstance(self.config.get(key), int) or self.config[key] <= 0:
                raise ConfigError(f"model {self.name}: config.{key} must be a positive integer")
        _ = self.arch  # a config whose layers cannot be described fails here, in one line

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

    # Everything below comes from the per-layer description (arch.py), the one place that knows it.
    @cached_property
    def arch(self) -> Arch:
        return describe(self.name, self.config)

    @property
    def families(self) -> list[str]:
        return self.arch.families

    @property
    def is_dense(self) -> bool:
        return self.families == ["dense"]

    @cached_property
    def layer_linear_shapes(self) -> tuple[tuple[int, int], ...]:
        """The (out, in) matrices a decode step multiplies in one layer (dense models: all
        alike)."""
        return tuple((m.out_dim, m.in_dim) for m in self.arch.layers[0].mats)

    @cached_property
    def num_params(self) -> int:
        return self.arch.params

    @cached_property
    def active_params(self) -> int:
        """Params one token uses (MoE: top_k of the routed experts), embedding included."""
        return self.arch.active_params

    def weight_bytes(self, dtype: str = "float16", quantize_bits: int | None = None) -> int:
        """Bytes of the weights as mlx-lm holds them (quantization: mlx-lm's default predicate,
        every Linear and Embedding whose input dim divides the group size)."""
        if quantize_bits is not None and quantize_bits not in QUANT_BITS:
            raise ConfigError(f"quantize: {quantize_bits} is not allowed; allowed: 4, 8")
        return self.arch.weight_bytes(dtype_bytes(dtype), quantize_bits)

    def kv_bytes_per_token(self, dtype: str = "float16", kv_bits: int | None = None) -> int:
        """Bytes each further token adds: K and V (MLA: latent and RoPE key) of the layers whose
        cache grows with the context (dense: 2 x layers x kv_heads x head_dim x bytes); with
        kv_bits, what QuantizedKVCache holds instead (packed data + scales + biases)."""
        self.check_kv_bits(kv_bits)
        return self.arch.kv_bytes_per_token(dtype_bytes(dtype), kv_bits)

    def check_kv_bits(self, kv_bits: int | None) -> None:
        """A one-line error naming the model if mlx-lm cannot quantize its cache this way."""
        if kv_bits is None:
            return
        if kv_bits not in KV_BITS:
            raise ConfigError(f"kv_bits: {kv_bits} is not allowed; allowed: 4, 8")
        try:
            self.arch.cache_layout_check(kv_bits)
        except ConfigError as exc:
            raise ConfigError(f"model {self.name}: {exc}") from None

    def cache_layout(self, dtype: str = "float16", kv_bits: int | None = None) -> CacheLayout:
        """What the scheduler and executors price the cache by: per token for full-attention and
        MLA layers, sliding layers by window, fixed linear-attention states."""
        self.check_kv_bits(kv_bits)
        return cache_layout((lay.attention for lay in self.arch.layers),
                            dtype_bytes(dtype), kv_bits)

    def kv_bytes_per_seq(self, context_tokens: int, dtype: str = "float16",
                         kv_bits: int | None = None) -> int:
        """Cache bytes of one sequence holding `context_tokens` as mlx_lm.generate leaves it
        (prefill chunks, then single tokens): 256-token steps, windows, fixed states included."""
        self.check_kv_bits(kv_bits)
        return self.arch.cache_bytes(generate_calls(context_tokens), dtype_bytes(dtype), kv_bits)

    @property
    def is_full_attention(self) -> bool:
        """Every layer caches K/V for every token (dense or MoE FFNs): what the decode pool
        holds."""
        return all(lay.attention.kind == "full" for lay in self.arch.layers)

    def summary(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "hf_id": self.hf_id,
            "weights": self.weights,
            "model_type": self.model_type,
            "params": self.num_params,
            "family": self.families,
            "active_params": self.active_params,
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
            "kv_bytes_per_seq": {str(n): self.kv_bytes_per_seq(n) for n in SUMMARY_CONTEXTS},
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


def zoo_packages() -> list[Package]:
    """The PyPI packages that ship the zoo's real weights (scripts/setup.sh installs them)."""
    specs = (zoo_spec(n) for n in zoo_names())
    return sorted({s.package for s in specs if s.package}, key=lambda p: p.name)


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
