"""What every command shares: flags built from config dataclasses, where results go, JSONL and the
closing JSON line, tables."""

from __future__ import annotations

import argparse
import dataclasses
import math
import os
import sys
import types
import typing
from collections.abc import Iterable, Sequence
from typing import Any

from batchsim.configs import type_hints
from batchsim.server.results.json_text import dumps, jsonable  # noqa: F401 (re-exported)
from batchsim.server.results.jsonio import (  # noqa: F401 (re-exported for the commands)
    append_jsonl,
    timestamp,
    write_jsonl,
)
from batchsim.server.results.plots import pyplot, save_figure  # noqa: F401
from batchsim.server.results.timeline import executor_label  # noqa: F401 (re-exported)
from batchsim.workloads.lengths import LengthSpec
from rich.console import Console
from rich.segment import Segments
from rich.table import Table

# Tables and notes for people go to stdout before the closing JSON line; progress goes to stderr.
_WIDE = 160  # tables stay readable when piped to a file (COLUMNS, when set, says otherwise)


def _width(stream) -> int | None:
    columns = os.environ.get("COLUMNS", "")
    if stream is not None and stream.isatty():
        return None
    return int(columns) if columns.isdigit() else _WIDE


# Text prints as it is: a user's name, path or value (a workload `w[/x]`, `:-1:`) is never rich
# markup (a MarkupError traceback, a path printed without its `[old]`) nor an emoji. Styles go in
# style= (or a rich Text), never in the text (tests/test_console_text.py checks the sources).
out = Console(width=_width(sys.stdout), emoji=False, markup=False)
err = Console(stderr=True, width=_width(sys.stderr), emoji=False, markup=False)


def laid_out(renderable: Any) -> Segments:
    """`renderable` rendered for `out` now, as out.print renders it (its options): printing the
    result later copies the segments, the same text."""
    options = out.options.update(justify=None, overflow=None, height=None, no_wrap=None,
                                 markup=None, highlight=None)
    return Segments(list(out.render(renderable, options)))


# Exit codes (the README's commands section and `batchsim --help` list them).
EXIT_FAILED, EXIT_USAGE, EXIT_SERVED_NOTHING, EXIT_INTERRUPTED = 1, 2, 3, 130
EXIT_CODES_HELP = (f"exit codes: 0 done; {EXIT_FAILED} failed (every request failed, a launch "
                   f"failed); {EXIT_USAGE} bad input (flags, config, model); {EXIT_SERVED_NOTHING} "
                   f"a run that served no request (all rejected: see requests.jsonl); "
                   f"{EXIT_INTERRUPTED} interrupted (Ctrl-C, SIGTERM, SIGHUP; records so far are "
                   "kept)")


class CommandFailed(Exception):
    """A command that ran to the end but failed: `summary` is still printed as the closing JSON
    line, then the message on stderr, and the exit code is `exit_code`."""

    def __init__(self, message: str, summary: dict, exit_code: int = EXIT_FAILED) -> None:
        super().__init__(message)
        self.summary, self.exit_code = summary, exit_code


def stop_if_interrupted(summary: dict[str, Any]) -> dict[str, Any]:
    """A run of a command that runs several (sweep's points, compare's two): a signal that stopped
    it stops the command (KeyboardInterrupt: exit 130, run directories kept), not only that run's
    sending (the next run started, and the table used the cut-short one, exit 0)."""
    if str(summary.get("interrupt_reason")).startswith("SIG"):  # not a full disk's stop
        raise KeyboardInterrupt
    return summary


def run_stoppable(session: Any, spec: Any, **kwargs: Any) -> Any:
    """run_workload with SIGTERM and SIGHUP answered as Ctrl-C (as run_path.run_config answers
    them for `run` and `compare`): the run stops, its records and summary.json kept (they killed
    calibrate and validate, the run dir unsummarized)."""
    from batchsim.server.engine.interrupts import Interrupts
    from batchsim.server.engine.runner import run_workload
    from batchsim.server.platform.signals import STOP_SIGNALS

    with Interrupts(STOP_SIGNALS) as stop:
        return run_workload(session, spec, interrupts=stop, **kwargs)


def err_line(text: str) -> None:
    """One plain line on stderr: never wrapped, no rich markup (`:-1:` stays text)."""
    print(" ".join(str(text).split()), file=sys.stderr, flush=True)


def emit_json(obj: Any) -> None:
    """The last stdout line of every command: one JSON document. A reader that closed the pipe
    (`batchsim run --json | head -c 1`) ends the command as rich does for the tables: stdout to
    /dev/null, exit 1 (it was a BrokenPipeError traceback, then another at exit). A stdout that
    cannot take it (`> file` on a full disk, /dev/full) says so in one line, exit 1 (it was an
    OSError traceback)."""
    try:
        sys.stdout.flush()
        print(dumps(obj), flush=True)
    except OSError as exc:
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        if not isinstance(exc, BrokenPipeError):
            err_line(f"batchsim: cannot write the JSON document to stdout: {exc.strerror}")
        raise SystemExit(EXIT_FAILED) from None


