"""What every command shares: where results go, JSONL and the closing JSON line, tables, progress."""

from __future__ import annotations

import argparse
import math
import sys
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

from batchsim.server.results.jsonio import append_jsonl, dumps, jsonable, timestamp, write_jsonl  # noqa: F401

# Tables and notes for people go to stdout before the closing JSON line; progress goes to stderr.
_WIDE = 160  # tables stay readable when piped to a file
out = Console(width=None if sys.stdout.isatty() else _WIDE)
err = Console(stderr=True, width=None if sys.stderr.isatty() else _WIDE)


def emit_json(obj: Any) -> None:
    """The last stdout line of every command: one JSON document."""
    sys.stdout.flush()
    print(dumps(obj), flush=True)


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


def pyplot():
    """matplotlib.pyplot on the file-only Agg backend (no display needed), imported on first use."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def save_figure(fig, path: Path, dpi: int = 110) -> Path:
    import matplotlib.pyplot as plt

    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=dpi)
    plt.close(fig)
    return path
