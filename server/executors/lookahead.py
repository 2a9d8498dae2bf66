"""One decode step run ahead. While the engine reads step N's tokens and the scheduler plans step
N+1, the forward pass of N+1 is already computing, as mlx-lm's BatchGenerator overlaps its steps:
its rows are the pool's rows plus the requests whose prefill just sampled their first token, its
inputs the (still lazy) tokens of step N.

The next plan takes it when it decodes exactly those rows, less the ones it frees (rows that
finished at step N computed one token for nothing). Any other plan undoes it first: row lengths and
linear-attention states go back, early joins leave the pool. K/V written past a row's length are
never read (a ring slot it overwrote had left the window), so they need no undoing."""

from __future__ import annotations

from dataclasses import dataclass

import mlx.core as mx
from batchsim.scheduler.plan import StepPlan


@dataclass
class Ahead:
    row_ids: list[int]  # the pool's rows in the forward pass, aligned with `tokens`
    tokens: mx.array  # (B,) the tokens it samples, lazy until the next step reads them
    lengths: list[int]  # pool.lengths before the pass, early joins included
    joined: list[int]  # requests joined early: their private caches are held until confirmed
    states: list  # pool.states() before the pass

    def serves(self, plan: StepPlan) -> bool:
        """This plan decodes exactly the rows run ahead, less those it frees."""
        if not plan.decode_ids or len(plan.decode_ids) > len(self.row_ids):
            return False
        freed = set(plan.free_ids)
        return set(plan.decode_ids) == {r for r in self.row_ids if r not in freed}


def next_rows(pool, sampled_ids: list[int], cached_tokens: dict[int, int],
              shared: dict[int, list[int]]) -> list[int] | None:
    """Requests that join the pool for the step run ahead (those whose prefill sampled), or None
    if the pool's geometry has no room for them or for one more token per row (`shared`: the
    cached blocks each would reference)."""
    joiners = [r for r in sampled_ids if r not in pool.layout.in_pool]
    n_shared = sum(len(shared[r]) for r in joiners)
    return joiners if pool.can_step([cached_tokens[r] for r in joiners], n_shared) else None


def gather_inputs(flat: mx.array, sampled_ids: list[int], row_ids: list[int]) -> mx.array:
    """(B, 1) input tokens in pool row order, from this step's sampled tokens."""
    if row_ids == sampled_ids:
        return flat[:, None]
    where = {rid: i for i, rid in enumerate(sampled_ids)}
    return flat[mx.array([where[r] for r in row_ids])][:, None]
