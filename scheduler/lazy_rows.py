"""Decode rows advanced lazily in a simulation: a row that only decodes gains one token per step,
so its counters are kept as (value - base) plus one shared count of the decode steps applied
(`steps`), and written back to the Request only when it leaves this set (settle). The per-plan
cost then hardly grows with the rows: the widest and longest row are kept, the next finish is a
heap's top, and a plan's positions are built row by row only when read (Positions: a simulated
executor reads the joining rows' alone, the records none).

The rows are always the prefix running[:len(ids)] of the scheduler's running list, each simulated
(no token ids) and in every decode step since it joined (a row joins after its first decode, or
when its prefill sampled its first token: join_ready, saving the next plan its row-by-row pass,
issue 37); anything else (a preemption, an abort, a
plan that is not a simulated decode of them all) settles them first. The scheduler's general path
is the reference (tests/test_advance.py holds the two equal)."""

from __future__ import annotations

import heapq
import operator
from collections.abc import Iterator, Sequence

from batchsim.scheduler.request import RUNNING, Request

# A request's id and its computed tokens, read in C (map over a few rows: no comprehension frame)
REQUEST_ID = operator.attrgetter("request_id")
_new = object.__new__
COMPUTED = operator.attrgetter("num_computed_tokens")


class LazyRows:
    __slots__ = ("computed0", "ends", "fresh", "id_set", "id_tuple", "ids", "max_computed0",
                 "max_tokens0", "rows", "steps", "tokens0")

    def __init__(self) -> None:
        self.steps = 0  # decode steps applied lazily so far (only differences matter)
        self.rows: list[Request] = []  # the rows, in running order
        self.ids: list[int] = []  # their request ids
        # tuple(ids) (None: not made since the rows changed) and set(ids), kept with them: a
        # plan's decode_ids and its pool's ids, without a pass over the rows. A plan where no
        # row joins hands id_set itself to the KV manager as its pool members (decode_plan: no
        # copy a plan), so it changes only as they would: a row that joins is added after a plan
        # that copied it (the joining rows made a new set), a finished row is discarded (the
        # next plan releases it: the same), and settle replaces it rather than clearing it.
        self.id_tuple: tuple[int, ...] | None = None
        self.id_set: set[int] = set()
        # num_computed_tokens - steps (the Request's own counter is as of `steps` then: the
        # steps since are this plus `steps` less it)
        self.computed0: list[int] = []
        self.tokens0: list[int] = []  # num_tokens (prompt + output) - steps
        self.max_computed0 = self.max_tokens0 = 0  # their largest (kept, not searched per plan)
        # A heap of (`steps` at which a row reaches its max_tokens, request id, row): its top
        # less `steps`, the decode steps until the first row does (lookahead.py reads it).
        self.ends: list[tuple[int, int, Request]] = []
        # The last rows that joined when their prefill ended (join_ready), before their first
        # decode: not yet in the executor's pool (Positions.pooled stops short of them).
        self.fresh = 0

    def add(self, r: Request) -> None:
        """A decode row whose counters are up to date joins (at the end of the prefix)."""
        s = self.steps
        first = not self.rows
        self.id_tuple = None
        self.rows.append(r)
        self.ids.append(r.request_id)
        self.id_set.add(r.request_id)
        c0, n0 = r.num_computed_tokens - s, r.num_prompt_tokens + r.num_output_tokens - s
        self.computed0.append(c0)
        self.tokens0.append(n0)
        if first or c0 > self.max_computed0:
            self.max_computed0 = c0
        if first or n0 > self.max_tokens0:
            self.max_tokens0 = n0
        heapq.heappush(self.ends, (r.sampling.max_tokens - r.num_output_tokens + s,
                                   r.request_id, r))

    def absorb(self, rows: list[Request], n: int, running: list[Request]) -> None:
        """A simulated plan's decode rows after its first n (the lazy ones), counters up to date,
        join while they continue the running prefix that the lazy rows are."""
        live = RUNNING
        for r in rows[n:]:
            if r.status is not live:  # finished, or aborted while the step ran
                continue
            i = len(self.rows)
            if i >= len(running) or running[i] is not r or r.prompt_token_ids is not None:
                return
            self.add(r)

    def join_ready(self, running: list[Request], end: int) -> None:
        """The running rows after the prefix whose prefill ended with a token sampled in the step
        that ends at step `end` (decode-ready, simulated) join now, before their first decode
        (fresh), rather than through the next plan's decode rows (absorb). The scheduler calls
        this after a simulated step under a policy that decodes every decode-ready row next."""
        i, live = len(self.rows), RUNNING
        for r in running[i:]:
            runs = r.token_runs
            if (r.num_prompt_tokens + r.num_output_tokens - r.num_computed_tokens != 1
                    or r.status is not live or r.prompt_token_ids is not None or not runs
                    or runs[-1][1] != end):
                return
            if i == len(self.rows):  # a new set: the KV manager may hold this one as its pool
                self.id_set = self.id_set.copy()  # members (see __init__)
            self.add(r)
            self.fresh += 1

    def widest_longest(self) -> tuple[int, int]:
        """The largest num_computed_tokens and the largest num_tokens among the rows (they are
        not empty): one call a plan."""
        s = self.steps
        return self.max_computed0 + s, self.max_tokens0 + s

    def positions(self) -> list[int]:
        """Every row's num_computed_tokens, in order."""
        s = self.steps
        return [c + s for c in self.computed0]

    def columns(self, decodes: list[Request]) -> tuple[tuple[int, ...], tuple[int, ...]]:
        """A plan's decode_ids and decode_positions for these decode rows (the lazy rows first,
        when there are any)."""
        n = len(self.rows) if decodes else 0
        if not n:
            return (tuple([r.request_id for r in decodes]),
                    tuple([r.num_computed_tokens for r in decodes]))
        # Positions' fields set here, without a type call's __init__ frame (one is made a plan)
        p = _new(Positions)
        pooled = n - self.fresh  # the fresh rows' Requests are up to date: read as the others'
        p._computed0, p._steps, p._values = self.computed0[:pooled], self.steps, None
        p.pooled = pooled
        # rows joining (most plans: none or one): the fresh ones, then any after the lazy rows
        p.tail = () if len(decodes) == pooled else tuple(map(COMPUTED, decodes[pooled:]))
        if len(decodes) > n:
            return (*self.ids, *map(REQUEST_ID, decodes[n:])), p
        ids = self.id_tuple
        if ids is None:
            ids = self.id_tuple = tuple(self.ids)
        return ids, p

    def computed(self) -> dict[int, int]:
        """request id -> num_computed_tokens, without writing them back."""
        return dict(zip(self.ids, self.positions()))

    def advance(self, k: int, running: list[Request]) -> list[Request]:
        """Every row decoded k more steps; the rows that reached max_tokens leave, settled, in
        order (still to be finished), and leave `running` (the scheduler's, which the rows are
        the prefix of: the same index, no search among the requests)."""
        s = self.steps = self.steps + k
        self.fresh = 0  # every row decoded: all in the executor's pool
        ends = self.ends
        if not ends or ends[0][0] > s:
            return []
        rows, ids, computed0, tokens0 = self.rows, self.ids, self.computed0, self.tokens0
        done = []
        while ends and ends[0][0] <= s:
            done.append(ids.index(heapq.heappop(ends)[1]))  # ints compare faster than rows
        if len(done) > 1:
            done.sort()
        reached = list(map(rows.__getitem__, done))
        self.id_tuple = None
        c_max, n_max = self.max_computed0, self.max_tokens0
        widest = longest = False  # a row that left held a largest value: search again
        for i in reversed(done):
            self._settle_row(i)
            self.id_set.discard(ids[i])
            widest |= computed0[i] == c_max
            longest |= tokens0[i] == n_max
            del rows[i], ids[i], computed0[i], tokens0[i], running[i]
        if rows and widest:
            self.max_computed0 = max(computed0)
        if rows and longest:
            self.max_tokens0 = max(tokens0)
        return reached

    def settle(self) -> None:
        """Write every row's counters back and empty the set."""
        for i in range(len(self.rows)):
            self._settle_row(i)
        self.id_tuple, self.fresh = None, 0
        self.id_set = set()  # a new one: the KV manager may hold the old one (see __init__)
        for column in (self.rows, self.ids, self.computed0, self.tokens0, self.ends):
            column.clear()

    def _settle_row(self, i: int) -> None:
        r = self.rows[i]
        d = self.computed0[i] + self.steps - r.num_computed_tokens  # steps since it was written
        if d:
            r.num_computed_tokens += d
            r.num_output_tokens += d
            r.token_runs[-1][1] += d  # its run went on through every step since


