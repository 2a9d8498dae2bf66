"""Prompts that start in the same step with chunks of one length prefill together: one forward
pass over a batch of fresh private caches, which are then split into one cache per request (the
same mlx-lm class and bookkeeping, holding that request's row), exactly what each request would
hold had it prefilled alone. Equal lengths need no padding, so every cache kind batches this way
(a linear-attention state or a sliding ring would be corrupted by pad tokens). Each matrix is read
once for the group, and a layer's per-call cost (the gated-delta recurrence runs its prompt token
by token on the CPU) is paid once instead of once per request."""

from __future__ import annotations

import copy

import mlx.core as mx
from batchsim.scheduler.plan import PrefillChunk


def groups(chunks: list[PrefillChunk], fresh: set[int]) -> list[list[PrefillChunk]]:
    """Chunks in plan order, fresh ones (first chunk, no cache yet) of one length and one `sample`
    flag gathered into the group of their first member; every other chunk alone."""
    out: list[list[PrefillChunk]] = []
    by_key: dict[tuple[int, bool], list[PrefillChunk]] = {}
    for c in chunks:
        if c.request_id not in fresh:
            out.append([c])
            continue
        key = (c.num_tokens, c.sample)
        if key not in by_key:
            by_key[key] = []
            out.append(by_key[key])
        by_key[key].append(c)
    return out


def split_rows(caches: list, rows: int) -> list[list]:
    """Per row of a batch of `rows`, the layer caches holding that row alone."""
    return [[_row_of(c, i, rows) for c in caches] for i in range(rows)]


def _row_of(cache, i: int, rows: int):
    out = copy.copy(cache)
    for name, value in vars(cache).items():
        setattr(out, name, _take(value, i, rows))
    return out


def _take(value, i: int, rows: int):
    if isinstance(value, mx.array) and value.ndim and value.shape[0] == rows:
        return mx.contiguous(value[i : i + 1])
    if isinstance(value, (list, tuple)):
        return type(value)(_take(v, i, rows) for v in value)
    return value
