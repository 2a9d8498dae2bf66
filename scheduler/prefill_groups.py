"""Prompts that start in the same step with chunks of one length prefill together: one forward
pass over a batch of fresh private caches, which the MLX executor then splits into one cache per
request (prefill_cache.split_rows), exactly what each request would hold had it prefilled alone;
the simulator prices the group as that one forward pass (StepCost.prefill_time's `rows`). Equal
lengths need no padding, so every cache kind batches this way (a linear-attention state or a
sliding ring would be corrupted by pad tokens). Each matrix is read once for the group, and a
layer's per-call cost (without Metal, the gated-delta recurrence runs its prompt token by token)
is paid once instead of once per request."""

from __future__ import annotations

from batchsim.scheduler.plan import PrefillChunk


def groups(chunks: list[PrefillChunk]) -> list[list[PrefillChunk]]:
    """Chunks in plan order, first chunks (start 0: no cache yet) of one length and one `sample`
    flag gathered into the group of their first member; every other chunk alone."""
    out: list[list[PrefillChunk]] = []
    by_key: dict[tuple[int, bool], list[PrefillChunk]] = {}
    for c in chunks:
        if c.start:
            out.append([c])
            continue
        key = (c.num_tokens, c.sample)
        if key not in by_key:
            by_key[key] = []
            out.append(by_key[key])
        by_key[key].append(c)
    return out
