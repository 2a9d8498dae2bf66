"""Read request trace files (Azure LLM inference CSV, Mooncake JSONL) into rows of arrival time and
lengths. The bottom of workloads/: lengths, spec and requests build on it, it imports none of them.

The shipped slices live in configs/traces/ (see SOURCES.md there); they come from large GPU
clusters, so a replay on one machine usually needs TraceSpec.time_scale and length scales/caps.
"""

from __future__ import annotations

import codecs
import csv
import dataclasses
import json
import math
import re
from collections.abc import Iterator
from datetime import datetime, timezone
from itertools import islice
from pathlib import Path
from typing import Literal

from batchsim.configs import CONFIG_DIR, ConfigError, file_kind

TRACE_DIR = CONFIG_DIR / "traces"
TraceFormat = Literal["auto", "azure", "mooncake"]
_AZURE_COLUMNS = ("TIMESTAMP", "ContextTokens", "GeneratedTokens")
_MOONCAKE_KEYS = ("timestamp", "input_length", "output_length")
MAX_TOKENS = 2**31 - 1  # a longer prompt or output is a typo (and overflows int32 token counts)
MOONCAKE_BLOCK_TOKENS = 512  # tokens per hash_ids block (Mooncake's FAST'25 traces)
# Azure writes 7 fractional digits; Python's datetime takes at most 6.
_AZURE_TIME = re.compile(r"^(\d{4}-\d\d-\d\d[ T]\d\d:\d\d:\d\d)(?:\.(\d+))?(.*)$")


@dataclasses.dataclass(frozen=True)
class TraceRow:
    t_s: float  # seconds after the first row used
    input_len: int  # prompt tokens
    output_len: int  # generated tokens
    # Mooncake: ids of the prompt's 512-token blocks (the last partial), chained like the prefix
    # cache's hashes; () when the trace has none (Azure).
    hash_ids: tuple[int, ...] = ()


def detect_format(path: Path) -> Literal["azure", "mooncake"]:
    if path.suffix == ".csv":
        return "azure"
    if path.suffix in (".jsonl", ".json"):
        return "mooncake"
    with path.open(encoding="utf-8-sig") as f:
        return "mooncake" if f.readline().lstrip().startswith("{") else "azure"


def parse_azure_time(text: str) -> float:
    """Seconds since the epoch for an Azure TIMESTAMP (naive times are read as UTC)."""
    match = _AZURE_TIME.match(text.strip())
    if match is None:
        raise ValueError(f"not a datetime: {text!r}")
    head, frac, tail = match.groups()
    stamp = datetime.fromisoformat(f"{head}.{(frac or '0')[:6].ljust(6, '0')}{tail}")
    if stamp.tzinfo is None:
        stamp = stamp.replace(tzinfo=timezone.utc)
    return stamp.timestamp()


RawRow = tuple[float, int, int, tuple[int, ...]]


def _read_azure(path: Path) -> Iterator[RawRow]:
    with path.open(newline="", encoding="utf-8-sig") as f:
        reader = csv.DictReader(f)
        missing = [c for c in _AZURE_COLUMNS if c not in (reader.fieldnames or ())]
        if missing:
            raise ConfigError(
                f"{path}: missing column {missing[0]!r}; an Azure trace has "
                f"{', '.join(_AZURE_COLUMNS)} "
                f"(found: {', '.join(map(_shown, reader.fieldnames or ()))})"
            )
        for row in reader:
            try:
                yield (_finite_s(parse_azure_time(row["TIMESTAMP"])),
                       _tokens(row["ContextTokens"]), _tokens(row["GeneratedTokens"]), ())
            except (TypeError, ValueError) as exc:
                raise ConfigError(f"{path}:{reader.line_num}: {exc}") from None


def _finite_s(t_s: float) -> float:
    """A row's time: a finite number of seconds (NaN or inf would never arrive)."""
    if not math.isfinite(t_s):
        raise ValueError(f"timestamp {t_s!r} s is not a finite number")
    return t_s


def _tokens(value: object) -> int:
    """A row's token count: an integer in [0, MAX_TOKENS] (a 10**12-token row ran out of memory)."""
    # Not true (1), 10.5 (was read as 10), None (a short CSV row), a list, nor a CSV cell
    # '10.5', '' or 'abc' (int() said "invalid literal for int() with base 10").
    integral = isinstance(value, (int, float, str)) and not isinstance(value, bool) and not (
        isinstance(value, float) and not value.is_integer())
    try:
        n = int(value) if integral else -1  # type: ignore[arg-type]
    except ValueError:
        n = -1
    if not 0 <= n <= MAX_TOKENS:
        raise ValueError(f"a token count must be an integer in [0, {MAX_TOKENS}], got {value!r}")
    return n


def _hash_ids(value: object) -> tuple[int, ...]:
    """A row's hash_ids: absent, or non-negative integers (one per 512-token block; blocks past
    them are the row's own, ids past its prompt unused)."""
    if value is None:
        return ()
    if not isinstance(value, list) or not all(type(h) is int and h >= 0 for h in value):
        raise ValueError("hash_ids must be a list of non-negative integers")
    return tuple(value)


