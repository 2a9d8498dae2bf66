"""Record lines, byte for byte as `json_text.dumps(record.to_json())` writes them, made cheaply.
steps.jsonl: a %-template over the record's values, without a dict per step (a simulated hour
writes 30,000 of them). requests.jsonl: the token times, most of each line and each shared by a
whole batch, written once per step end time. A value the fast way cannot write exactly as JSON (a
bool, a non-finite float, a numpy scalar) sends its record the ordinary way."""

from __future__ import annotations

import itertools
import math
import operator
import re
import threading
from collections.abc import Mapping, Sequence

from batchsim.server.results.json_text import dumps
from batchsim.server.results.records import (
    DERIVED_MS_KEYS,
    RequestRecord,
    StepRecord,
    field_names,
)

_NUMBERS = frozenset({int, float})  # str() of these is their JSON (float: the shortest repr)
_NUMBERS_OR_NONE = _NUMBERS | {type(None)}
_STEP_FIELDS = field_names(StepRecord)


def _non_finite_in(text: str) -> bool:
    """Whether `text` may hold str() of a non-finite float ("inf", "-inf", "nan"): a record's
    template text, or the text of float values (a float's repr has an "n" only in those)."""
    return "inf" in text or "nan" in text


def run_items(items: Sequence, runs: Sequence[Sequence[int]]) -> Sequence:
    """items[a:b] for each [a, b) of `runs`, in one sequence (a slice for one run: most
    requests, never preempted)."""
    if len(runs) == 1:
        (a, b), = runs
        return items[a:b]
    return list(itertools.chain.from_iterable(items[a:b] for a, b in runs))


assert not any(map(_non_finite_in, _STEP_FIELDS))  # lines are checked for these
STEP_VALUES = operator.attrgetter(*_STEP_FIELDS)
_STEP_TEMPLATE = "{" + ",".join(f'"{n}":%s' for n in _STEP_FIELDS) + "}\n"
_KNOWN_STEP_AT = (_STEP_FIELDS.index("start_s"), _STEP_FIELDS.index("end_s"))  # step ends, most
_NONE_KNOWN: Mapping[float, str] = {}


def step_lines(steps: Sequence[StepRecord], known: Mapping[float, str] = _NONE_KNOWN) -> str:
    """steps.jsonl's lines of `steps`; `known` as step_row_lines takes it."""
    return step_row_lines(step_rows_of(steps), known)


def step_rows_of(steps: Sequence[StepRecord]) -> list[tuple]:
    """The steps' rows (STEP_VALUES of each), as step_row_lines and RecordWriter take them."""
    return list(map(STEP_VALUES, steps))


def step_row_lines(rows: Sequence[tuple], known: Mapping[float, str] = _NONE_KNOWN) -> str:
    """steps.jsonl's lines of steps given as rows (STEP_VALUES of each): every value of the batch
    put in one template at once when all are ints and finite floats (no Python per step), else
    line by line. `known`: texts of nonzero floats (TokenTimesText.known: the step ends), for
    start_s and end_s."""
    values = list(itertools.chain.from_iterable(rows))
    if not (set(map(type, values)) <= _NUMBERS and _finite(values)):
        return "".join(step_line(StepRecord(*row)) for row in rows)
    n = len(_STEP_FIELDS)
    for at in _KNOWN_STEP_AT:
        column = values[at::n]
        if set(map(type, column)) == {float}:  # an int equal to a float key is not its text
            values[at::n] = list(map(known.get, column, column))
    return (_STEP_TEMPLATE * len(rows)) % tuple(values)


def _finite(values: list) -> bool:
    try:
        return all(map(math.isfinite, values))
    except OverflowError:  # an int too large for a float: json writes it, the slow way checks
        return False


def step_line(step: StepRecord) -> str:
    values = STEP_VALUES(step)
    types = set(map(type, values))
    if not types <= _NUMBERS:
        if not types <= _NUMBERS_OR_NONE:
            return dumps(step.to_json()) + "\n"
        values = tuple(["null" if v is None else v for v in values])
    line = _STEP_TEMPLATE % values
    if _non_finite_in(line):
        return dumps(step.to_json()) + "\n"
    return line


