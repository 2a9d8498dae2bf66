"""`batchsim models import FILE.gguf`: a llama-family GGUF as an mlx-lm model directory (config.json,
model.safetensors with Hugging Face names, tokenizer.json, tokenizer_config.json)."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any, Callable

from batchsim.server.models.gguf.config import hf_config
from batchsim.server.models.gguf.reader import read_gguf
from batchsim.server.models.gguf.tokenizer import write_tokenizer
from batchsim.server.models.gguf.weights import dequantized, hf_tensors, kept_quantized

KEEP = "keep"  # `dtype` value: keep quantized tensors quantized (floats in float16)


def convert(path: str | Path, dtype: str = KEEP,
            scale_dtype: str = "float16") -> tuple[dict[str, Any], dict[str, Any], Any]:
    """(config.json, weights, gguf) for a GGUF; `dtype` dequantizes everything to a dense dtype,
    `keep` keeps quantized matrices packed (their scales, biases and floats in `scale_dtype`)."""
    g = read_gguf(path)
    config = hf_config(g)
    tensors = hf_tensors(g, config["num_attention_heads"], config["num_key_value_heads"])
    if config["tie_word_embeddings"]:
        tensors = {k: v for k, v in tensors.items() if not k.startswith("lm_head.")}
    if dtype == KEEP:
        weights, block = kept_quantized(tensors, scale_dtype)
        config = {**config, "torch_dtype": scale_dtype, **({"quantization": block} if block else {})}
    else:
        weights = dequantized(tensors, dtype)
        config = {**config, "torch_dtype": dtype}
    return config, weights, g


def import_gguf(path: str | Path, out_dir: Path, dtype: str = KEEP, scale_dtype: str = "float16",
                marker: dict[str, Any] | None = None,
                log: Callable[[str], None] = lambda _: None) -> Path:
    """Write the model directory (atomically: a half-written one never appears at `out_dir`).
    `marker` adds to batchsim.json, which says the weights are real."""
    from batchsim.server.models.build import MARKER, save_weights, staged_dir

    start_s = time.perf_counter()
    config, weights, g = convert(path, dtype, scale_dtype)
    with staged_dir(out_dir) as tmp:
        save_weights(tmp, weights)
        (tmp / "config.json").write_text(json.dumps(config, indent=1))
        write_tokenizer(g, tmp)
        info = {"weights": "real", "source": str(Path(path).resolve()), **(marker or {})}
        (tmp / MARKER).write_text(json.dumps(info, indent=1))
    log(f"imported {Path(path).name} into {out_dir} in {time.perf_counter() - start_s:.1f} s")
    return out_dir
