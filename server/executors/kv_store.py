"""The decode pool's MLX arrays, one store per layer by its cache kind (arch_cache.Attention), each
with the view the model's layer sees during one decode forward pass (mlx-lm's cache API):
- KVStore: K and V of every token, (rows, heads, capacity, dim): full attention and MLA's latent
  and RoPE key; with kv_bits, packed words, scales and biases, as QuantizedKVCache holds them;
- RingStore: a sliding window, (rows, heads, min(capacity, W), dim); token p sits in slot p mod S;
- StateStore: a linear-attention layer's fixed arrays (conv and recurrent state), (rows, ...).
Row moves and resizes apply to every array alike (axis 0 rows, axis 2 tokens)."""

from __future__ import annotations

import math

import mlx.core as mx
from batchsim.server.models.arch_cache import KV_GROUP_SIZE, Attention, quantized_dims
from mlx_lm.models.cache import _BaseCache


class DecodeStep:
    """What every layer's view shares in one decode step of `n` tokens per row (n > 1: a
    speculative verify step, speculative.py)."""

    def __init__(self, lengths: list[int], rows: mx.array | None = None, paged=None,
                 n: int = 1):
        self.paged = paged  # paged_store.PagedStep in the paged layout
        self.b = len(lengths)
        self.n = n
        self.width = max(lengths) + n
        self.shortest = min(lengths) + n  # tokens of the shortest row after this step's write
        # Every row at one position (always at batch 1): one column written by a slice update and
        # no mask, as mlx-lm's own caches do; otherwise a scatter at each row's position, masked.
        self.aligned = self.shortest == self.width
        # the first new token's position: one int when aligned, else (B,)
        self.positions = self.width - n if self.aligned else mx.array(lengths)
        self.rows = mx.arange(self.b) if rows is None else rows  # the rows a scatter writes
        self._masks: dict[int, mx.array | None] = {}
        self._slots: dict[int, mx.array | int] = {}

    def mask(self, width: int) -> mx.array | None:
        """(B, 1, n, width): slot j < width holds a token that row b's query i attends to (ring
        slots: all once the row has wrapped, since then p >= width). None when n is 1 and every
        row fills all `width` slots (aligned rows; a ring every row has wrapped)."""
        if self.n == 1 and self.shortest >= width:
            return None
        m = self._masks.get(width)
        if m is None:
            last = mx.array(self.positions).reshape(-1, 1) + mx.arange(self.n)[None]  # (B|1, n)
            m = mx.arange(width)[None, None] <= last[:, :, None]
            if m.shape[0] != self.b:
                m = mx.broadcast_to(m, (self.b, self.n, width))
            m = self._masks[width] = m[:, None]
        return m

    def slots(self, ring: int) -> mx.array | int:
        s = self._slots.get(ring)
        if s is None:
            s = self._slots[ring] = self.positions % ring
        return s

    def write(self, a: mx.array, slots: mx.array | int, new: mx.array) -> None:
        """Put each row's new tokens (B, heads, n, dim) into its slots of `a`."""
        if self.aligned:
            a[: self.b, :, slots : slots + self.n] = new
        elif self.n == 1:
            a[self.rows, :, slots] = new[:, :, 0]
        else:
            at = slots[:, None] + mx.arange(self.n)[None]  # (B, n)
            a[self.rows[:, None], :, at] = new.transpose(0, 2, 1, 3)


def _reshape(a: mx.array, rows: int, tokens: int | None) -> mx.array:
    """Keep rows [0, rows) and (tokens set) slots [0, tokens) along axis 2; pad with zeros."""
    if a.shape[0] > rows:
        a = a[:rows]
    pad = [(0, rows - a.shape[0])] + [(0, 0)] * (a.ndim - 1)
    if tokens is not None:
        a = a[:, :, :tokens]
        pad[2] = (0, tokens - a.shape[2])
    return mx.pad(a, pad) if any(p[1] for p in pad) else mx.contiguous(a)


class KVStore:
    """K/V for every token of a row: full attention and MLA layers."""

    def __init__(self, spec: Attention, dtype: mx.Dtype, kv_bits: int | None = None):
        self.spec, self.dtype, self.kv_bits = spec, dtype, kv_bits
        self.parts: list[mx.array] = []  # K then V; quantized: (wq, scales, biases) of K then of V
        self.view_class = KVView if kv_bits is None else QuantizedKVView  # (store, step) -> view

    def _shapes(self, rows: int, tokens: int) -> list[tuple[tuple[int, ...], mx.Dtype]]:
        s, dtype = self.spec, self.dtype
        if self.kv_bits is None:
            return [((rows, s.heads, tokens, d), dtype) for d in (s.k_dim, s.v_dim)]
        out = []
        for d in (s.k_dim, s.v_dim):
            words, groups = quantized_dims(d, self.kv_bits)
            groups_shape = ((rows, s.heads, tokens, groups), dtype)
            out += [((rows, s.heads, tokens, words), mx.uint32), groups_shape, groups_shape]
        return out

    def tokens(self, capacity: int) -> int:
        return capacity

    def resize(self, rows: int, capacity: int) -> None:
        tokens = self.tokens(capacity)
        if rows == 0:
            self.parts = []
        elif not self.parts:
            self.parts = [mx.zeros(shape, dt) for shape, dt in self._shapes(rows, tokens)]
        else:
            self.parts = [_reshape(a, rows, tokens) for a in self.parts]

    def join(self, row: int, cache, length: int) -> None:
        """Copy a prefilled private cache (KVCache / QuantizedKVCache) of `length` tokens."""
        quantized = self.kv_bits is not None
        src = [*cache.keys, *cache.values] if quantized else [cache.keys, cache.values]
        for a, c in zip(self.parts, src):
            a[row : row + 1, :, :length] = c[..., :length, :]


