"""A Hugging Face config.json for a llama-family GGUF, from its `llama.*` metadata, each value
checked (a zero head count or a negative epsilon is one line here, not a crash later)."""

from __future__ import annotations

import math
from typing import Any

from batchsim.server.models.gguf.reader import Gguf, GgufError

ARCHITECTURES = ("llama",)  # general.architecture values this importer maps to mlx-lm's llama
MAX_COUNT = 1 << 24  # layers, heads, widths, vocabulary: beyond this a header is corrupt


def architecture(g: Gguf) -> str:
    arch = g.need("general.architecture")
    if arch not in ARCHITECTURES:
        raise GgufError(f"{g.path}: architecture {arch!r} is not supported; supported: "
                        f"{', '.join(ARCHITECTURES)} (llama-family GGUFs)")
    return arch


def _count(g: Gguf, key: str, default: int | None = None) -> int:
    """A positive integer from the metadata (`default` when absent; required without one)."""
    value = g.need(key) if default is None else g.value(key, default)
    if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= MAX_COUNT:
        raise GgufError(f"{g.path}: {key} must be an integer in 1..{MAX_COUNT}, got {value!r}")
    return value


def _positive(g: Gguf, key: str, default: float) -> float:
    value = g.value(key, default)
    if not isinstance(value, (int, float)) or not 0 < value < math.inf:
        raise GgufError(f"{g.path}: {key} must be a positive finite number, got {value!r}")
    return float(value)


def _token_id(g: Gguf, key: str, vocab: int) -> int | None:
    value = g.value(key)
    if value is not None and (not isinstance(value, int) or not 0 <= value < vocab):
        raise GgufError(f"{g.path}: {key} {value!r} is not a token id (the vocabulary has {vocab})")
    return value


def _check_unmapped(g: Gguf, arch: str, head_dim: int, vocab: int, tokens: int) -> None:
    """Metadata the llama config cannot carry, or that contradicts what it holds: imported, the
    model ran and answered wrongly (experts, scaled or partial RoPE, ids past the embedding)."""
    experts = g.value(f"{arch}.expert_count") or 0
    if experts != 0:
        raise GgufError(f"{g.path}: {arch}.expert_count {experts!r}: mixture-of-experts GGUFs "
                        "are not supported (dense llama only)")
    scaling = g.value(f"{arch}.rope.scaling.type") or "none"
    if scaling != "none":
        raise GgufError(f"{g.path}: {arch}.rope.scaling.type {scaling!r} is not supported (the "
                        "import would run it unscaled)")
    if vocab < tokens:
        raise GgufError(f"{g.path}: {arch}.vocab_size {vocab} is less than the {tokens} tokens "
                        "of tokenizer.ggml.tokens (ids past the embedding)")
    for key in (f"{arch}.rope.dimension_count", f"{arch}.attention.value_length"):
        value = g.value(key)
        if value is not None and value != head_dim:
            raise GgufError(f"{g.path}: {key} {value!r} differs from the head dimension "
                            f"{head_dim} (mlx-lm's llama rotates and projects whole heads)")


def hf_config(g: Gguf) -> dict[str, Any]:
    """config.json for mlx-lm's llama model (tied embeddings when the file has no output matrix)."""
    arch = architecture(g)
    heads = _count(g, f"{arch}.attention.head_count")
    hidden = _count(g, f"{arch}.embedding_length")
    kv_heads = _count(g, f"{arch}.attention.head_count_kv", heads)
    if heads % kv_heads:
        raise GgufError(f"{g.path}: head_count {heads} is not a multiple of head_count_kv "
                        f"{kv_heads}")
    tokens = g.strings("tokenizer.ggml.tokens")
    vocab = _count(g, f"{arch}.vocab_size", len(tokens))
    head_dim = g.value(f"{arch}.attention.key_length") or g.value(f"{arch}.rope.dimension_count")
    config: dict[str, Any] = {
        "model_type": "llama",
        "architectures": ["LlamaForCausalLM"],
        "hidden_size": hidden,
        "intermediate_size": _count(g, f"{arch}.feed_forward_length"),
        "num_hidden_layers": _count(g, f"{arch}.block_count"),
        "num_attention_heads": heads,
        "num_key_value_heads": kv_heads,
        "head_dim": _count(g, f"{arch}.attention.key_length", head_dim or hidden // heads),
        "vocab_size": vocab,
        "max_position_embeddings": _count(g, f"{arch}.context_length", 4096),
        "rms_norm_eps": _positive(g, f"{arch}.attention.layer_norm_rms_epsilon", 1e-5),
        "rope_theta": _positive(g, f"{arch}.rope.freq_base", 10000.0),
        "tie_word_embeddings": "output.weight" not in g.tensors,
        "bos_token_id": _token_id(g, "tokenizer.ggml.bos_token_id", len(tokens)),
        "eos_token_id": _token_id(g, "tokenizer.ggml.eos_token_id", len(tokens)),
    }
    _check_unmapped(g, arch, config["head_dim"], vocab, len(tokens))
    for role in ("unknown", "padding"):  # tokenizer_config.json names these by their text
        _token_id(g, f"tokenizer.ggml.{role}_token_id", len(tokens))
    return {k: v for k, v in config.items() if v is not None}