def _read_mooncake(path: Path) -> Iterator[RawRow]:
    with path.open(encoding="utf-8-sig") as f:
        for line_no, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
                if not isinstance(row, dict) or type(row.get("timestamp", 0)) not in (int, float):
                    raise ValueError("a Mooncake row is a JSON object whose timestamp is a number "
                                     f"(ms), got {line.strip()[:60]}")
                yield (_finite_s(row["timestamp"] / 1000.0), _tokens(row["input_length"]),
                       _tokens(row["output_length"]), _hash_ids(row.get("hash_ids")))
            except KeyError as exc:
                raise ConfigError(
                    f"{path}:{line_no}: missing key {exc}; a Mooncake row has "
                    f"{', '.join(_MOONCAKE_KEYS)}"
                ) from None
            except (TypeError, ValueError, AttributeError, OverflowError) as exc:
                raise ConfigError(f"{path}:{line_no}: {exc}") from None  # 10**400 ms: Overflow
            except RecursionError:
                raise ConfigError(f"{path}:{line_no}: JSON nested too deeply") from None


def shipped_traces() -> list[str]:
    return sorted(p.name for p in TRACE_DIR.iterdir() if p.suffix in (".csv", ".jsonl"))


def resolve_trace_path(path: str | Path) -> Path:
    """Absolute paths as given; relative ones in configs/traces/ first, then the working
    directory."""
    given = Path(path).expanduser()
    candidates = [given] if given.is_absolute() else [TRACE_DIR / given, Path.cwd() / given]
    for candidate in candidates:
        if candidate.is_file():
            return candidate
        if candidate.exists():  # /dev/null, a directory: there, but nothing a trace is read from
            raise ConfigError(f"trace {str(path)!r}: {candidate} is {file_kind(candidate)}, not a "
                              "regular file (a .csv or .jsonl trace)")
    looked = ", ".join(str(c) for c in candidates)
    shipped = ", ".join(shipped_traces())
    raise ConfigError(f"trace {str(path)!r}: no such file (looked in {looked}); shipped: {shipped}")


_MARKS = ((codecs.BOM_UTF32_LE, "UTF-32"), (codecs.BOM_UTF32_BE, "UTF-32"),
          (codecs.BOM_UTF16_LE, "UTF-16"), (codecs.BOM_UTF16_BE, "UTF-16"))  # byte order marks


def read_trace(
    path: str | Path, format: TraceFormat = "auto", start: int = 0, limit: int | None = None
) -> list[TraceRow]:
    """Rows start .. start+limit-1 of a trace, with times relative to the first row used."""
    resolved = resolve_trace_path(path)
    if format not in ("auto", "azure", "mooncake"):
        raise ConfigError(
            f"trace format {format!r} is not allowed; allowed: 'auto', 'azure', 'mooncake'"
        )
    try:
        kind = detect_format(resolved) if format == "auto" else format
        reader = _read_azure if kind == "azure" else _read_mooncake
        raw = list(islice(reader(resolved), start, None if limit is None else start + limit))
    except UnicodeDecodeError as exc:  # said no file: "'utf-8' codec can't decode byte 0xff ..."
        with resolved.open("rb") as f:
            head = f.read(4)  # UTF-32-LE's mark starts with UTF-16-LE's: looked for first
        named = next((f"; it is {name}: save it as UTF-8" for bom, name in _MARKS
                      if head.startswith(bom)), "")
        raise ConfigError(f"{resolved}: not UTF-8 text (byte {_bad_utf8_at(resolved)}: "
                          f"{exc.reason}{named})") from None
    t0 = raw[0][0] if raw else 0.0
    return [TraceRow(t - t0, n_in, n_out, hashes) for t, n_in, n_out, hashes in raw]


def _shown(name: str) -> str:
    """A header cell as read, escaped where a line would hide what it holds (the NULs of UTF-16
    text without a byte order mark, a second mark): 'found: TIMESTAMP' said nothing."""
    return name if name.isprintable() else ascii(name)


def _bad_utf8_at(path: Path) -> int:
    """The file offset of the first byte that is not UTF-8 (the reader's error counted from its
    8 KiB chunk, and from after a byte order mark)."""
    decoder, offset = codecs.getincrementaldecoder("utf-8")(), 0
    with path.open("rb") as f:
        while chunk := f.read(1 << 20):
            pending = len(decoder.getstate()[0])  # bytes of a character the last chunk began
            try:
                decoder.decode(chunk)
            except UnicodeDecodeError as exc:
                return offset - pending + exc.start
            offset += len(chunk)
    return offset - len(decoder.getstate()[0])  # cut short: where that character began


def scale_length(n: int, scale: float, cap: int | None) -> int:
    """n * scale rounded, at least 1, at most cap."""
    scaled = max(1, round(n * scale))
    return min(scaled, cap) if cap is not None else scaled
