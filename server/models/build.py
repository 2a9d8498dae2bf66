"""Materialize a zoo model as an mlx-lm loadable directory: config.json, safetensors with seeded random
weights (optionally quantized by mlx-lm's own quantizer), and a locally built tokenizer.

Speed and memory depend on shapes, not weight values, so a random-weight model with a real
architecture measures what the real checkpoint would. Built once per (model, dtype, quantization)."""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import re
import shutil
import sys
import tempfile
from pathlib import Path
from typing import Callable

from batchsim.server.models.spec import ModelSpec, dtype_bytes
from batchsim.server.models.tokenizer import build_tokenizer

BUILD_VERSION = 2
MARKER = "batchsim.json"
SHARD_BYTES = 2 << 30
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


def _save_weights(out_dir: Path, weights: dict) -> None:
    import mlx.core as mx

    shards: list[dict] = [{}]
    size = 0
    for name, arr in weights.items():
        if size + arr.nbytes > SHARD_BYTES and shards[-1]:
            shards.append({})
            size = 0
        shards[-1][name] = arr
        size += arr.nbytes
    if len(shards) == 1:
        mx.save_safetensors(str(out_dir / "model.safetensors"), shards[0], metadata={"format": "mlx"})
        return
    index = {"metadata": {"total_size": sum(a.nbytes for a in weights.values())}, "weight_map": {}}
    for i, shard in enumerate(shards, 1):
        fname = f"model-{i:05d}-of-{len(shards):05d}.safetensors"
        mx.save_safetensors(str(out_dir / fname), shard, metadata={"format": "mlx"})
        index["weight_map"].update({k: fname for k in shard})
    (out_dir / "model.safetensors.index.json").write_text(json.dumps(index, indent=1))


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
    sweep_dead_builds(out_dir.parent)
    if is_built(out_dir, spec, dtype, quantize_bits):
        return out_dir
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    log(f"building {build_id(spec.name, dtype, quantize_bits)} in {out_dir} "
        f"({spec.num_params / 1e6:.0f}M params, seeded random weights)")
    tmp = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.build-{os.getpid()}-", dir=out_dir.parent))
    try:
        config = {**spec.config, "torch_dtype": dtype}
        model_cls, args_cls = _get_classes(config)
        model = model_cls(args_cls.from_dict(config))
        model.update(tree_unflatten(list(_random_params(model, dtype, seed).items())))
        if quantize_bits:
            with contextlib.redirect_stdout(sys.stderr):  # mlx-lm prints an info line
                model, config = quantize_model(model, config, group_size=64, bits=quantize_bits)
        _save_weights(tmp, dict(tree_flatten(model.parameters())))
        (tmp / "config.json").write_text(json.dumps(config, indent=1))
        build_tokenizer(
            tmp,
            vocab_size=spec.vocab_size,
            bos_id=int(config.get("bos_token_id", 0)),
            eos_id=int(_first(config.get("eos_token_id", 0))),
            max_len=spec.max_context,
        )
        (tmp / MARKER).write_text(json.dumps(_marker(spec, dtype, quantize_bits, seed), indent=1))
        if out_dir.exists():
            shutil.rmtree(out_dir)
        tmp.rename(out_dir)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return out_dir


_BUILD_TMP = re.compile(r"^\..+\.build-(\d+)-\w+$")  # .NAME.build-PID-RANDOM (mkdtemp's)


def sweep_dead_builds(root: Path) -> list[Path]:
    """Remove the temporary directories of builds whose process is gone (killed, or the machine
    went down: hundreds of MB each); a build in progress elsewhere keeps its own. Returns them."""
    removed = []
    for path in root.glob(".*.build-*") if root.is_dir() else ():
        match = _BUILD_TMP.match(path.name)
        if match and path.is_dir() and not _alive(int(match.group(1))):
            shutil.rmtree(path, ignore_errors=True)
            removed.append(path)
    return removed


def _alive(pid: int) -> bool:
    if pid == os.getpid():
        return True
    try:
        os.kill(pid, 0)  # signal 0: is there such a process (no signal is sent)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process
        return True
    return True


def _first(value):
    return value[0] if isinstance(value, list) else value
