"""steps.jsonl lines, byte for byte as `jsonio.dumps(step.to_json())` writes them, without a dict
per step: a %-template over the record's values (a simulated hour writes 44,000 of them). A value
the template cannot write exactly as JSON (a bool, a non-finite float, a numpy scalar) sends its
record the ordinary way."""

from __future__ import annotations

import dataclasses
import operator

from batchsim.server.results.jsonio import dumps
from batchsim.server.results.metrics import StepRecord

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
