"""Record lines, byte for byte as `jsonio.dumps(record.to_json())` writes them, made cheaply.
steps.jsonl: a %-template over the record's values, without a dict per step (a simulated hour
writes 30,000 of them). requests.jsonl: the token times, most of each line and each shared by a
whole batch, written once per step end time. A value the fast way cannot write exactly as JSON (a
bool, a non-finite float, a numpy scalar) sends its record the ordinary way."""

from __future__ import annotations

import dataclasses
import itertools
import operator
from collections.abc import Sequence

from batchsim.server.results.jsonio import dumps
from batchsim.server.results.metrics import RequestRecord, StepRecord

_NUMBERS = frozenset({int, float})  # str() of these is their JSON (float: the shortest repr)
_NUMBERS_OR_NONE = _NUMBERS | {type(None)}


class StepLines:
    def __init__(self) -> None:
        names = tuple(f.name for f in dataclasses.fields(StepRecord))
        assert not any("inf" in n or "nan" in n for n in names)  # lines are checked for these
        self._values = operator.attrgetter(*names)
        self._template = "{" + ",".join(f'"{n}":%s' for n in names) + "}\n"

    def __call__(self, step: StepRecord) -> str:
        values = self._values(step)
        types = set(map(type, values))
        if not types <= _NUMBERS:
            if not types <= _NUMBERS_OR_NONE:
                return dumps(step.to_json()) + "\n"
            values = tuple(["null" if v is None else v for v in values])
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


_NO_TIMES = '"token_times_s":[]'


def request_line(record: RequestRecord, token_times_text: str | None) -> str:
    """`record`'s line; `token_times_text`: its token times as TokenTimesText wrote them."""
    row = record.to_json()
    if token_times_text is None or "n" in token_times_text:  # nan, inf: the ordinary way
        return dumps(row) + "\n"
    row["token_times_s"] = []
    line = dumps(row)  # keys and strings come escaped: the empty list's text is found only once
    return line.replace(_NO_TIMES, f'"token_times_s":[{token_times_text}]', 1) + "\n"
