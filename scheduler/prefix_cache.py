"""Prefix caching by chained block hashes (vLLM's scheme): a full block of PAGE_TOKENS tokens is
named by a hash of (its parent block's hash, its key), so equal hashes mean equal prefixes. Hashes
are deterministic across processes (blake2b, never Python's salted str hash)."""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Sequence

from batchsim.scheduler.pool_geometry import PAGE_TOKENS
from batchsim.scheduler.request import Request

ROOT_HASH = 0  # the parent of a prompt's first block


def _block_hash(parent: int, key: object) -> int:
    # repr of ints, strs and tuples of them is the same in every process
    digest = hashlib.blake2b(repr((parent, key)).encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little")


def chain_block_hashes(block_keys: Iterable[object]) -> tuple[int, ...]:
    """The chained hash of each block: block i's hash covers keys 0..i. A key is an int, a str or
    a tuple of them (a block's token ids; a workload's (segment, block index))."""
    hashes = []
    parent = ROOT_HASH
    for key in block_keys:
        parent = _block_hash(parent, key)
        hashes.append(parent)
    return tuple(hashes)


def token_block_hashes(token_ids: Sequence[int]) -> tuple[int, ...]:
    """Chained hashes of the full PAGE_TOKENS blocks of `token_ids` (a partial last block has
    none)."""
    full = len(token_ids) // PAGE_TOKENS * PAGE_TOKENS
    return chain_block_hashes(tuple(token_ids[i:i + PAGE_TOKENS])
                              for i in range(0, full, PAGE_TOKENS))


def prompt_block_hashes(request: Request) -> tuple[int, ...]:
    """The request's block hashes: the workload's, else its prompt tokens', else none (worked out
    once and kept on the request)."""
    if request.block_hashes is None:
        ids = request.prompt_token_ids
        request.block_hashes = token_block_hashes(ids) if ids is not None else ()
    return request.block_hashes