class KVView(_BaseCache):
    def __init__(self, store: KVStore, step: DecodeStep):
        self._store, self._step = store, step
        self.offset = step.positions

    def update_and_fetch(self, keys: mx.array, values: mx.array):
        st = self._step
        k, v = self._store.parts
        st.write(k, st.positions, keys)
        st.write(v, st.positions, values)
        return k[: st.b, :, : st.width], v[: st.b, :, : st.width]

    def make_mask(self, N: int, return_array: bool = False, window_size: int | None = None):
        if N != self._step.n or window_size is not None:
            raise NotImplementedError("the decode pool serves the step's own tokens per row")
        return self._step.mask(self._step.width)

    @property
    def state(self):
        return tuple(self._store.parts)

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes for a in self._store.parts)


class QuantizedKVView(KVView):
    """K/V as QuantizedKVCache holds them: mlx-lm's attention sees `bits` and runs its quantized
    attention on the (words, scales, biases) triples."""

    def __init__(self, store: KVStore, step: DecodeStep):
        super().__init__(store, step)
        self.bits = store.kv_bits
        self.group_size = KV_GROUP_SIZE

    def update_and_fetch(self, keys: mx.array, values: mx.array):
        st = self._step
        fetched = []
        for parts, new in ((self._store.parts[:3], keys), (self._store.parts[3:], values)):
            q = mx.quantize(new, group_size=self.group_size, bits=self.bits)
            for a, p in zip(parts, q):
                st.write(a, st.positions, p)
            fetched.append(tuple(a[: st.b, :, : st.width] for a in parts))
        return fetched[0], fetched[1]


class RingStore(KVStore):
    """A sliding window of W tokens per row, in min(capacity, W) slots."""

    def __init__(self, spec: Attention, dtype: mx.Dtype, kv_bits: int | None = None):
        super().__init__(spec, dtype)
        self.view_class = RingView

    def tokens(self, capacity: int) -> int:
        return min(capacity, self.spec.window)

    def join(self, row: int, cache, length: int) -> None:
        """The private cache holds its last tokens in temporal order; token p goes to slot
        p mod S."""
        ring = self.parts[0].shape[2]
        m = min(length, ring)
        start = (length - m) % ring
        first = min(m, ring - start)
        for a, c in zip(self.parts, (cache.keys, cache.values)):
            held = c.shape[2]
            a[row : row + 1, :, start : start + first] = c[..., held - m : held - m + first, :]
            if first < m:
                a[row : row + 1, :, : m - first] = c[..., held - m + first : held, :]


class RingView(KVView):
    def update_and_fetch(self, keys: mx.array, values: mx.array):
        st = self._step
        k, v = self._store.parts
        ring = k.shape[2]
        slots = st.slots(ring)
        st.write(k, slots, keys)
        st.write(v, slots, values)
        width = min(ring, st.width)
        return k[: st.b, :, :width], v[: st.b, :, :width]

    def make_mask(self, N: int, return_array: bool = False, window_size: int | None = None):
        if N != 1 or (window_size is not None and window_size != self._store.spec.window):
            raise NotImplementedError("the ring serves one-token steps over its own window")
        return self._step.mask(min(self._store.parts[0].shape[2], self._step.width))


class StateStore:
    """A linear-attention layer's fixed arrays, one row per sequence."""

    def __init__(self, spec: Attention, dtype: mx.Dtype, kv_bits: int | None = None):
        self.spec = spec
        # ArraysCache's entries: the conv state in the activation dtype, the recurrent one float32
        self.shapes = ((spec.conv_shape, dtype), (spec.state_shape, mx.float32))
        self.parts: list[mx.array] = []
        self.view_class = StateView

    def resize(self, rows: int, capacity: int) -> None:
        if rows == 0:
            self.parts = []
        elif not self.parts:
            self.parts = [mx.zeros((rows, *shape), dt) for shape, dt in self.shapes]
        else:
            self.parts = [_reshape(a, rows, None) for a in self.parts]

    def join(self, row: int, cache, length: int) -> None:
        for a, c in zip(self.parts, cache.cache):
            a[row : row + 1] = c


class StateView(_BaseCache):
    """ArraysCache's API over rows [0, B): no padding, so no mask and no lengths."""

    lengths = None
    left_padding = None

    def __init__(self, store: StateStore, step: DecodeStep):
        self._store, self._b = store, step.b

    def __getitem__(self, i: int) -> mx.array:
        a = self._store.parts[i]
        return a if a.shape[0] == self._b else a[: self._b]

    def __setitem__(self, i: int, value: mx.array) -> None:
        """A new array, never an update in place: a step run ahead may be undone (lookahead.py)."""
        parts = self._store.parts
        value = value.astype(parts[i].dtype)
        if parts[i].shape[0] == self._b:
            parts[i] = value
        else:
            parts[i] = mx.slice_update(parts[i], value, mx.array([0]), axes=(0,))

    def advance(self, n: int) -> None:
        pass

    def make_mask(self, N: int):
        return None

    @property
    def state(self):
        return tuple(self._store.parts)

    @property
    def nbytes(self) -> int:
        return sum(math.prod(a.shape) * a.dtype.size for a in self._store.parts)


STORES = {"full": KVStore, "mla": KVStore, "sliding": RingStore, "linear": StateStore}


def make_store(spec: Attention, dtype: mx.Dtype, kv_bits: int | None = None):
    return STORES[spec.kind](spec, dtype, kv_bits)
