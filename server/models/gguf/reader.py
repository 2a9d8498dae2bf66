"""Read a GGUF file through MLX (`mx.load` returns Q4_0/Q4_1/Q8_0 tensors as affine-quantized
triples, group size 32) and answer questions about its metadata in one-line errors."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

from batchsim.configs import ConfigError, file_kind
from batchsim.server.models.gguf.header import SUPPORTED, tensor_types, type_name

MAGIC = b"GGUF"
GROUP_SIZE = 32  # every GGUF block format MLX reads quantizes 32 values per scale


class GgufError(ConfigError):
    """A file this importer cannot turn into a model directory."""


@dataclasses.dataclass(frozen=True)
class Gguf:
    """A loaded GGUF: its tensors by GGUF name (quantized ones as .weight/.scales/.biases) and its
    key-value metadata."""

    path: Path
    tensors: dict[str, Any]
    meta: dict[str, Any]

    def value(self, key: str, default: Any = None) -> Any:
        """A metadata value as plain Python (MLX hands scalars back as 0-d arrays)."""
        v = self.meta.get(key, default)
        if hasattr(v, "tolist"):
            return v.tolist()
        return v

    def need(self, key: str) -> Any:
        v = self.value(key)
        if v is None:
            raise GgufError(f"{self.path}: GGUF metadata has no {key!r}")
        return v

    def strings(self, key: str) -> list[str]:
        """A required array of strings (tokens, merges)."""
        v = self.need(key)
        if not isinstance(v, list) or not all(isinstance(s, str) for s in v):
            raise GgufError(f"{self.path}: {key} must be an array of strings, got {str(v)[:40]}")
        return v


def check_magic(path: Path) -> None:
    if not path.is_file():  # /dev/zero or a pipe is there: 'no such file' said the wrong thing
        raise GgufError(f"{path}: is {file_kind(path)}, not a GGUF file" if path.exists()
                        else f"{path}: no such file")
    with path.open("rb") as f:
        head = f.read(4)
    if head != MAGIC:
        raise GgufError(f"{path}: not a GGUF file (it starts with {head!r}, a GGUF with {MAGIC!r})")


def check_tensor_types(path: Path) -> None:
    """One line naming the first tensor of a type MLX cannot read as it is stored."""
    try:
        types = tensor_types(path)
    except (ValueError, OSError) as exc:
        raise GgufError(f"{path}: unreadable GGUF header ({exc})") from None
    for name, type_id in types.items():
        if type_id not in SUPPORTED:
            raise GgufError(f"{path}: tensor {name} is {type_name(type_id)}; supported tensor "
                            f"types: {', '.join(SUPPORTED.values())}")


def read_gguf(path: str | Path) -> Gguf:
    """Load tensors and metadata; unsupported tensor types end in one line naming the ones MLX
    reads."""
    import mlx.core as mx

    path = Path(path)
    check_magic(path)
    check_tensor_types(path)
    try:
        tensors, meta = mx.load(str(path), return_metadata=True)
    except (RuntimeError, ValueError) as exc:
        reason = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        raise GgufError(f"{path}: MLX cannot read it ({reason}); supported tensor types: "
                        f"{', '.join(SUPPORTED.values())}") from None
    return Gguf(path, dict(tensors), dict(meta))
