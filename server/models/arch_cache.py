"""What each layer's mlx-lm 0.32 cache holds for one sequence, replayed shape by shape from the
cache classes in mlx_lm/models/cache.py: KVCache (full attention and DeepSeek's MLA latent) grows in
256-token steps; RotatingKVCache (sliding window) keeps a whole multi-token chunk, then shrinks to
its window on the next single-token step; ArraysCache (linear attention) holds a fixed conv state
and a float32 recurrent state."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterable

from batchsim.configs import ConfigError
from batchsim.scheduler.kv_bytes import CacheLayout
from batchsim.scheduler.pool_geometry import KV_STEP  # KVCache.step and RotatingKVCache.step

STATE_BYTES = 4  # the gated-delta recurrent state is float32 whatever the activations are
PREFILL_STEP = 2048  # mlx_lm.generate's prefill_step_size
KV_GROUP_SIZE = 64  # QuantizedKVCache's default group along each head's dims


@dataclasses.dataclass(frozen=True)
class Attention:
    """One layer's attention and its cache: the one description the spec, the cost model and the
    real executor's pool share. full / sliding: K and V rows of `heads` x `k_dim` and `heads` x
    `v_dim` per token; mla: heads=1, k_dim the latent (kv_lora_rank), v_dim the RoPE key; linear:
    ArraysCache's conv state in the activation dtype and recurrent state in float32, any length."""

    kind: str  # "full", "sliding", "linear" or "mla"
    heads: int = 0
    k_dim: int = 0
    v_dim: int = 0
    window: int = 0  # sliding: RotatingKVCache max_size
    keep: int = 0  # sliding: tokens RotatingKVCache never evicts
    conv_shape: tuple[int, ...] = ()  # linear: (kernel - 1, conv channels), without the batch
    state_shape: tuple[int, ...] = ()  # linear: (value heads, value dim, key dim)

    @property
    def conv_elems(self) -> int:
        return math.prod(self.conv_shape) if self.conv_shape else 0

    @property
    def state_elems(self) -> int:
        return math.prod(self.state_shape) if self.state_shape else 0

    def token_bytes(self, act_bytes: int, kv_bits: int | None = None) -> int:
        """One token's K and V (MLA: latent and RoPE key); with kv_bits, as QuantizedKVCache
        holds them: packed data plus a scale and a bias per group, in the activation dtype."""
        if kv_bits is None:
            return self.heads * (self.k_dim + self.v_dim) * act_bytes
        if self.kind != "full":
            raise ConfigError(f"kv_bits: mlx-lm cannot run a {self.kind} layer on a quantized "
                              f"cache ({_NOT_QUANTIZABLE[self.kind]})")
        return self.heads * sum(_quantized_row(d, act_bytes,
                                               kv_bits) for d in (self.k_dim, self.v_dim))


_NOT_QUANTIZABLE = {  # mlx-lm 0.32.2
    "sliding": "RotatingKVCache.to_quantized is not implemented",
    "mla": "DeepSeek's attention multiplies the cached RoPE key directly",
    "linear": "ArraysCache holds a state, not K/V",
}


def quantized_dims(dims: int, kv_bits: int) -> tuple[int, int]:
    """(uint32 words, groups) QuantizedKVCache packs a head row of `dims` elements into."""
    if dims % KV_GROUP_SIZE:
        raise ConfigError(f"kv_bits needs head_dim to be a multiple of {KV_GROUP_SIZE} (mlx-lm's "
                          f"KV group); it is {dims}")
    return dims * kv_bits // 32, dims // KV_GROUP_SIZE


def _quantized_row(dims: int, act_bytes: int, kv_bits: int) -> int:
    words, groups = quantized_dims(dims, kv_bits)
    return words * 4 + 2 * groups * act_bytes  # packed data, then a scale and a bias per group


def check_kv_bits(layers: Iterable[Attention], kv_bits: int) -> None:
    """Raises ConfigError if mlx-lm cannot quantize some layer's cache to kv_bits: the kind first
    (a sliding or MLA layer is refused whatever its dims), then widths, in layer order."""
    cached = [att for att in layers if att.kind != "linear"]
    for att in sorted(cached, key=lambda a: a.kind == "full"):
        att.token_bytes(1, kv_bits)


def cache_bytes(att: Attention, calls: list[int], act_bytes: int,
                kv_bits: int | None = None) -> int:
    """Bytes of this layer's cache after the model was called on chunks of `calls` tokens (with
    kv_bits, K/V caches quantized; ArraysCache states are never quantized by mlx-lm)."""
    if not calls:
        return 0
    if att.kind == "linear":
        return att.conv_elems * act_bytes + att.state_elems * STATE_BYTES
    if att.kind == "sliding":
        return _rotating_rows(calls, att.window, att.keep) * att.token_bytes(act_bytes, kv_bits)
    return _kv_rows(calls) * att.token_bytes(act_bytes, kv_bits)


def cache_layout(layers: Iterable[Attention], act_bytes: int,
                 kv_bits: int | None = None) -> CacheLayout:
    """The scheduler's pricing of these layers' caches: full and MLA bytes per token, sliding bytes
    per token by window, linear layers' fixed state."""
    full = state = 0
    windows: dict[int, int] = {}
    for att in layers:
        if att.kind == "linear":
            state += cache_bytes(att, [1], act_bytes)
        elif att.kind == "sliding":
            windows[att.window] = windows.get(att.window, 0) + att.token_bytes(act_bytes, kv_bits)
        elif att.kind in ("full", "mla"):
            full += att.token_bytes(act_bytes, kv_bits)
        else:
            raise ValueError(f"attention kind {att.kind!r} has no cache layout")
    return CacheLayout(full, tuple(sorted(windows.items())), state)


def _kv_rows(calls: list[int]) -> int:
    """KVCache: on overflow, cut back to the filled rows (if off-step) and add whole steps."""
    rows = offset = 0
    for n in calls:
        if offset + n > rows:
            if rows and offset % KV_STEP:
                rows = offset
            rows += -(-n // KV_STEP) * KV_STEP
        offset += n
    return rows


def _rotating_rows(calls: list[int], window: int, keep: int) -> int:
    """RotatingKVCache: multi-token calls concatenate (after trimming to window - 1), single
    tokens write in place, growing by steps up to the window, then trimming to it."""
    rows = offset = idx = 0
    for n in calls:
        if n > 1:
            if rows:
                ordered = idx if (idx != rows and idx >= offset) else rows
                rows = min(ordered, window - 1)  # trims to window - 1, keeping `keep` first rows
            rows += n
            offset += n
            idx = rows
            continue
        if rows == 0 or (offset >= rows and rows < window):
            rows += min(KV_STEP, window - offset)
            idx = offset
        if rows > window:
            rows, idx = window, window
        if idx == window:
            idx = keep
        offset += 1
        idx += 1
    return rows


def generate_calls(context_tokens: int, prefill_step: int = PREFILL_STEP) -> list[int]:
    """The calls mlx_lm.generate makes to hold `context_tokens`: the prompt but its last token in
    prefill_step chunks, then single tokens (the last prompt token is the first decode step)."""
    if context_tokens <= 0:
        return []
    head = context_tokens - 1
    whole, rest = divmod(head, prefill_step)
    chunks = [prefill_step] * whole + ([rest] if rest else [])
    return chunks + [1]