class TokenTimesText:
    """The JSON text of a request's token times, which are step end times (the recorder's growing
    list) over [first, end) runs of step indices. Each end time is written once (json writes a
    float as float.__repr__ does); None where one is not a finite float (the caller writes it the
    ordinary way). `known()`: the end times' texts by value, for other values equal to one: those
    made since it was last cleared (at MAX_KNOWN_ENDS: a miss writes the value's repr, the same
    text). Its callers (RecordWriter.write_batch, under RecordStream's lock, or the single-threaded
    writer process) already serialize it; the lock keeps each end extended once should two threads
    ever call it (tests/test_json_lines.py holds it to that)."""

    def __init__(self, step_end_s: list[float]) -> None:
        self._ends = step_end_s
        self._texts: list[str | None] = []  # by step index, made as the ends come
        self._known: dict[float, str] = {}  # by value: nonzero floats (-0.0 == 0.0, other text)
        self._lock = threading.Lock()

    def __call__(self, runs: Sequence[Sequence[int]]) -> str | None:
        texts = self._texts
        if len(texts) < len(self._ends):
            self._extend()
        try:
            return ",".join(run_items(texts, runs))
        except TypeError:
            return None

    def known(self) -> Mapping[float, str]:
        if len(self._texts) < len(self._ends):
            self._extend()
        return self._known

    def _extend(self) -> None:
        with self._lock:
            self._extend_texts(self._ends[len(self._texts):])

    def _extend_texts(self, new: list[float]) -> None:
        texts, known = self._texts, self._known
        if len(known) >= MAX_KNOWN_ENDS:  # a long run's: the latest ends only
            known.clear()
        try:
            made = list(map(float.__repr__, new))
        except TypeError:  # an int or another type: its own lines go the ordinary way
            texts.extend(float.__repr__(t) if type(t) is float and math.isfinite(t) else None
                         for t in new)
            return
        if not _non_finite_in("".join(made)):
            known.update(zip(new, made))
        else:  # their requests' lines go the ordinary way
            made = [None if _non_finite_in(t) else t for t in made]  # type: ignore[misc]
            known.update((t, m) for t, m in zip(new, made) if m is not None)
        texts.extend(made)
        known.pop(0.0, None)


MAX_KNOWN_ENDS = 4096  # step ends' texts kept by value (a flush's records' are mostly recent)
_NO_TIMES = '"token_times_s":[]'
_REQUEST_FIELDS = field_names(RequestRecord)
assert not any(map(_non_finite_in, (*_REQUEST_FIELDS, *DERIVED_MS_KEYS)))
_TEXT_FIELDS = ("status", "finish_reason")  # strings: in the template (a few distinct ones)
_NUMBER_FIELDS = tuple(n for n in _REQUEST_FIELDS if n not in (*_TEXT_FIELDS, "token_times_s"))
_NUMBER_VALUES = operator.attrgetter(*_NUMBER_FIELDS)
_TIMES_AT = _NUMBER_FIELDS.index("finished_s")  # numbers before the token times, after them
_FIRST_AT = _NUMBER_FIELDS.index("first_scheduled_s")  # often a step end (known) too
_AS_IS = re.compile(r'[ !#-\[\]-~]*')  # printable ASCII but " and \: json writes it unescaped
# (status, finish_reason) -> the templates before and after the token times ((None, None): one
# json escapes, or with "inf" or "nan" in it, which the line's check would take for a number)
_templates: dict[tuple[object, object], tuple[str, str] | tuple[None, None]] = {}
MAX_TEMPLATES = 256  # then start over: a long process's one-off reasons (a refusal's sizes)


def request_line(record: RequestRecord, token_times_text: str | None,
                 known: Mapping[float, str] = _NONE_KNOWN) -> str:
    """`record`'s line; `token_times_text`: its token times as TokenTimesText wrote them; `known`:
    texts of nonzero floats (TokenTimesText.known) for first_scheduled_s and finished_s."""
    if token_times_text is None:  # an end time json writes its own way: the ordinary way
        return dumps(record.to_json()) + "\n"
    strings = (record.status, record.finish_reason)
    before, after = _templates.get(strings) or _request_templates(strings)
    values = (*_NUMBER_VALUES(record), *record.derived_ms())
    if before is not None and set(map(type, values)) <= _NUMBERS_OR_NONE:
        texts = ["null" if v is None else v for v in values]
        first, last = texts[_FIRST_AT], texts[_TIMES_AT]
        if type(first) is float:
            texts[_FIRST_AT] = known.get(first, first)
        if type(last) is float:
            texts[_TIMES_AT] = known.get(last, last)
        head, tail = before % tuple(texts[:_TIMES_AT]), after % tuple(texts[_TIMES_AT:])
        if not _non_finite_in(head + tail):
            return f"{head}{token_times_text}{tail}"
    row = record.to_json()
    row["token_times_s"] = []
    line = dumps(row)  # keys and strings come escaped: the empty list's text is found only once
    return line.replace(_NO_TIMES, f'"token_times_s":[{token_times_text}]', 1) + "\n"


def _request_templates(strings: tuple[object, object]) -> tuple[str, str] | tuple[None, None]:
    texts = {n: _json_text(v) for n, v in zip(_TEXT_FIELDS, strings)}
    if any(t is None or _non_finite_in(t) for t in texts.values()):
        made: tuple[str, str] | tuple[None, None] = (None, None)
    else:
        names = (*_REQUEST_FIELDS, *DERIVED_MS_KEYS)
        line = "{" + ",".join(f'"{n}":{texts.get(n, "%s")}' for n in names) + "}\n"
        before, after = line.split('"token_times_s":%s')
        made = (before + '"token_times_s":[', "]" + after)
    if len(_templates) >= MAX_TEMPLATES:
        _templates.clear()
    _templates[strings] = made
    return made


def _json_text(value: object) -> str | None:
    """A template's text of what json writes for None or a string it writes as it is (% doubled);
    else None."""
    if value is None:
        return "null"
    if type(value) is str and _AS_IS.fullmatch(value):  # type: ignore[arg-type]
        return '"' + value.replace("%", "%%") + '"'
    return None
