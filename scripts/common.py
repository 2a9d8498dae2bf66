"""What every command shares: where results go, JSONL and the closing JSON line, tables, progress."""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

# Tables and notes for people go to stdout before the closing JSON line; progress goes to stderr.
_WIDE = 160  # tables stay readable when piped to a file
out = Console(width=None if sys.stdout.isatty() else _WIDE)
err = Console(stderr=True, width=None if sys.stderr.isatty() else _WIDE)


def _jsonable(obj: Any) -> Any:
    if isinstance(obj, float) and not math.isfinite(obj):
        return None if math.isnan(obj) else ("inf" if obj > 0 else "-inf")
    if isinstance(obj, dict):
        return {str(k): _jsonable(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_jsonable(v) for v in obj]
    if isinstance(obj, Path):
        return str(obj)
    if hasattr(obj, "item") and callable(obj.item):  # numpy scalars
        return obj.item()
    return obj


def dumps(obj: Any) -> str:
    return json.dumps(_jsonable(obj), separators=(",", ":"))


def emit_json(obj: Any) -> None:
    """The last stdout line of every command: one JSON document."""
    sys.stdout.flush()
    print(dumps(obj), flush=True)


def append_jsonl(path: Path, rows: Iterable[dict]) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("a") as f:
        for row in rows:
            f.write(dumps(row) + "\n")
    return path


def write_jsonl(path: Path, rows: Iterable[dict]) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w") as f:
        for row in rows:
            f.write(dumps(row) + "\n")
    return path


def timestamp() -> str:
    return time.strftime("%Y%m%d-%H%M%S")


def int_list(text: str) -> list[int]:
    try:
        values = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None
    if not values or any(v <= 0 for v in values):
        raise argparse.ArgumentTypeError(f"expected positive integers, got {text!r}")
    return values


def str_list(text: str) -> list[str]:
    return [x.strip() for x in text.split(",") if x.strip()]


def positive_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
    if not value > 0:
        raise argparse.ArgumentTypeError(f"expected a positive number, got {text!r}")
    return value


def table(title: str, columns: Sequence[str], rows: Iterable[Sequence[Any]]) -> Table:
    t = Table(title=title, title_justify="left", header_style="bold")
    for c in columns:
        t.add_column(c, justify="right" if c not in ("mode", "model", "chip", "dtype", "metric") else "left")
    for row in rows:
        t.add_row(*[fmt(v) for v in row])
    return t


def fmt(value: Any) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        if not math.isfinite(value):
            return str(value)
        if value == 0:
            return "0"
        if abs(value) >= 100:
            return f"{value:,.0f}"
        if abs(value) >= 1:
            return f"{value:.2f}"
        return f"{value:.3g}"
    if isinstance(value, int) and abs(value) >= 10_000:
        return f"{value:,}"
    return str(value)


def gib(nbytes: float | None) -> float | None:
    return None if nbytes is None else nbytes / (1 << 30)


def median(values: Sequence[float]) -> float:
    s = sorted(values)
    n = len(s)
    if not n:
        return float("nan")
    return s[n // 2] if n % 2 else (s[n // 2 - 1] + s[n // 2]) / 2