def int_list(text: str, hi: int | None = None) -> list[int]:
    """Comma-separated integers in 1..hi (default MAX_INT); `ints_up_to(hi)`: the argparse type."""
    hi = hi or MAX_INT
    item = bounded(int, 1, hi)
    try:
        values = [item(x) for x in text.split(",") if x.strip()]
    except argparse.ArgumentTypeError:
        values = []
    if not values:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers in 1..{hi}, "
                                         f"got {text!r}")
    return values


def ints_up_to(hi: int):
    def parse(text: str) -> list[int]:
        return int_list(text, hi)

    parse.__name__ = f"int_list_up_to_{hi}"
    return parse


def str_list(text: str) -> list[str]:
    return [x.strip() for x in text.split(",") if x.strip()]


MAX_INT = 2**31 - 1  # counts, lengths, steps: beyond this MLX's int32 and numpy overflow
MAX_BATCH = 4096  # sequences one batch of bench-decode or sweep holds: beyond, gigabytes of ids
MAX_FLOAT = 1e9  # seconds, factors, GiB: beyond this a flag is a typo, and float math overflows


def bounded(kind: type, lo: float, hi: float, *, lo_open: bool = False):
    """An argparse type: `kind` (int or float) in [lo, hi] (lo excluded if `lo_open`); nan, inf
    and anything outside is one line that says the bounds."""
    noun = "an integer" if kind is int else "a number"
    show = str if kind is int else (lambda x: f"{x:.15g}")
    rule = f"{'>' if lo_open else '>='} {show(lo)} and <= {show(hi)}"
    if kind is int and (lo, lo_open) == (1, False):
        noun, rule = "a positive integer", f"<= {hi}"
    elif kind is float and (lo, lo_open) == (0, True):
        noun, rule = "a positive finite number", f"<= {show(hi)}"

    def parse(text: str):
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected {noun}, got {text!r}") from None
        if not ((lo < value) if lo_open else (lo <= value)) or not value <= hi:  # nan fails too
            raise argparse.ArgumentTypeError(f"expected {noun} {rule}, got {text!r}")
        return value

    parse.__name__ = f"{kind.__name__}_in_{lo:g}_{hi:g}"
    return parse


positive_int = bounded(int, 1, MAX_INT)
non_negative_int = bounded(int, 0, MAX_INT)
seed_int = bounded(int, 0, 2**32 - 1)  # numpy's seeds
positive_float = bounded(float, 0, MAX_FLOAT, lo_open=True)
non_negative_float = bounded(float, 0, MAX_FLOAT)
port_int = bounded(int, 0, 65535)


def add_rank_arguments(p: argparse.ArgumentParser, what: str, roles: str) -> None:
    """`--ranks` and `--hostfile` of `run` and `serve`: `what` the command does, `roles` what the
    ranks do."""
    d = p.add_argument_group("ranks (tensor-parallel decode over mx.distributed)")
    d.add_argument("--ranks", type=positive_int, default=1, help=f"{what} on N ranks started by "
                   f"mlx.launch (ring backend on loopback unless --hostfile); {roles}")
    d.add_argument("--hostfile",
                   help=f"mlx.launch hostfile (JSON: hosts with ssh and ips) to {what} "
                   "across Macs; the same batchsim and model path on every host")


def field_default(source: Any, name: str) -> Any:
    """A dataclass field's default: the value on an instance, or the class's declared default."""
    if not isinstance(source, type):
        return getattr(source, name)
    field = {f.name: f for f in dataclasses.fields(source)}[name]
    if field.default_factory is not dataclasses.MISSING:
        return field.default_factory()
    if field.default is dataclasses.MISSING:
        raise ValueError(f"{source.__name__}.{name} has no default")
    return field.default


def show_default(value: Any) -> str:
    """A default as a user would type it: on/off, 50,90,95,99, uniform:32:128, inf."""
    if isinstance(value, bool):
        return "on" if value else "off"
    if isinstance(value, float):
        return f"{value:g}"
    if isinstance(value, (list, tuple)):
        return ",".join(show_default(v) for v in value)
    return value.cli_form if isinstance(value, LengthSpec) else str(value)


def _type_kwargs(hint: Any) -> dict[str, Any]:
    """argparse type/choices from a field's annotation (`X | None` read as X)."""
    if typing.get_origin(hint) in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(hint) if a is not type(None)]
        hint = args[0] if len(args) == 1 else hint
    if typing.get_origin(hint) is typing.Literal:
        return {"choices": list(typing.get_args(hint))}
    bounded_types = {int: positive_int, float: positive_float}
    return {"type": bounded_types[hint]} if hint in bounded_types else {}


