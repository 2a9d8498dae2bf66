"""Token-length distributions for prompts, outputs and contexts: seeded, integer, >= 1, clipped;
parsed from the CLI form, or resampled from a trace column."""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path
from typing import Literal

import numpy as np
from batchsim.configs import ConfigError
from batchsim.workloads.traces import MAX_TOKENS, TraceFormat, read_trace, scale_length

ZIPF_MAX_RANKS = 1 << 22  # zipf samples from a table of every length in [min, max]: 100 MB here
Dist = Literal["fixed", "uniform", "normal", "lognormal", "zipf", "empirical"]


@dataclasses.dataclass(frozen=True)
class LengthSpec:
    """`fixed`: value. `uniform`: integers in [min, max]. `normal` / `lognormal`: mean and std of
    the length itself. `zipf`: exponent `a` over [min, max]. `empirical`: resample `values`
    (e.g. a trace column). Every draw is clipped to [min, max]."""

    dist: Dist = "fixed"
    value: int | None = None
    min: int = 1
    max: int | None = None
    mean: float | None = None
    std: float | None = None
    a: float | None = None
    values: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        need = {
            "fixed": ("value",), "uniform": ("max",), "normal": ("mean", "std"),
            "lognormal": ("mean", "std"), "zipf": ("a", "max"), "empirical": ("values",),
        }
        if self.dist not in need:
            raise ConfigError(f"length dist {self.dist!r} is not allowed; allowed: "
                              f"{', '.join(need)}")
        for key in need[self.dist]:
            value = getattr(self, key)
            ok = bool(value) if key == "values" else value is not None and 0 < value < math.inf
            if not ok:
                raise ConfigError(
                    f"length dist {self.dist!r} needs a positive {key!r}, got {value!r}")
        # std too: lognormal's (std / mean) ** 2 overflowed (an OverflowError traceback at 1e300)
        big = [k for k in ("value", "min", "max", "mean", "std")
               if (getattr(self, k) or 0) > MAX_TOKENS]
        if big:
            value = getattr(self, big[0])
            raise ConfigError(f"length {big[0]!r} must be <= {MAX_TOKENS}, got {value!r}")
        if self.min < 1 or (self.max is not None and self.max < self.min):
            raise ConfigError(f"length bounds must satisfy 1 <= min <= max, got [{self.min}, "
                              f"{self.max}]")
        if self.dist == "zipf" and self.a is not None and self.a <= 1:
            raise ConfigError("zipf needs a > 1")
        if self.dist == "zipf" and self.max - self.min >= ZIPF_MAX_RANKS:  # a table per rank
            raise ConfigError(f"zipf spans at most {ZIPF_MAX_RANKS} lengths (max - min < "
                              f"{ZIPF_MAX_RANKS}), got [{self.min}, {self.max}]")

    @property
    def upper(self) -> int:
        """The largest length this spec can produce."""
        if self.dist == "fixed":
            return min(self.value, self.max) if self.max else int(self.value)
        if self.dist == "empirical":
            top = max(self.values)
            return min(top, self.max) if self.max else top
        return int(self.max) if self.max else 1 << 31

    @property
    def cli_form(self) -> str:
        """The spec as parse_length's text (`128`, `uniform:32:128`); bounds outside that form are
        left out, and an empirical spec is summarised."""
        cap = f":{self.max}" if self.max is not None else ""
        if self.dist == "fixed":
            return str(self.value)
        if self.dist == "uniform":
            return f"uniform:{self.min}:{self.max}"
        if self.dist in ("normal", "lognormal"):
            return f"{self.dist}:{self.mean:g}:{self.std:g}{cap}"
        if self.dist == "zipf":
            return f"zipf:{self.a:g}:{self.min}:{self.max}"
        return f"{self.dist} ({len(self.values)} values)"

    def sample(self, n: int, rng: np.random.Generator) -> np.ndarray:
        d = self.dist
        if d == "fixed":
            x = np.full(n, self.value, dtype=np.float64)
        elif d == "uniform":
            x = rng.integers(self.min, self.max + 1, size=n).astype(np.float64)
        elif d == "normal":
            x = rng.normal(self.mean, self.std, size=n)
        elif d == "lognormal":
            sigma2 = np.log1p((self.std / self.mean) ** 2)
            x = rng.lognormal(np.log(self.mean) - sigma2 / 2, np.sqrt(sigma2), size=n)
        elif d == "zipf":
            ranks = np.arange(self.min, self.max + 1, dtype=np.float64)
            p = ranks ** -self.a
            x = rng.choice(ranks, size=n, p=p / p.sum())
        else:
            x = rng.choice(np.asarray(self.values, dtype=np.float64), size=n)
        hi = self.max if self.max is not None else np.inf
        return np.clip(np.rint(x), self.min, hi).astype(np.int64)


