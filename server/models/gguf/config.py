"""A Hugging Face config.json for a llama-family GGUF, from its `llama.*` metadata."""

from __future__ import annotations

from typing import Any

from batchsim.server.models.gguf.reader import Gguf, GgufError

ARCHITECTURES = ("llama",)  # general.architecture values this importer maps to mlx-lm's llama


def architecture(g: Gguf) -> str:
    arch = g.need("general.architecture")
    if arch not in ARCHITECTURES:
        raise GgufError(f"{g.path}: architecture {arch!r} is not supported; supported: "
                        f"{', '.join(ARCHITECTURES)} (llama-family GGUFs)")
    return arch


def hf_config(g: Gguf) -> dict[str, Any]:
    """config.json for mlx-lm's llama model (tied embeddings when the file has no output matrix)."""
    arch = architecture(g)
    heads = int(g.need(f"{arch}.attention.head_count"))
    hidden = int(g.need(f"{arch}.embedding_length"))
    vocab = g.value(f"{arch}.vocab_size") or len(g.need("tokenizer.ggml.tokens"))
    config: dict[str, Any] = {
        "model_type": "llama",
        "architectures": ["LlamaForCausalLM"],
        "hidden_size": hidden,
        "intermediate_size": int(g.need(f"{arch}.feed_forward_length")),
        "num_hidden_layers": int(g.need(f"{arch}.block_count")),
        "num_attention_heads": heads,
        "num_key_value_heads": int(g.value(f"{arch}.attention.head_count_kv") or heads),
        "head_dim": int(g.value(f"{arch}.attention.key_length")
                        or g.value(f"{arch}.rope.dimension_count") or hidden // heads),
        "vocab_size": int(vocab),
        "max_position_embeddings": int(g.value(f"{arch}.context_length") or 4096),
        "rms_norm_eps": float(g.value(f"{arch}.attention.layer_norm_rms_epsilon") or 1e-5),
        "rope_theta": float(g.value(f"{arch}.rope.freq_base") or 10000.0),
        "tie_word_embeddings": "output.weight" not in g.tensors,
        "bos_token_id": g.value("tokenizer.ggml.bos_token_id"),
        "eos_token_id": g.value("tokenizer.ggml.eos_token_id"),
    }
    return {k: v for k, v in config.items() if v is not None}
