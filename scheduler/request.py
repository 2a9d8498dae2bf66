"""A request is counters, not modes: `num_computed_tokens` catches up to `num_tokens` (prompt plus
output so far). A step that brings it level samples one more token. Prefill and decode are worked
out per step from the gap; a preempted request restarts from zero computed tokens."""

from __future__ import annotations

import dataclasses
import enum
import logging
from typing import Protocol

from batchsim.scheduler.pool_geometry import PAGE_TOKENS


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"
    REJECTED = "rejected"
    ABORTED = "aborted"


# The members the scheduler's hot paths read, as module globals: in Python 3.11 an Enum class's
# attribute goes through EnumType.__getattr__'s slot (~0.4 us a read, a global ~20 ns), and a
# simulated hour reads them ~100,000 times.
WAITING, RUNNING = RequestStatus.WAITING, RequestStatus.RUNNING
FINISHED, ABORTED = RequestStatus.FINISHED, RequestStatus.ABORTED


@dataclasses.dataclass(frozen=True, slots=True)
class SamplingParams:
    """How a request samples; every field has vLLM's semantics (server/executors/sampler.py)."""

    max_tokens: int  # output tokens to generate at most
    temperature: float = 0.0  # 0: greedy
    seed: int | None = None
    ignore_eos: bool = False
    stop_token_ids: frozenset[int] = frozenset()
    top_p: float = 1.0  # keep the most likely tokens whose probabilities sum to top_p; 1: off
    top_k: int = 0  # keep the k most likely tokens; 0: off
    min_p: float = 0.0  # drop tokens below min_p x the top token's probability; 0: off
    # Logits of tokens in the prompt or output divided by it (multiplied when negative); 1: off.
    repetition_penalty: float = 1.0
    frequency_penalty: float = 0.0  # subtracted from a logit per time its token is in the output
    presence_penalty: float = 0.0  # subtracted once from a logit whose token is in the output
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, value added to its logit)
    # The argmax of the model's own logits: the sampler has nothing to do (checked per row and
    # step, so kept as a field rather than worked out each time).
    is_plain_greedy: bool = dataclasses.field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if self.max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {self.max_tokens}")
        if not (self.temperature >= 0 and 0 < self.top_p <= 1 and self.top_k >= 0
                and 0 <= self.min_p <= 1 and self.repetition_penalty > 0):
            raise ValueError("sampling out of range: temperature >= 0, 0 < top_p <= 1, top_k >= 0, "
                             f"0 <= min_p <= 1, repetition_penalty > 0; got {self}")
        object.__setattr__(self, "is_plain_greedy",
                           self.temperature == 0 and not self.adjusts_logits)

    @property
    def adjusts_logits(self) -> bool:
        """A bias or a penalty changes the logits (greedy rows too)."""
        return bool(self.logit_bias) or self.repetition_penalty != 1 or (
            self.frequency_penalty != 0 or self.presence_penalty != 0)


class StopChecker(Protocol):
    """Watches a request's output for stop strings. `batchsim serve` builds one from its streaming
    detokenizer, so the scheduler decides every stop without a tokenizer."""

    def feed(self, token_ids: list[int]) -> int | None:
        """Take a step's new tokens (called every step): None while no stop string matched;
        else how many of them the output keeps, through the one that completed it."""
        ...


@dataclasses.dataclass(slots=True, eq=False)
class Request:
    request_id: int
    num_prompt_tokens: int
    sampling: SamplingParams
    arrival_s: float
    # Token ids: None in simulation, where only counts matter.
    prompt_token_ids: list[int] | None = None
    eos_token_ids: frozenset[int] = frozenset()
    stop_checker: StopChecker | None = None  # stop strings; None: only tokens and length stop it
    # Chained hashes of the prompt's full PAGE_TOKENS blocks (scheduler/prefix_cache.py), set by
    # a workload that shares prefixes; None: worked out from prompt_token_ids, or nothing shared.
    block_hashes: tuple[int, ...] | None = None

    status: RequestStatus = RequestStatus.WAITING
    num_computed_tokens: int = 0
    num_output_tokens: int = 0
    output_token_ids: list[int] = dataclasses.field(default_factory=list)
    num_preemptions: int = 0
    num_cached_tokens: int = 0  # prompt tokens reused from the prefix cache at first admission
    finish_reason: str | None = None  # "length" | "stop" | "abort" | "error" | rejection reason

    # Timeline, in engine clock seconds and engine step indices.
    first_scheduled_s: float | None = None
    finished_s: float | None = None
    # Steps at which tokens were emitted, as [first_step, end_step) runs (compact in long
    # simulations): the scheduler extends the last run while the request samples every step.
    token_runs: list[list[int]] = dataclasses.field(default_factory=list)

    def __post_init__(self) -> None:
        if self.num_prompt_tokens < 1:
            raise ValueError(f"request {self.request_id}: prompt must have >= 1 token")
        ids = self.prompt_token_ids
        if ids is not None and len(ids) != self.num_prompt_tokens:
            raise ValueError(f"request {self.request_id}: prompt ids do not match "
                             "num_prompt_tokens")
        if self.block_hashes is not None and (
                len(self.block_hashes) * PAGE_TOKENS > self.num_prompt_tokens):
            raise ValueError(f"request {self.request_id}: {len(self.block_hashes)} block hashes "
                             f"cover more than its {self.num_prompt_tokens} prompt tokens")

    @property
    def num_tokens(self) -> int:
        return self.num_prompt_tokens + self.num_output_tokens

    @property
    def max_total_tokens(self) -> int:
        return self.num_prompt_tokens + self.sampling.max_tokens

    @property
    def is_finished(self) -> bool:
        return self.status in (RequestStatus.FINISHED, RequestStatus.REJECTED,
                               RequestStatus.ABORTED)

    def all_token_ids(self) -> list[int] | None:
        if self.prompt_token_ids is None:
            return None
        return self.prompt_token_ids + self.output_token_ids


def stop_string(r: Request, new_tokens: list[int]) -> tuple[list[int], str | None]:
    """Feed a step's tokens to the request's stop checker: the tokens kept (cut after the one
    completing a stop string, so a verify step's drafts past it are dropped) and "stop", "error"
    or None."""
    try:
        kept = r.stop_checker.feed(new_tokens)  # type: ignore[union-attr]
    except Exception:  # a failing checker ends its own request, never the engine loop
        logging.getLogger("batchsim").exception("stop checker of request %d failed", r.request_id)
        return new_tokens, "error"
    return (new_tokens, None) if kept is None else (new_tokens[:kept], "stop")


def stop_reason(r: Request, new_tokens: list[int]) -> str | None:
    """Why a step's tokens end the request (EOS, a stop token, its length); None: it goes on."""
    last_token = new_tokens[-1]
    if not r.sampling.ignore_eos and last_token in r.eos_token_ids:
        return "stop"
    if last_token in r.sampling.stop_token_ids:
        return "stop"
    if r.num_output_tokens >= r.sampling.max_tokens:
        return "length"
    return None
