"""Checking an OpenAI request body: the error every refusal raises and the field checks that give
a 400 naming the field."""

from __future__ import annotations

import json
import math
from typing import Any


class APIError(Exception):
    """An error answered as {"error": {...}} with an HTTP status."""

    def __init__(self, status: int, message: str, *, type: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None,
                 headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type
        self.param = param
        self.code = code
        self.headers = headers or {}

    def body(self) -> dict[str, Any]:
        return error_body(self.message, self.type, self.param, self.code)


def error_body(message: str, type: str, param: str | None = None,
               code: str | None = None) -> dict[str, Any]:
    return {"error": {"message": message, "type": type, "param": param, "code": code}}


def get(body: dict[str, Any], key: str, default: Any) -> Any:
    """A field's value; an explicit null means the default, as OpenAI's API treats it."""
    value = body.get(key)
    return default if value is None else value


def is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def is_number(value: Any) -> bool:
    """A finite int or float; an int past a float's range (10**400) is not one."""
    if not (is_int(value) or isinstance(value, float)):
        return False
    try:
        return math.isfinite(value)
    except OverflowError:
        return False


def check(body: dict[str, Any], key: str, ok: bool, rule: str) -> None:
    """A 400 naming `key` unless `ok`."""
    if not ok:
        raise APIError(400, f"{key}: must be {rule}, got {json.dumps(body.get(key))[:80]}",
                       param=key)


def number_in(body: dict[str, Any], key: str, default: float, low: float, high: float,
              low_open: bool = False) -> float:
    """A finite number in [low, high] ((low, high] with low_open), or the default if absent."""
    value = get(body, key, default)
    above = is_number(value) and (value > low if low_open else value >= low)
    rule = (f"a number {'>' if low_open else '>='} {low:g}" if high == math.inf
            else f"a number in {'(' if low_open else '['}{low:g}, {high:g}]")
    check(body, key, above and value <= high, rule)
    return float(value)
