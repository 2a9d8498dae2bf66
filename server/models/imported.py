"""`batchsim models import FILE.gguf`: write a llama-family GGUF as an mlx-lm model directory
(config.json, model.safetensors with Hugging Face names, tokenizer.json, tokenizer_config.json)."""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from batchsim.server.models.files import MARKER, save_weights, staged_dir
from batchsim.server.models.gguf.importer import KEEP, convert
from batchsim.server.models.gguf.tokenizer import tokenizer_files


def import_gguf(path: str | Path, out_dir: Path, dtype: str = KEEP, scale_dtype: str = "float16",
                marker: dict[str, Any] | None = None,
                log: Callable[[str], None] = lambda _: None) -> Path:
    """Write the model directory (atomically: a half-written one never appears at `out_dir`).
    `marker` adds to batchsim.json, which says the weights are real."""
    start_s = time.perf_counter()
    config, weights, g = convert(path, dtype, scale_dtype)
    files = {"config.json": json.dumps(config, indent=1), **tokenizer_files(g)}  # checked first
    with staged_dir(out_dir) as tmp:
        save_weights(tmp, weights)
        for name, text in files.items():
            (tmp / name).write_text(text)
        info = {"weights": "real", "source": str(Path(path).resolve()), **(marker or {})}
        (tmp / MARKER).write_text(json.dumps(info, indent=1))
    log(f"imported {Path(path).name} into {out_dir} in {time.perf_counter() - start_s:.1f} s")
    return out_dir
