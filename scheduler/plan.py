"""The two messages between scheduler and executor: what to run this step, and what came of it.
Named tuples: immutable, and several are built per step, where frozen dataclasses cost 5x more."""

from __future__ import annotations

from typing import NamedTuple

from batchsim.scheduler.pool_geometry import PoolGeometry
from batchsim.scheduler.request import SamplingParams

# made(cls, values) is cls(*values) for a named tuple given every field in order, without the
# Python-level __new__ that namedtuple generates (a frame per message, several a plan). It checks
# no count: a value left out gives a short tuple, not a default (tests/test_review_r4.py checks a
# run's). The one spelling of it (here, kv_bytes.PrivateCache, pool_rows.RowMoves).
made = tuple.__new__


class NewRequest(NamedTuple):
    """A request the executor has not seen (or must rebuild after preemption)."""

    request_id: int
    token_ids: tuple[int, ...] | None  # prompt + output so far; None in simulation
    sampling: SamplingParams
    num_prompt_tokens: int = 0  # token_ids before it are the prompt (penalties tell them apart)
    # Cached prefix blocks (prefix_cache.py) holding its first PAGE_TOKENS x len tokens' KV: its
    # first prefill chunk starts after them.
    cached_hashes: tuple[int, ...] = ()


class PrefillChunk(NamedTuple):
    request_id: int
    start: int  # position of the chunk's first token (= tokens already in the request's cache)
    num_tokens: int  # tokens computed by this chunk
    sample: bool  # the chunk reaches the request's last known token: sample the next one
    # No token sampled for the request yet (False: a preempted request recomputing): a sampling
    # chunk of a fresh request samples its first token (where host_request_us is paid).
    fresh: bool = True


class CacheOps(NamedTuple):
    """What a step does to the executor's cached blocks, in this order: blocks dropped before the
    step runs, then blocks copied out of a request's prefill cache after its chunk ran (paged: a
    row joining this step gives its own block instead)."""

    evict: tuple[int, ...]  # block hashes, least recently used first
    store: tuple[tuple[int, int, int], ...]  # (request id, block index in its prompt, block hash)
    # Paged: (request id, block hashes) of requests whose prefill ended this step: the cached
    # blocks their rows reference from their start when they join (held from now on).
    share: tuple[tuple[int, tuple[int, ...]], ...] = ()


class StepPlan(NamedTuple):
    step_index: int
    # KV to release before running: finished, aborted or preempted requests.
    free_ids: tuple[int, ...]
    new_requests: tuple[NewRequest, ...]
    prefills: tuple[PrefillChunk, ...]
    # Requests in the decode pool that feed their last token and sample one, in one forward pass.
    decode_ids: tuple[int, ...]
    # Their cached tokens before this step (their positions), aligned with decode_ids.
    decode_positions: tuple[int, ...]
    # Pool geometry the executor must hold after this step.
    pool: PoolGeometry
    # KV bytes held after this step by the scheduler's account (pool + private prefill caches).
    kv_bytes: int
    # A pure-decode plan may be repeated this many times with nothing else changing
    # (the simulator fast-forwards; the real executor always runs 1).
    num_steps: int = 1
    # Speculative decoding: drafted tokens each decode row may verify this step, aligned with
    # decode_ids (the executor drafts up to that many); empty: none.
    decode_spec_tokens: tuple[int, ...] = ()
    # Prefix-cache blocks evicted before the step and stored after its prefills; None: neither.
    cache_ops: CacheOps | None = None
    # max(decode_positions) + 1 as the scheduler knew it (the rows' width after the step), so
    # an executor need not search the positions; 0: not given (work it out).
    decode_width: int = 0

    @property
    def num_scheduled_tokens(self) -> int:
        return (len(self.decode_ids) + sum(self.decode_spec_tokens)
                + sum(c.num_tokens for c in self.prefills))

    @property
    def num_joined_directly(self) -> int:
        """New requests that join the decode pool with no prefill chunk (one-token prompts, never
        a recompute): their decode row samples their first token, where host_request_us is paid."""
        if not self.new_requests or not self.decode_ids:
            return 0
        chunked = {c.request_id for c in self.prefills}
        return sum(n.request_id not in chunked for n in self.new_requests)


class StepResult(NamedTuple):
    step_index: int
    # Requests that sampled a token, in one order every executor keeps: the decode rows in
    # plan.decode_ids order, then the prefill chunks with sample=True in plan.prefills order.
    sampled_ids: tuple[int, ...]
    # The sampled token per request and step: one tuple per executed step; None in simulation.
    token_ids: tuple[tuple[int, ...], ...] | None
    # Duration of each executed step in seconds (measured, or predicted by a cost model).
    step_durations_s: tuple[float, ...]
    # KV bytes the executor holds after the step, counted from its own arrays.
    kv_bytes: int
    # Speculative decoding (one executed step): per sampled row, the drafted tokens it accepted,
    # which come before its sampled token; None when the step verified no drafts.
    accepted_ids: tuple[tuple[int, ...], ...] | None = None
    # Tokens drafted per sampled row (aligned with sampled_ids); None as accepted_ids.
    num_drafted: tuple[int, ...] | None = None

    @property
    def num_steps(self) -> int:
        return len(self.step_durations_s)

    @property
    def elapsed_s(self) -> float:
        return sum(self.step_durations_s)
