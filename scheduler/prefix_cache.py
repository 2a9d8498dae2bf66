"""Prefix caching by chained block hashes (vLLM's scheme): a full block of PAGE_TOKENS tokens is
named by a hash of (its parent block's hash, its key), so equal hashes mean equal prefixes. Hashes
are deterministic across processes (blake2b, never Python's salted str hash)."""

from __future__ import annotations

import hashlib
import itertools
from collections import OrderedDict
from collections.abc import Iterable, Sequence

from batchsim.scheduler.plan import CacheOps, PrefillChunk
from batchsim.scheduler.pool_geometry import PAGE_TOKENS
from batchsim.scheduler.request import Request

ROOT_HASH = 0  # the parent of a prompt's first block

# What a cached block costs at most beside its KV bytes, which MLX's memory counts leave out
# (executors/prefix_blocks.py's one array a block and this index): the array's descriptor and
# Python object, malloc's headers, the index entries (960 bytes measured, CPython 3.11, glibc,
# MLX 0.32: a 6% margin that holds for those versions only, tests/test_prefix_block_memory.py;
# the HTTP soak counts it). Here, not beside the arrays: benchmarks read it without loading MLX.
BLOCK_BOOKKEEPING_BYTES = 1024


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


class PrefixCache:
    """Cached blocks by chained hash, in least-recently-used order, each of `block_bytes`. A block
    referenced (pinned by a request admitted this step, or, `shared`, held by a request until it
    is released) is never evicted.

    `shared` (the paged layout): cached blocks live in the decode pool's blocks. As each prefill
    chunk completes full prompt blocks, they are copied out of its prefill cache into pool blocks
    nobody references (evictable: a prefilling request's copies never cost anyone room). A
    request holds its hits from admission and, once its prefill ends, the cached run of its blocks
    after them; at its join the pool adopts its row's other full prompt blocks (no copy; an
    unreferenced copy of one is dropped). Rows reference cached blocks instead of copying them,
    so a block is counted once however many rows share it. The padded layout copies: blocks are
    stored out of prefill caches as chunks complete them and copied into a hit's prefill cache."""

    def __init__(self, block_bytes: int, shared: bool = False):
        self.block_bytes = block_bytes
        self.shared = shared
        self.blocks: OrderedDict[int, None] = OrderedDict()  # oldest use first
        self.refs: dict[int, int] = {}  # referenced blocks -> pins this step and holders
        self.held: dict[int, tuple[int, ...]] = {}  # shared: request id -> blocks it references
        self.peak_bytes = 0
        self._pins: list[int] = []  # this step's pins, dropped by take_ops
        self._evicted: list[int] = []
        self._stored: list[tuple[int, int, int]] = []
        self._shares: list[tuple[int, tuple[int, ...]]] = []

    @property
    def nbytes(self) -> int:
        return len(self.blocks) * self.block_bytes

    @property
    def num_unreferenced(self) -> int:
        """Cached blocks nobody references: evictable."""
        return len(self.blocks) - len(self.refs)

    def match(self, hashes: tuple[int, ...], num_tokens: int) -> int:
        """Blocks of the longest cached prefix a request of `num_tokens` to compute may reuse:
        whole blocks, leaving at least its last two tokens to prefill (the last is sampled from)."""
        limit = min(len(hashes), (num_tokens - 2) // PAGE_TOKENS)
        n = 0
        blocks = self.blocks
        while n < limit and hashes[n] in blocks:
            n += 1
        return n

    def pin(self, hashes: tuple[int, ...], holder: int | None = None) -> int:
        """Reference these cached blocks: for this step, or (`holder`: a request id) until
        release(holder). Returns how many were unreferenced."""
        new = self._ref(hashes)
        if holder is None:
            self._pins.extend(hashes)
        elif hashes:  # none: a request admitted without a hit holds no entry
            self.held[holder] = self.held.get(holder, ()) + hashes
        return new

    def _ref(self, hashes: Iterable[int]) -> int:
        new = 0
        refs = self.refs
        for h in hashes:
            self.blocks.move_to_end(h)
            n = refs.get(h, 0)
            new += n == 0
            refs[h] = n + 1
        return new

    def unpin_step(self, hashes: tuple[int, ...]) -> None:
        """Undo the last pin(hashes) for this step."""
        self.unpin(hashes)
        del self._pins[len(self._pins) - len(hashes):]

    def unpin(self, hashes: Iterable[int]) -> None:
        for h in hashes:
            refs = self.refs.pop(h) - 1
            if refs:
                self.refs[h] = refs

    def release(self, holder: int) -> None:
        """A request's KV is freed: it references no block any more."""
        held = self.held.pop(holder, None)
        if held:
            self.unpin(held)

    def num_held(self, holder: int) -> int:
        return len(self.held.get(holder, ()))

    def adopt(self, request_id: int, hashes: tuple[int, ...]) -> None:
        """Shared: a request joins the pool; its row's full prompt blocks (`hashes`) after those it
        holds become cached blocks it holds, replacing a cached block of that hash nobody
        references (a copy: one block, not two), unless another row references it (then its row
        keeps its own)."""
        blocks, refs, new = self.blocks, self.refs, []
        for i in range(self.num_held(request_id), len(hashes)):
            h = hashes[i]
            if h in refs:
                continue
            if h in blocks:
                self._drop(h)
            blocks[h] = None
            self._stored.append((request_id, i, h))
            new.append(h)
        if new:
            self.pin(tuple(new), request_id)

    def evict(self, num_blocks: int) -> None:
        """Evict up to `num_blocks` unreferenced blocks, least recently used first. A block stored
        earlier in this step leaves the step's stores instead (the executor evicts before it
        stores, so it must see neither)."""
        if num_blocks > 0:
            blocks, refs = self.blocks, self.refs
            for h in list(itertools.islice((h for h in blocks if h not in refs), num_blocks)):
                self._drop(h)

    def _drop(self, h: int) -> None:
        """Evict one unreferenced block (one stored this step leaves the step's stores)."""
        del self.blocks[h]
        stored = [s for s in self._stored if s[2] != h]
        if len(stored) < len(self._stored):
            self._stored = stored
        else:
            self._evicted.append(h)

    def fit(self, room_bytes: int) -> bool:
        """Evict unreferenced blocks, least recently used first, until they hold <= room_bytes;
        False: the referenced ones alone hold more."""
        self.evict(-(-(self.nbytes - room_bytes) // self.block_bytes))
        return self.nbytes <= room_bytes

    def store(self, request_id: int, first: int, hashes: tuple[int, ...], room_bytes: int) -> None:
        """Keep blocks first.. of a request's prompt (`hashes`) that are not cached, evicting older
        unreferenced ones while they fit `room_bytes`; a block that does not fit ends the run."""
        blocks = self.blocks
        for i in range(first, len(hashes)):
            h = hashes[i]
            if h in blocks:
                blocks.move_to_end(h)
                continue
            if not self.fit(room_bytes - self.block_bytes):
                return
            blocks[h] = None
            self._stored.append((request_id, i, h))

    def store_chunks(self, chunks: list[PrefillChunk], requests: dict[int, Request],
                     room_bytes: int) -> None:
        """Keep the prompt blocks these prefill chunks complete, in `room_bytes` (copied: not
        shared, where blocks are adopted at join instead)."""
        if self.shared:
            return
        for c in chunks:
            hashes = requests[c.request_id].block_hashes
            end = (c.start + c.num_tokens) // PAGE_TOKENS
            if hashes and end > c.start // PAGE_TOKENS:
                self.store(c.request_id, c.start // PAGE_TOKENS, hashes[:end], room_bytes)

    def has_ops(self, chunks: Sequence[PrefillChunk], requests: dict[int, Request]) -> bool:
        """Whether a plan with these prefill chunks goes through store_chunks and take_ops: False
        when they would change nothing and give no ops (padded: only store_chunks adds blocks, and
        take_ops keeps peak_bytes up with them): nothing pending, and, with chunks, no pins and no
        chunk of a request with block hashes (a simulated workload without shared segments: every
        step). One call a plan, and the one test of pending cache ops."""
        pending = self._evicted or self._stored or self._shares
        if not chunks:
            return bool(pending)
        if pending or self.shared or self._pins:
            return True
        for c in chunks:
            if requests[c.request_id].block_hashes:
                return True
        return False

    def cache_chunks(self, chunks: list[PrefillChunk], requests: dict[int, Request]) -> None:
        """Shared: the full prompt blocks these chunks complete that are not cached become cached
        blocks nobody references, copied out of their prefill caches after the chunks run."""
        blocks, stored = self.blocks, self._stored
        for c in chunks:
            hashes = requests[c.request_id].block_hashes
            if not hashes:
                continue
            for i in range(c.start // PAGE_TOKENS, min((c.start + c.num_tokens) // PAGE_TOKENS,
                                                       len(hashes))):
                h = hashes[i]
                if h in blocks:
                    blocks.move_to_end(h)
                else:
                    blocks[h] = None
                    stored.append((c.request_id, i, h))

    def hold_prefilled(self, request_id: int, hashes: tuple[int, ...]) -> int:
        """Shared: a request whose prefill ended holds the cached blocks of its prompt from its
        start, through the last before one that is not cached; its row references them when it
        joins. Returns how many nobody referenced (undo with unhold)."""
        first = end = self.num_held(request_id)
        blocks = self.blocks
        while end < len(hashes) and hashes[end] in blocks:
            end += 1
        if end == first:
            return 0
        new = self.pin(hashes[first:end], request_id)
        self._shares.append((request_id, hashes[:end]))
        return new

    def unhold(self, request_id: int, num_held: int) -> None:
        """Undo the last hold_prefilled(request_id, ...): it holds its first `num_held` again."""
        self._shares.pop()
        held = self.held[request_id]
        self.unpin(held[num_held:])
        if num_held:
            self.held[request_id] = held[:num_held]
        else:
            del self.held[request_id]

    def take_ops(self) -> CacheOps | None:
        """This step's evictions and stores (None: neither); pins end with the step."""
        if self._pins:
            self.unpin(self._pins)
            self._pins = []
        self.peak_bytes = max(self.peak_bytes, self.nbytes)
        if not self.has_ops((), {}):  # nothing pending (one frame)
            return None
        ops = CacheOps(tuple(self._evicted), tuple(self._stored), tuple(self._shares))
        self._evicted, self._stored, self._shares = [], [], []
        return ops

    def clear(self) -> None:
        """The executor dropped every block (after a failed step)."""
        self.blocks.clear()
        self.refs.clear()
        self.held.clear()
        self._pins, self._evicted, self._stored, self._shares = [], [], [], []