class Positions(Sequence):
    """A plan's decode_positions when its first rows are lazy rows: their positions (computed0
    plus the steps, as of the plan) then the other rows' (`tail`), made into a tuple when first
    read whole. Its first `pooled` rows decoded in the last step, so they are in the executor's
    pool (a simulated executor joins the `tail` rows after them). Equal to the tuple, and
    pickled as one. Made by LazyRows.columns."""

    __slots__ = ("_computed0", "_steps", "_values", "pooled", "tail")

    def values(self) -> tuple[int, ...]:
        if self._values is None:
            s = self._steps
            self._values = (*[c + s for c in self._computed0], *self.tail)
        return self._values

    def __getitem__(self, i):  # a row's position without the tuple
        if isinstance(i, int) and 0 <= i:
            n = self.pooled
            return self._computed0[i] + self._steps if i < n else self.tail[i - n]
        return self.values()[i]

    def __len__(self) -> int:
        return self.pooled + len(self.tail)

    def __iter__(self) -> Iterator[int]:
        return iter(self.values())

    def __eq__(self, other: object) -> bool:
        return self.values() == (other.values() if isinstance(other, Positions) else other)

    def __hash__(self) -> int:
        return hash(self.values())

    def __repr__(self) -> str:
        return repr(self.values())

    def __reduce__(self) -> tuple:
        return tuple, (self.values(),)
