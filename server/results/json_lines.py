"""Record lines, byte for byte as `jsonio.dumps(record.to_json())` writes them, made cheaply.
steps.jsonl: a %-template over the record's values, without a dict per step (a simulated hour
writes 30,000 of them). requests.jsonl: the token times, most of each line and each shared by a
whole batch, written once per step end time. A value the fast way cannot write exactly as JSON (a
bool, a non-finite float, a numpy scalar) sends its record the ordinary way."""

from __future__ import annotations

import dataclasses
import itertools
import math
import operator
import re
from collections.abc import Sequence

from batchsim.server.results.jsonio import dumps
from batchsim.server.results.metrics import DERIVED_MS_KEYS, RequestRecord, StepRecord

_NUMBERS = frozenset({int, float})  # str() of these is their JSON (float: the shortest repr)
_NUMBERS_OR_NONE = _NUMBERS | {type(None)}


class StepLines:
    """steps.jsonl's lines. With `end_texts` (the run's step end times as TokenTimesText writes
    them), a line's start_s and end_s, which are step end times, take their text from there."""

    def __init__(self, end_texts: TokenTimesText | None = None) -> None:
        names = tuple(f.name for f in dataclasses.fields(StepRecord))
        assert not any("inf" in n or "nan" in n for n in names)  # lines are checked for these
        assert names[1:3] == ("start_s", "end_s")  # the values end_texts may write
        self._values = operator.attrgetter(*names)
        self._template = "{" + ",".join(f'"{n}":%s' for n in names) + "}\n"
        self.end_texts = end_texts

    def __call__(self, step: StepRecord) -> str:
        values = self._values(step)
        types = set(map(type, values))
        if not types <= _NUMBERS:
            if not types <= _NUMBERS_OR_NONE:
                return dumps(step.to_json()) + "\n"
            values = tuple(["null" if v is None else v for v in values])
        texts = self.end_texts
        if texts is not None:  # the step before's end and this record's last step's end
            i = values[0]
            values = (i, *texts.texts_of(values[1], i - 1, values[2], i + values[3] - 1),
                      *values[3:])
        line = self._template % values
        if "inf" in line or "nan" in line:  # str() of a non-finite float
            return dumps(step.to_json()) + "\n"
        return line


class TokenTimesText:
    """The JSON text of a request's token times, which are step end times (the recorder's growing
    list) over [first, end) runs of step indices. Each end time is written once (json writes a
    float as float.__repr__ does); None where one is not a float (the caller writes it the
    ordinary way)."""

    def __init__(self, step_end_s: list[float]) -> None:
        self._ends = step_end_s
        self._texts: list[str | None] = []  # by step index, made as the ends come

    def __call__(self, runs: Sequence[Sequence[int]]) -> str | None:
        texts, ends = self._texts, self._ends
        if len(texts) < len(ends):
            new = ends[len(texts):]
            try:
                texts.extend(list(map(float.__repr__, new)))
            except TypeError:  # an int or another type: its own lines go the ordinary way
                texts.extend(float.__repr__(t) if isinstance(t, float) else None for t in new)
        try:
            return ",".join(itertools.chain.from_iterable(texts[a:b] for a, b in runs))
        except TypeError:
            return None

    def texts_of(self, a: object, i: int, b: object, j: int) -> tuple[object, object]:
        """json's texts of `a` and `b` where each is a float equal to step end time i (j), as
        that end's text (written once); else the value itself. 0.0 is not looked up: -0.0 equals
        it. Two at once: a line has two (one call, not two, per line)."""
        ends, texts = self._ends, self._texts
        if len(texts) < len(ends):
            self([])  # texts up to the last end
        n = len(texts)
        if type(a) is float and a and 0 <= i < n and ends[i] == a:
            a = texts[i] or a
        if type(b) is float and b and 0 <= j < n and ends[j] == b:
            b = texts[j] or b
        return a, b


_NO_TIMES = '"token_times_s":[]'
_REQUEST_FIELDS = tuple(f.name for f in dataclasses.fields(RequestRecord))
_TIMES_AT = _REQUEST_FIELDS.index("token_times_s")
_REQUEST_VALUES = operator.attrgetter(*(n for n in _REQUEST_FIELDS if n != "token_times_s"))
_REQUEST_TEMPLATE = "{" + ",".join(
    [f'"{n}":[%s]' if n == "token_times_s" else f'"{n}":%s' for n in _REQUEST_FIELDS]
    + [f'"{n}":%s' for n in DERIVED_MS_KEYS]) + "}\n"
_AS_IS = re.compile(r'[ !#-\[\]-~]*')  # printable ASCII but " and \: json writes it unescaped


def request_line(record: RequestRecord, token_times_text: str | None,
                 known: tuple[object, object] | None = None) -> str:
    """`record`'s line; `token_times_text`: its token times as TokenTimesText wrote them; `known`:
    request_known's texts of first_scheduled_s and finished_s (a str: its text, already written)."""
    if token_times_text is None or "n" in token_times_text:  # nan, inf: the ordinary way
        return dumps(record.to_json()) + "\n"
    values = _REQUEST_VALUES(record)
    first = last = None
    if known is not None:  # not written again (None's text stands in until they are put in)
        first, last = known
        first, last = first if type(first) is str else None, last if type(last) is str else None
        values = (*values[:_FIRST_SCHEDULED_AT], None if first else values[_FIRST_SCHEDULED_AT],
                  None if last else values[_FINISHED_AT], *values[_FINISHED_AT + 1:])
    texts = list(map(_json_text, (*values, *record.derived_ms())))
    if None not in texts:  # every value an int, a finite float, None or a plain string
        if first:
            texts[_FIRST_SCHEDULED_AT] = first
        if last:
            texts[_FINISHED_AT] = last
        texts.insert(_TIMES_AT, token_times_text)
        return _REQUEST_TEMPLATE % tuple(texts)
    row = record.to_json()
    row["token_times_s"] = []
    line = dumps(row)  # keys and strings come escaped: the empty list's text is found only once
    return line.replace(_NO_TIMES, f'"token_times_s":[{token_times_text}]', 1) + "\n"


_FIRST_SCHEDULED_AT = _REQUEST_FIELDS.index("first_scheduled_s")  # in _REQUEST_VALUES: next
_FINISHED_AT = _REQUEST_FIELDS.index("finished_s") - 1  # to each other (token_times_s left out)
assert _FIRST_SCHEDULED_AT + 1 == _FINISHED_AT


def request_known(record: RequestRecord, runs: Sequence[Sequence[int]],
                  end_texts: TokenTimesText) -> tuple[object, object] | None:
    """request_line's `known` for a record whose token runs (step index ranges) are `runs`: the
    texts of its first step's start and its finish where those are step end times (the step
    before its first token's, its last token's), else their values."""
    if not runs:
        return None
    return end_texts.texts_of(record.first_scheduled_s, runs[0][0] - 1, record.finished_s,
                              runs[-1][1] - 1)


def _json_text(value: object) -> str | None:
    """json's text for an int, a finite float, None or a string it writes as it is; else None."""
    kind = type(value)
    if kind is int:
        return int.__repr__(value)  # type: ignore[arg-type]
    if kind is float:
        return float.__repr__(value) if math.isfinite(value) else None  # type: ignore[arg-type]
    if value is None:
        return "null"
    if kind is str and _AS_IS.fullmatch(value):  # type: ignore[arg-type]
        return f'"{value}"'
    return None
