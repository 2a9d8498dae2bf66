"""A result's JSON text: non-finite floats and numpy scalars made portable (jsonable), compact
text (dumps). The standard library's only (no yaml, no numpy: the records' writer process,
record_process.py, starts on it beside the drawing child); jsonio.py has the files and run
directories."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

_INFINITIES = ("inf", "-inf")  # how jsonable spells float("inf"), float("-inf"); read back below


def jsonable(obj: Any) -> Any:
    if isinstance(obj, float) and not math.isfinite(obj):
        return None if math.isnan(obj) else _INFINITIES[obj < 0]
    if isinstance(obj, dict):
        return {str(k): jsonable(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        if all(type(v) is float or type(v) is int for v in obj) and all(map(math.isfinite, obj)):
            return obj  # long numeric lists (token times) need no walk
        return [jsonable(v) for v in obj]
    if isinstance(obj, Path):
        return str(obj)
    if hasattr(obj, "item") and callable(obj.item):  # numpy scalars
        return obj.item()
    return obj


def from_jsonable_float(value: Any) -> Any:
    """jsonable's inverse for a non-finite float: 'inf' and '-inf' are floats again (an infinite
    request rate in config.yaml: 'all at once'); anything else as it is."""
    return float(value) if value in _INFINITIES else value


_ENCODE = json.JSONEncoder(separators=(",", ":"), allow_nan=False).encode  # built once


def dumps(obj: Any) -> str:
    try:  # the common case: plain, finite data needs no walk (millions of token times)
        return _ENCODE(obj)
    except (ValueError, TypeError):
        return json.dumps(jsonable(obj), separators=(",", ":"))