def add_field_argument(group: Any, source: Any, name: str, help: str, *, flag: str | None = None,
                       unset: bool = True, **kwargs: Any) -> argparse.Action:
    """A flag for one config field, `--field-name` unless `flag` says otherwise. Its type and
    choices come from the field's annotation and its shown `[default: X]` from `source` (a
    dataclass, or an instance whose values are the defaults). unset: the flag is None unless given
    (it overrides a config file); otherwise argparse defaults to the field's value."""
    cls = source if isinstance(source, type) else type(source)
    if "type" not in kwargs and "action" not in kwargs:
        kwargs = {**_type_kwargs(type_hints(cls)[name]), **kwargs}
        kwargs["type"] = seed_int if name == "seed" else kwargs.get("type")
    default = field_default(source, name)
    shown = "" if default is None else f"[default: {show_default(default)}]".replace("%", "%%")
    return group.add_argument(flag or f"--{name.replace('_', '-')}",
                              default=None if unset else default,
                              help=" ".join(t for t in (help, shown) if t), **kwargs)


# --dtype's help wherever a command takes it (RunConfig's `auto`).
DTYPE_HELP = "auto: float32 on the CPU backend (the only dtype using BLAS), float16 on GPUs"
QUANTIZE_HELP = ("4- or 8-bit weights (zoo models; default: unquantized, in --dtype; a model "
                 "directory or hub id: as stored)")


def table(title: str, columns: Sequence[str], rows: Iterable[Sequence[Any]],
          width: int | None = None, keep: Sequence[str] = ()) -> Table:
    """A table whose cells are never cut: columns that do not fit `width` (the terminal's) whole
    are left out and named in its caption (--json has them all); they are seated first the
    `keep` ones, then the rest from the left."""
    rows = [list(r) for r in rows]
    order = [*keep, *(c for c in columns if c not in keep)]
    t, dropped = fitted_table(title, columns, rows, order, width or out.width)
    if dropped:
        t.caption = (f"left out at {width or out.width} columns: {', '.join(dropped)} "
                     "(a wider terminal or --json shows them)")
        t.caption_justify = "left"
    return t


def _plain_table(title: str, columns: Sequence[str], cells: Sequence[Sequence[str]],
                 widths: Sequence[int] | None) -> Table:
    t = Table(title=title, title_justify="left", header_style="bold")
    for i, c in enumerate(columns):
        left = c in ("mode", "model", "chip", "dtype", "metric", "id", "fold", "engine")
        t.add_column(c, justify="left" if left else "right", width=widths and widths[i],
                     overflow="fold")  # never "…", on a console narrower than `width` too
    for row in cells:
        t.add_row(*row)
    return t


def fitted_table(title: str, columns: Sequence[str], rows: Sequence[Sequence[Any]],
                 keep: Sequence[str], width: int) -> tuple[Table, list[str]]:
    """A table of the columns that fit `width` with every cell whole (headers wrap at spaces),
    taken in the order of `keep` (the first always), shown in their own order; and the columns
    left out."""
    cells = [[fmt(v) for v in row] for row in rows]
    text = {c: max([*map(len, c.split()), *(len(r[i]) for r in cells)], default=1)
            for i, c in enumerate(columns)}
    shown, used = set(), 1  # a column costs its text, two spaces of padding and a border
    for c in keep:
        if not shown or used + text[c] + 3 <= width:
            shown.add(c)
            used += text[c] + 3
    index = [i for i, c in enumerate(columns) if c in shown]
    natural = 1 + sum(max(len(columns[i]), text[columns[i]]) + 3 for i in index)
    widths = [text[columns[i]] for i in index] if natural > width else None  # headers wrap
    t = _plain_table(title, [columns[i] for i in index], [[r[i] for i in index] for r in cells],
                     widths)
    t.columns[0].no_wrap = True
    return t, [c for c in columns if c not in shown]


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
    if isinstance(value, int) and abs(value) >= 1_000:  # as floats: 2,626 beside 4,658
        return f"{value:,}"
    return str(value)


def gib(nbytes: float | None) -> float | None:
    return None if nbytes is None else nbytes / (1 << 30)


def gib_text(nbytes: float) -> str:
    """Bytes as `run` and `serve` print a budget: in GiB, as the summary table's cells (fmt)."""
    return f"{fmt(gib(nbytes))} GiB"


def median(values: Sequence[float]) -> float:
    s = sorted(values)
    n = len(s)
    if not n:
        return float("nan")
    return s[n // 2] if n % 2 else (s[n // 2 - 1] + s[n // 2]) / 2
