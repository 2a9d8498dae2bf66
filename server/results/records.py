"""A run's records: RequestRecord (one request's timeline) and StepRecord (one engine step), with
their JSON rows. Without numpy: the records' writer process (record_process.py) imports them and
starts on the run's second core, beside the drawing child (metrics.py, the summary, has numpy)."""

from __future__ import annotations

import dataclasses
import functools
import itertools
from collections.abc import Mapping
from typing import Any

REQUEST_STATUSES = ("finished", "rejected", "aborted", "unfinished")
MS_PER_S = 1000.0
DERIVED_MS_KEYS = ("ttft_ms", "tpot_ms", "e2el_ms", "queue_ms")  # a request line's, after fields


# Not frozen (as StepRecord): a run builds one a request as it leaves, and a frozen one took 1.2 us
# to build, not 0.3 (16 ms of the simulated hour's loop).
@dataclasses.dataclass(slots=True)
class RequestRecord:
    """One request's timeline; times are seconds on the run's clock (0 = start of the run)."""

    request_id: int
    status: str  # one of REQUEST_STATUSES; "unfinished": still in flight when the run stopped
    arrival_s: float  # when the client sent it (vLLM's start_time)
    first_scheduled_s: float | None  # first step that ran it (a preemption does not reset it)
    token_times_s: tuple[float, ...]  # emission time of each output token, in order
    finished_s: float | None  # when it left the engine (finished, rejected or aborted)
    num_prompt_tokens: int
    num_output_tokens: int
    num_preemptions: int = 0
    finish_reason: str | None = None

    def __post_init__(self) -> None:
        if self.status not in REQUEST_STATUSES:
            raise ValueError(f"request {self.request_id}: status {self.status!r} "
                             f"not in {REQUEST_STATUSES}")
        if len(self.token_times_s) != self.num_output_tokens:
            raise ValueError(f"request {self.request_id}: {len(self.token_times_s)} token times "
                             f"for {self.num_output_tokens} output tokens")
        if self.status == "finished" and not self.token_times_s:
            raise ValueError(f"request {self.request_id}: finished without an output token")

    @property
    def ttft_s(self) -> float | None:
        """Arrival to first token, queueing and prefill included (vLLM's TTFT)."""
        return self.token_times_s[0] - self.arrival_s if self.token_times_s else None

    @property
    def e2el_s(self) -> float | None:
        """Arrival to the end of the response; the last token's time when finished_s is unknown."""
        if self.finished_s is not None:
            return self.finished_s - self.arrival_s
        return self.token_times_s[-1] - self.arrival_s if self.token_times_s else None

    @property
    def tpot_s(self) -> float | None:
        """(E2EL - TTFT) / (output tokens - 1); None below 2 tokens (vLLM leaves it out)."""
        ttft, e2el = self.ttft_s, self.e2el_s
        if self.num_output_tokens < 2 or ttft is None or e2el is None:
            return None
        return (e2el - ttft) / (self.num_output_tokens - 1)

    @property
    def itls_s(self) -> tuple[float, ...]:
        """Gaps between consecutive tokens; a preemption shows up as one long gap."""
        return tuple(b - a for a, b in itertools.pairwise(self.token_times_s))

    @property
    def queue_s(self) -> float | None:
        return None if self.first_scheduled_s is None else self.first_scheduled_s - self.arrival_s

    def derived_ms(self) -> tuple[float | None, ...]:
        """The values of DERIVED_MS_KEYS, as a record's line carries them after its fields."""
        return tuple(None if v is None else v * MS_PER_S
                     for v in (self.ttft_s, self.tpot_s, self.e2el_s, self.queue_s))

    def to_json(self) -> dict[str, Any]:
        row = {name: getattr(self, name) for name in field_names(type(self))}
        row["token_times_s"] = list(self.token_times_s)
        row.update(zip(DERIVED_MS_KEYS, self.derived_ms()))
        return row  # ITLs are the differences of token_times_s (not stored twice)

    @classmethod
    def from_json(cls, row: Mapping[str, Any]) -> RequestRecord:
        return _from_row(cls, {**row, "token_times_s": tuple(row.get("token_times_s", ()))})


@dataclasses.dataclass(slots=True)  # not frozen: one is built per plan, and freezing costs 5x
class StepRecord:
    """One engine step, or `num_steps` identical pure-decode steps run back to back. The counters
    batch_size and num_prefill_* are per step; the rest describe the record as a whole."""

    step_index: int
    start_s: float
    end_s: float  # end of the record's last step
    num_steps: int  # >= 1
    batch_size: int  # requests decoded in one forward pass
    num_prefill_tokens: int  # prompt (or recompute) tokens computed in the step
    num_prefill_requests: int
    num_running: int  # after the record
    num_waiting: int
    kv_bytes: int  # scheduler's account after the record
    kv_bytes_measured: int | None  # what the executor counted from its arrays; None: not measured
    pool_rows: int
    pool_capacity_tokens: int
    num_preemptions: int  # decided when the record's plan was made
    # Seconds the executor itself spent (its own clock); the rest of end_s - start_s is the engine
    # handing the step to the executor thread and back. Predicted, not measured, in simulation.
    compute_s: float | None = None
    # Requests the record's plan admitted from the queue, new or back from a preemption (None:
    # records written before the field; timeline.admitted_per_step counts them from requests).
    num_admitted: int | None = None

    def __post_init__(self) -> None:
        if self.num_steps < 1:
            raise ValueError(f"step {self.step_index}: num_steps must be >= 1, "
                             f"got {self.num_steps}")
        if self.end_s < self.start_s:
            raise ValueError(f"step {self.step_index}: ends at {self.end_s} before it starts")

    @property
    def duration_s(self) -> float:
        return self.end_s - self.start_s

    def to_json(self) -> dict[str, Any]:
        return {name: getattr(self, name) for name in field_names(type(self))}

    @classmethod
    def from_json(cls, row: Mapping[str, Any]) -> StepRecord:
        return _from_row(cls, row)


@functools.cache
def field_names(cls: type) -> tuple[str, ...]:
    return tuple(f.name for f in dataclasses.fields(cls))  # once: runs write a row per step


def _from_row(cls: Any, row: Mapping[str, Any]) -> Any:
    """Build a record from a JSONL row; derived keys (ttft_ms, ...) are ignored."""
    kwargs = {}
    for f in dataclasses.fields(cls):
        if f.name in row:
            kwargs[f.name] = row[f.name]
        elif f.default is dataclasses.MISSING:
            raise ValueError(f"{cls.__name__}: row has no {f.name!r}")
    return cls(**kwargs)
