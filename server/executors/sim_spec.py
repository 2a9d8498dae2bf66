"""Speculative decoding in the simulated executor: each decoding row drafts the K its plan allows,
and how many of them it keeps is drawn from the per-position acceptance rates at the step's batch
(server/perf/spec_acceptance.py). One uniform draw u per row keeps the drafts whose rate exceeds
u, so position i is accepted with exactly its rate and only after the ones before it; with a draft
share D < 1 a row first drafts at all with chance D (else it verifies nothing this step). Draws
are deterministic per seed. Accepted tokens are placeholders (simulated tokens are not tokens): only
their count is read. `drafter` is what drafting costs (spec_price.draft_s: a draft model over
every row it holds, as the real drafter's pool drafts them, the n-gram drafter over the rows
asking), and a draft model's catch-up on each row the first time it asks for drafts
(spec_price.catch_up_s: the rows it holds, as the real drafter's pool does, until they leave)."""

from __future__ import annotations

import random

from batchsim.server.perf.spec_acceptance import Acceptance
from batchsim.server.perf.spec_price import NGRAM, Drafter, catch_up_s

_KEPT = tuple((0,) * n for n in range(65))  # accepted placeholders by count


class SpecDraws:
    def __init__(self, acceptance: Acceptance, seed: int, drafter: Drafter = NGRAM):
        self.acceptance = acceptance
        self.drafter = drafter
        self._random = random.Random(seed).random
        self._rates: dict[tuple[int, int], list[float]] = {}  # (K, batch) -> rates
        self._held: set[int] = set()  # request ids a draft model holds (caught up on)

    def draw(self, spec_tokens: tuple[int, ...], num_sampled: int
             ) -> tuple[tuple[tuple[int, ...], ...], tuple[int, ...]]:
        """(accepted placeholders, drafted count) per sampled row: the decode rows (their
        `spec_tokens`), then sampling prefills (none drafted)."""
        batch, share, rand = len(spec_tokens), self.acceptance.draft_share, self._random
        accepted: list[tuple[int, ...]] = []
        drafted = list(spec_tokens)
        for i, k in enumerate(spec_tokens):
            n = 0
            if k and share < 1.0 and rand() >= share:
                drafted[i] = 0  # no draft this step
            elif k:
                rates = self._rates_at(k, batch)
                u = rand()
                while n < k and rates[n] > u:
                    n += 1
            accepted.append(_KEPT[n])
        extra = num_sampled - batch
        return (*accepted, *((),) * extra), (*drafted, *(0,) * extra)

    def _rates_at(self, k: int, batch: int) -> list[float]:
        rates = self._rates.get((k, batch))
        if rates is None:
            rates = self._rates[k, batch] = self.acceptance.position_rates(k, batch)
        return rates

    def catch_up_s(self, ids: tuple[int, ...], asked: tuple[int, ...],
                   positions: tuple[int, ...]) -> float:
        """A draft model's prefill of the rows asking for drafts it does not hold yet: each row's
        `positions` tokens (its context but the last token); the n-gram drafter: 0."""
        if self.drafter.cost is None:
            return 0.0
        held = self._held
        new = [(rid, n) for rid, k, n in zip(ids, asked, positions) if k and rid not in held]
        held.update(rid for rid, _ in new)
        return catch_up_s(self.drafter, (n for _, n in new))

    def drafting_rows(self, asked: tuple[int, ...]) -> int:
        """Rows the drafter drafts for in a step where the decode rows ask `asked` (after
        catch_up_s): a draft model every row it holds, at the step's largest K (draft_model.py
        drafts its whole pool, asking or not); the n-gram drafter only the rows asking."""
        if self.drafter.cost is None:
            return len(asked) - asked.count(0)
        return len(self._held)

    def forget(self, ids) -> None:
        """These requests left: a draft model drops their rows."""
        if self._held:
            self._held.difference_update(ids)
