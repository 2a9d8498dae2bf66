"""Materialize a zoo model as an mlx-lm loadable directory: config.json, safetensors with seeded
random weights (optionally quantized by mlx-lm's own quantizer), and a locally built tokenizer.

Speed and memory depend on shapes, not weight values, so a random-weight model with a real
architecture measures what the real checkpoint would. Built once per (model, dtype,
quantization)."""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import sys
from collections.abc import Callable
from pathlib import Path

from batchsim.server.models.files import MARKER, save_weights, staged_dir, sweep_dead_builds
from batchsim.server.models.spec import ModelSpec, dtype_bytes
from batchsim.server.models.tokenizer import build_tokenizer

BUILD_VERSION = 2
EMBED_STD = 0.02


def cache_root() -> Path:
    return Path(os.environ.get("BATCHSIM_HOME") or Path.home() / ".cache" / "batchsim") / "models"


def build_id(name: str, dtype: str, quantize_bits: int | None) -> str:
    return f"{name}-{dtype}" + (f"-q{quantize_bits}" if quantize_bits else "")


def _param_key(seed: int, name: str) -> int:
    return int.from_bytes(hashlib.sha256(f"{seed}:{name}".encode()).digest()[:4], "little")


def _random_params(model, dtype: str, seed: int) -> dict:
    """Seeded per-parameter values (independent of traversal order). Projections get
    N(0, 1/fan_in) so every layer moves the residual stream (outputs then depend on the context,
    as a trained model's do, instead of echoing the input token through tied embeddings);
    embeddings N(0, 0.02); ones for norms, zeros for biases."""
    import mlx.core as mx
    from mlx.utils import tree_flatten

    mx_dtype = getattr(mx, dtype)
    params = {}
    for name, value in tree_flatten(model.parameters()):
        if "norm" in name:
            params[name] = mx.ones(value.shape, dtype=mx_dtype)
        elif name.endswith(".bias"):
            params[name] = mx.zeros(value.shape, dtype=mx_dtype)
        else:
            key = mx.random.key(_param_key(seed, name))
            std = EMBED_STD if "embed" in name else value.shape[-1] ** -0.5
            params[name] = (mx.random.normal(value.shape, key=key) * std).astype(mx_dtype)
        mx.eval(params[name])
    return params


def is_built(path: Path, spec: ModelSpec, dtype: str, quantize_bits: int | None) -> bool:
    marker = path / MARKER
    if not marker.exists():
        return False
    try:
        info = json.loads(marker.read_text())
    except json.JSONDecodeError:
        return False
    return info == _marker(spec, dtype, quantize_bits, info.get("seed", 0))


def _marker(spec: ModelSpec, dtype: str, quantize_bits: int | None, seed: int) -> dict:
    return {"name": spec.name, "dtype": dtype, "quantize_bits": quantize_bits, "seed": seed,
            "build_version": BUILD_VERSION, "config": spec.config}


def build_model(
    spec: ModelSpec,
    dtype: str,
    quantize_bits: int | None = None,
    out_dir: Path | None = None,
    seed: int = 0,
    log: Callable[[str], None] = lambda _: None,
) -> Path:
    """Build (once) and return the model directory. Quantized builds start from float16 weights."""
    from mlx.utils import tree_flatten, tree_unflatten
    from mlx_lm.utils import _get_classes, quantize_model

    dtype_bytes(dtype)
    out_dir = out_dir or cache_root() / build_id(spec.name, dtype, quantize_bits)
    sweep_dead_builds(out_dir.parent)  # whatever is built: killed builds leave hundreds of MB
    if is_built(out_dir, spec, dtype, quantize_bits):
        return out_dir
    log(f"building {build_id(spec.name, dtype, quantize_bits)} in {out_dir} "
        f"({spec.num_params / 1e6:.0f}M params, seeded random weights)")
    with staged_dir(out_dir) as tmp:
        config = {**spec.config, "torch_dtype": dtype}
        model_cls, args_cls = _get_classes(config)
        model = model_cls(args_cls.from_dict(config))
        model.update(tree_unflatten(list(_random_params(model, dtype, seed).items())))
        if quantize_bits:
            with contextlib.redirect_stdout(sys.stderr):  # mlx-lm prints an info line
                model, config = quantize_model(model, config, group_size=64, bits=quantize_bits)
        save_weights(tmp, dict(tree_flatten(model.parameters())))
        (tmp / "config.json").write_text(json.dumps(config, indent=1))
        build_tokenizer(
            tmp,
            vocab_size=spec.vocab_size,
            bos_id=int(config.get("bos_token_id", 0)),
            eos_id=int(_first(config.get("eos_token_id", 0))),
            max_len=spec.max_context,
        )
        (tmp / MARKER).write_text(json.dumps(_marker(spec, dtype, quantize_bits, seed), indent=1))
    return out_dir


def _first(value):
    return value[0] if isinstance(value, list) else value
