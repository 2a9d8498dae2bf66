"""Speculative decoding's counters, as vLLM reports them (vllm/v1/spec_decode/metrics.py, and the
`spec_decode_*` keys of `vllm bench serve`): a draft is one row's proposal of >= 1 tokens in one
verify step; acceptance rate = accepted / drafted tokens, in percent; acceptance length = 1 +
accepted tokens per draft (the bonus token counted); per position i, the share of drafts whose
token i was accepted."""

from __future__ import annotations

from typing import Any

from batchsim.scheduler.plan import StepResult


class SpecCounts:
    __slots__ = ("accepted_per_position", "accepted_tokens", "draft_tokens", "num_drafts")

    def __init__(self) -> None:
        self.num_drafts = 0
        self.draft_tokens = 0
        self.accepted_tokens = 0
        self.accepted_per_position: list[int] = []

    def add(self, result: StepResult) -> None:
        """Count a step's drafts (nothing for a step that verified none)."""
        if result.num_drafted is None or result.accepted_ids is None:
            return
        per_position = self.accepted_per_position
        for drafted, accepted in zip(result.num_drafted, result.accepted_ids):
            if not drafted:
                continue
            self.num_drafts += 1
            self.draft_tokens += drafted
            self.accepted_tokens += len(accepted)
            if drafted > len(per_position):
                per_position.extend([0] * (drafted - len(per_position)))
            for i in range(len(accepted)):
                per_position[i] += 1

    def summary(self) -> dict[str, Any]:
        """The run summary's spec_decode_* keys."""
        drafts = self.num_drafts
        return {
            "spec_decode_acceptance_rate": (100.0 * self.accepted_tokens / self.draft_tokens
                                            if self.draft_tokens else 0.0),
            "spec_decode_acceptance_length": 1.0 + self.accepted_tokens / drafts if drafts else 1.0,
            "spec_decode_num_drafts": drafts,
            "spec_decode_draft_tokens": self.draft_tokens,
            "spec_decode_accepted_tokens": self.accepted_tokens,
            "spec_decode_per_position_acceptance_rates": [
                n / drafts for n in self.accepted_per_position] if drafts else [],
        }