def parse_length(text: str) -> LengthSpec:
    """Compact CLI form: `128`, `fixed:128`, `uniform:64:512`, `normal:MEAN:STD[:MAX]`,
    `lognormal:MEAN:STD[:MAX]`, `zipf:A:MIN:MAX`, `trace:FILE[:input|output[:MAX]]` (resample a
    trace column; FILE relative to configs/traces/ or the working directory)."""
    parts = text.split(":")
    if parts[0] == "trace" and 2 <= len(parts) <= 4:
        return _trace_length(parts[1:])
    try:
        if len(parts) == 1:
            return LengthSpec("fixed", value=int(parts[0]))
        kind, args = parts[0], [float(p) for p in parts[1:]]
        if kind == "fixed" and len(args) == 1:
            return LengthSpec("fixed", value=int(args[0]))
        if kind == "uniform" and len(args) == 2:
            return LengthSpec("uniform", min=int(args[0]), max=int(args[1]))
        if kind in ("normal", "lognormal") and len(args) in (2, 3):
            top = int(args[2]) if len(args) == 3 else None
            return LengthSpec(kind, mean=args[0], std=args[1], max=top)
        if kind == "zipf" and len(args) == 3:
            return LengthSpec("zipf", a=args[0], min=int(args[1]), max=int(args[2]))
    except ConfigError as exc:  # the form parsed; its values do not fit
        raise ConfigError(f"length {text!r}: {exc}") from None
    except (ValueError, OverflowError):  # not numbers, or an infinite integer
        pass
    raise ConfigError(
        f"length {text!r}: expected N, fixed:N, uniform:MIN:MAX, normal:MEAN:STD[:MAX], "
        "lognormal:MEAN:STD[:MAX], zipf:A:MIN:MAX or trace:FILE[:input|output[:MAX]]"
    )


def _trace_length(args: list[str]) -> LengthSpec:
    column = args[1] if len(args) > 1 else "input"
    try:
        max_len = int(args[2]) if len(args) > 2 else None
    except ValueError:
        raise ConfigError(f"length trace:{':'.join(args)}: MAX must be an integer") from None
    return trace_lengths(args[0], column, max_len=max_len)  # type: ignore[arg-type]


def trace_lengths(
    path: str | Path,
    column: Literal["input", "output"] = "input",
    *,
    format: TraceFormat = "auto",
    start: int = 0,
    limit: int | None = None,
    scale: float = 1.0,
    max_len: int | None = None,
) -> LengthSpec:
    """An empirical LengthSpec resampling one trace column (scaled, capped): e.g. the context
    lengths a KV-cache sizing should plan for."""
    if column not in ("input", "output"):
        raise ConfigError(f"trace column {column!r} is not allowed; allowed: 'input', 'output'")
    if not (0 < scale < math.inf):
        raise ConfigError(f"trace length scale: must be > 0 and finite, got {scale!r}")
    rows = read_trace(path, format, start, limit)
    if not rows:
        raise ConfigError(f"trace {str(path)!r}: no rows from row {start}")
    raw = (r.input_len if column == "input" else r.output_len for r in rows)
    values = tuple(scale_length(n, scale, max_len) for n in raw)
    return LengthSpec("empirical", values=values, max=max_len)
