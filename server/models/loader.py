"""Resolve a model reference (zoo name, local directory, or hub id) to a directory and load it with
mlx-lm's own loader."""

from __future__ import annotations

import dataclasses
import json
import sys
from pathlib import Path
from typing import Any

from batchsim.configs import ConfigError
from batchsim.server.models.build import build_id, build_model, cache_root
from batchsim.server.models.files import MARKER
from batchsim.server.models.spec import ModelSpec, spec_from_hf_config, zoo_names, zoo_spec


class ModelNotFoundError(ConfigError):
    """A model reference that is neither a zoo name, a local model directory, nor a reachable hub
    id."""


@dataclasses.dataclass(frozen=True)
class ModelRef:
    """A resolved model: where its files are and the shapes batchsim reasons with."""

    name: str
    path: Path
    spec: ModelSpec
    dtype: str  # activation / KV dtype
    quantize_bits: int | None
    weights: str = "random"  # "real" (a checkpoint) or "random" (seeded, built by batchsim)


def _log(msg: str) -> None:
    print(f"batchsim: {msg}", file=sys.stderr, flush=True)


def _dtype_of(config: dict[str, Any]) -> str:
    dt = str(config.get("torch_dtype") or config.get("dtype") or "float16")
    return dt if dt in ("float32", "float16", "bfloat16") else "float16"


def resolve(ref: str, dtype: str, quantize_bits: int | None = None, build: bool = True) -> ModelRef:
    """A zoo name is built on first use (seeded random weights); a directory or hub id is used as it
    is stored (its own dtype and quantization)."""
    if ref in zoo_names():
        spec = zoo_spec(ref)
        if spec.weights == "real":
            return _packaged(spec, dtype, quantize_bits, build)
        path = build_model(spec, dtype, quantize_bits, log=_log) if build else Path()
        return ModelRef(ref, path, spec, dtype, quantize_bits)
    path = Path(ref).expanduser()
    if path.is_dir():
        return _from_dir(ref, path)
    return _from_dir(ref, _download(_hub_id(ref)))


def _hub_id(ref: str) -> str:
    """`ref` if it can name a hub repo (owner/name), else the one-line error: nothing asks the
    hub (and waits out its retries) for a name no repo can have."""
    if Path(ref).expanduser().exists() or ref.startswith((".", "/", "~")) or ref.count("/") != 1:
        raise ModelNotFoundError(
            f"model {ref!r}: not a zoo model, a model directory, or a hub id (owner/name); "
            f"zoo models: {', '.join(zoo_names())}"
        )
    return ref


def _packaged(spec: ModelSpec, dtype: str, quantize_bits: int | None, build: bool) -> ModelRef:
    """A real-weight zoo model in the form stored for this backend: dense `dtype` on the CPU backend
    (MLX's CPU quantized matmul is slow and does not batch), kept quantized on a GPU;
    `--quantize` equal to the file's bits keeps it quantized anywhere."""
    from batchsim.server.models.packaged import import_packaged, keeps_quantized

    pkg = spec.package
    assert pkg is not None
    if quantize_bits not in (None, pkg.bits):
        raise ConfigError(f"model {spec.name} ships {pkg.bits}-bit weights: --quantize {pkg.bits} "
                          f"keeps them quantized, no --quantize picks this backend's form")
    keep = quantize_bits is not None or keeps_quantized()
    bits = pkg.bits if keep else None
    path = cache_root() / build_id(spec.name, dtype, bits)
    if build:
        import_packaged(pkg, path, dtype, keep, log=_log)
    return ModelRef(spec.name, path, spec, dtype, bits, weights="real")


def _from_dir(name: str, path: Path) -> ModelRef:
    config_file = path / "config.json"
    if not config_file.exists():
        raise ModelNotFoundError(f"model directory {path} has no config.json")
    return _ref_of(name, path, _read_config(config_file), _weights_of(path), config_file)


