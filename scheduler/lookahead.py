"""How many identical pure-decode steps one plan may stand for (the simulator times them in one
call): until a request finishes or the pool must grow. Queued requests cannot be admitted
meanwhile: memory only grows."""

from __future__ import annotations

from batchsim.scheduler.kv_manager import KVManager
from batchsim.scheduler.lazy_rows import LazyRows
from batchsim.scheduler.pool_geometry import PAGE_TOKENS, PoolGeometry, row_blocks
from batchsim.scheduler.request import Request


def lookahead_steps(decodes: list[Request], geom: PoolGeometry, width: int, limit: int,
                    kv: KVManager, lazy: LazyRows) -> int:
    """Steps for the decode rows `decodes` (their first len(lazy.rows) are the lazy rows), at most
    `limit`; `width`: the pool's longest row after the first step."""
    if limit == 1 or not decodes:
        return 1
    steps = min(limit, geom.capacity_tokens - width + 1)
    if geom.blocks is not None:
        steps = min(steps, _paged_steps(decodes, geom.blocks - kv.blocks_beside(decodes)))
    n = len(lazy.rows)
    if n:  # simulated rows (no token ids): only their length stops them
        steps = min(steps, lazy.ends[0][0] - lazy.steps)  # until the first reaches max_tokens
        decodes = decodes[n:]
    for r in decodes:  # a plain loop: comprehensions cost a frame each in Python 3.11
        sampling = r.sampling
        if r.prompt_token_ids is not None and (not sampling.ignore_eos
                                               or r.stop_checker is not None):
            return 1  # a real token could be EOS or end a stop string
        left = sampling.max_tokens - r.num_output_tokens
        if left < steps:  # noqa: PLR1730
            steps = left
    return max(1, steps)


def _paged_steps(decodes: list[Request], blocks: int) -> int:
    """Decode steps the rows' blocks hold, starting with this one: a lower bound (each row's last
    block filled, then the spare blocks shared evenly)."""
    after = [r.num_computed_tokens + 1 for r in decodes]
    spare = blocks - sum([row_blocks(n) for n in after])
    room = min([row_blocks(n) * PAGE_TOKENS - n for n in after])
    return 1 + room + spare // len(decodes) * PAGE_TOKENS
