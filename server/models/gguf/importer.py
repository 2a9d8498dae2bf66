"""A llama-family GGUF as what an mlx-lm model directory holds: config.json, weights with Hugging
Face names, and the tokenizer (written by server/models/imported.py)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from batchsim.server.models.gguf.config import hf_config
from batchsim.server.models.gguf.reader import read_gguf
from batchsim.server.models.gguf.weights import (
    check_tensors,
    dequantized,
    hf_tensors,
    kept_quantized,
)

KEEP = "keep"  # `dtype` value: keep quantized tensors quantized (floats in float16)


def convert(path: str | Path, dtype: str = KEEP,
            scale_dtype: str = "float16") -> tuple[dict[str, Any], dict[str, Any], Any]:
    """(config.json, weights, gguf) for a GGUF; `dtype` dequantizes everything to a dense dtype,
    `keep` keeps quantized matrices packed (their scales, biases and floats in `scale_dtype`)."""
    g = read_gguf(path)
    config = hf_config(g)
    check_tensors(g, config)
    tensors = hf_tensors(g, config["num_attention_heads"], config["num_key_value_heads"])
    if config["tie_word_embeddings"]:
        tensors = {k: v for k, v in tensors.items() if not k.startswith("lm_head.")}
    if dtype == KEEP:
        weights, block = kept_quantized(tensors, scale_dtype)
        config = {**config, "torch_dtype": scale_dtype,
                  **({"quantization": block} if block else {})}
    else:
        weights = dequantized(tensors, dtype)
        config = {**config, "torch_dtype": dtype}
    return config, weights, g