def _ref_of(name: str, path: Path, config: dict[str, Any], weights: str,
            config_file: Path | str) -> ModelRef:
    """A stored model: its shapes, dtype and quantization as its config.json (`config_file`,
    named in errors) says."""
    quant = config.get("quantization") or {}
    if not isinstance(quant, dict) or type(quant.get("bits", 0)) not in (int, type(None)):
        raise ConfigError(f"{config_file}: 'quantization' is not an object with integer bits")
    spec = spec_from_hf_config(name, config)
    return ModelRef(name, path, spec, _dtype_of(config), quant.get("bits"), weights)


def _read_config(config_file: Path) -> dict[str, Any]:
    """A model's config.json as a JSON object, else a one-line error naming the file."""
    try:
        config = json.loads(config_file.read_text())
    except (OSError, ValueError, RecursionError) as exc:  # unreadable, not UTF-8, not JSON, deep
        raise ConfigError(f"{config_file}: not a model config ({type(exc).__name__}: "
                          f"{str(exc)[:120]})") from None
    if not isinstance(config, dict):
        raise ConfigError(f"{config_file}: not a model config (a JSON object of its fields)")
    return config


def _weights_of(path: Path) -> str:
    """A directory batchsim built says so in its marker; any other holds a real checkpoint."""
    try:
        return str(json.loads((path / MARKER).read_text()).get("weights", "random"))
    except (OSError, json.JSONDecodeError):
        return "real"


def _download(hub_id: str) -> Path:
    try:
        from mlx_lm.utils import _download as mlx_lm_download

        return Path(mlx_lm_download(hub_id))
    except Exception as exc:  # noqa: BLE001 - network, auth, missing repo: one way out for the user
        reason = str(exc).splitlines()[0][:200] if str(exc) else type(exc).__name__
        raise ModelNotFoundError(
            f"model {hub_id!r}: could not fetch it from the Hugging Face hub ({reason}). "
            f"Pass a local model directory, or a zoo model: {', '.join(zoo_names())}"
        ) from None


def spec_for(ref: str) -> ModelSpec:
    """The shapes of a zoo model, a model directory, or a hub id (its config.json alone)."""
    if ref in zoo_names():
        return zoo_spec(ref)
    path = Path(ref).expanduser()
    if path.is_dir():
        return _from_dir(ref, path).spec
    return spec_from_hf_config(ref, _hub_config(ref))


def stored_ref(ref: str, dtype: str, quantize_bits: int | None = None) -> ModelRef:
    """`ref` in the form `resolve` loads it (a zoo model in `dtype` and `quantize_bits`, a
    directory or hub id as stored), read without building or downloading its weights (a hub id:
    its config.json alone; path empty)."""
    if ref in zoo_names() or Path(ref).expanduser().is_dir():
        return resolve(ref, dtype, quantize_bits, build=False)
    return _ref_of(ref, Path(), _hub_config(ref), "real", f"{ref}'s config.json")


def _hub_config(ref: str) -> dict[str, Any]:
    """A hub model's config.json, else the one-line error."""
    hub_id = _hub_id(ref)
    try:
        from huggingface_hub import hf_hub_download

        config_path = Path(hf_hub_download(hub_id, "config.json"))
    except Exception as exc:  # noqa: BLE001 - unreachable hub, unknown repo, bad id: one message
        reason = str(exc).splitlines()[0][:200] if str(exc) else type(exc).__name__
        raise ModelNotFoundError(
            f"model {ref!r}: not a zoo model or a model directory, and its config.json could not "
            f"be fetched from the hub ({reason}); zoo models: {', '.join(zoo_names())}"
        ) from None
    return _read_config(config_path)


def load(ref: ModelRef) -> tuple[Any, Any]:
    """(model, tokenizer) through mlx_lm.load, the loader users run."""
    import mlx_lm

    model, tokenizer = mlx_lm.load(str(ref.path))
    # A prompt is checked against the model's context by batchsim itself (serve: a 400): no
    # transformers warning ("Token indices sequence length is longer than ...") on stderr too.
    tokenizer.model_max_length = sys.maxsize
    return model, tokenizer
