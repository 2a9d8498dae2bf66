"""The published MLX measurements (configs/reference/mlx-decode.yaml) as frozen dataclasses, each
row tied to a zoo model and a catalog Mac. Pure Python: the fit is in server.perf.mac_fit."""

from __future__ import annotations

import dataclasses
from functools import lru_cache
from pathlib import Path

from batchsim.configs import CONFIG_DIR, ConfigError, from_dict, load_yaml
from batchsim.server.perf.macs import Catalog, Mac

REFERENCE_PATH = CONFIG_DIR / "reference" / "mlx-decode.yaml"
WEIGHTS = {"q4": ("float16", 4), "q8": ("float16", 8), "float16": ("float16", None),
           "bfloat16": ("bfloat16", None)}
# Where a source publishes no prompt or output length: a short chat turn.
DEFAULT_PROMPT_TOKENS = 64
DEFAULT_GENERATED_TOKENS = 256


@dataclasses.dataclass(frozen=True)
class DecodeRow:
    """One published batch-1 decode measurement."""

    model: str  # zoo model with the measured checkpoint's shapes
    weights: str  # q4, q8 (mlx-lm affine, group 64), float16, bfloat16
    chip: str
    gpu_cores: int | None  # None: not published (the variants must share one bandwidth)
    memory_gb: float | None
    decode_tok_s: float
    prompt_tokens: int | None
    generated_tokens: int | None
    engine: str
    src: str
    prefill_tok_s: float | None = None  # the same run's prompt rate, where published
    note: str = ""

    def __post_init__(self) -> None:
        if self.weights not in WEIGHTS:
            raise ValueError(f"weights {self.weights!r}; allowed: {', '.join(WEIGHTS)}")

    @property
    def dtype(self) -> str:
        return WEIGHTS[self.weights][0]

    @property
    def quantize_bits(self) -> int | None:
        return WEIGHTS[self.weights][1]

    @property
    def width_tokens(self) -> int:
        """The mean context a decode step of this run reads: prompt plus half the output."""
        prompt = DEFAULT_PROMPT_TOKENS if self.prompt_tokens is None else self.prompt_tokens
        out = DEFAULT_GENERATED_TOKENS if self.generated_tokens is None else self.generated_tokens
        return prompt + out // 2

    @property
    def label(self) -> str:
        return f"{self.model} {self.weights} on {self.chip}"


@dataclasses.dataclass(frozen=True)
class BatchedRow:
    """A published batched-serving figure: never fitted on, only predicted beside."""

    model: str
    weights: str
    chip: str
    gpu_cores: int | None
    memory_gb: float | None
    concurrent: int
    single_tok_s: float
    total_tok_s: float
    src: str


@dataclasses.dataclass(frozen=True)
class ReferenceSet:
    sources: dict[str, str]
    rows: tuple[DecodeRow, ...]
    batched: tuple[BatchedRow, ...] = ()

    def __post_init__(self) -> None:
        cited = {r.src for r in self.rows} | {b.src for b in self.batched}
        missing = sorted(cited - set(self.sources))
        if missing:
            raise ConfigError(f"reference set: src {missing[0]!r} is not listed under sources")

    @property
    def chips(self) -> list[str]:
        return sorted({r.chip for r in self.rows})

    @property
    def models(self) -> list[str]:
        return sorted({r.model for r in self.rows})


@lru_cache(maxsize=4)
def load_reference(path: str | Path = REFERENCE_PATH) -> ReferenceSet:
    return from_dict(ReferenceSet, load_yaml(path), str(path))


def row_mac(catalog: Catalog, chip: str, gpu_cores: int | None) -> Mac:
    """The catalog Mac a row ran on. Without published GPU cores every variant of the chip must
    share one bandwidth (what batch-1 decode depends on); the first is returned."""
    variants = [m for m in catalog.chips if m.chip == chip]
    if gpu_cores is not None:
        variants = [m for m in variants if m.gpu_cores == gpu_cores]
    if not variants:
        raise ConfigError(f"reference row: no catalog Mac {chip} {gpu_cores or ''}".strip())
    if len({m.bw_gbs for m in variants}) > 1:
        raise ConfigError(f"reference row on {chip}: GPU cores not given and its variants differ "
                          f"in bandwidth ({', '.join(m.label for m in variants)})")
    return variants[0]
