"""Scheduler limits (user settings and their defaults) and the full config a Scheduler runs on.
Frozen: nothing writes to config at run time."""

from __future__ import annotations

import dataclasses
from typing import Literal

from batchsim.scheduler.kv_bytes import CacheLayout
from batchsim.scheduler.pool_geometry import KV_STEP
from batchsim.scheduler.spec_budget import SPEC_POLICIES

MAX_SPEC_TOKENS = 32  # drafted tokens per row and step

Policy = Literal["decode-first", "prefill-first"]
KVLayout = Literal["padded", "paged"]
KV_LAYOUTS: tuple[str, ...] = ("padded", "paged")
OnOff = Literal["on", "off"]


@dataclasses.dataclass(frozen=True)
class SchedulerSettings:
    """The limits a user sets (a run config's `scheduler:` section, CLI flags). Their defaults live
    here only: SchedulerConfig, RunConfig and every command's flags read them from this class."""

    # Largest batch: requests running at once.
    max_num_seqs: int = 32
    # Tokens one step may compute (prefill chunks + one per decoding request).
    max_num_batched_tokens: int = 2048
    # Prefill chunk; a multiple of KV_STEP so a prefilling cache holds exactly round_up(tokens).
    prefill_step_size: int = 512
    # decode-first: every step decodes all running requests and fills the rest of the token budget
    # with prefill chunks. prefill-first: a step with prefill work does only prefill.
    policy: Policy = "decode-first"
    # Pool rows grow in powers of two up to this, then in multiples of it.
    row_step: int = 8
    # Speculative decoding: drafted tokens a decode row may verify per step (0: off), and how K
    # follows the batch (scheduler/spec_budget.py: shrink or fixed).
    spec_tokens: int = 0
    spec_policy: str = "shrink"
    # Reuse the KV of cached prompt blocks (scheduler/prefix_cache.py); models with sliding or
    # linear-attention layers, and quantized KV, prefill in full whatever this says.
    prefix_cache: OnOff = "on"

    def __post_init__(self) -> None:  # run and serve refuse the same values, real or simulated
        _check(_limit_checks(self))


def _limit_checks(s: SchedulerSettings | SchedulerConfig) -> list[tuple[bool, str]]:
    """The rules on each limit a user sets (SchedulerSettings and SchedulerConfig share them)."""
    return [
        (s.max_num_seqs >= 1, "max_num_seqs must be >= 1"),
        (s.prefill_step_size >= KV_STEP and s.prefill_step_size % KV_STEP == 0,
         f"prefill_step_size must be a positive multiple of {KV_STEP}"),
        (s.policy in ("decode-first", "prefill-first"),
         "policy must be 'decode-first' or 'prefill-first'"),
        (s.row_step >= 1, "row_step must be >= 1"),
        (0 <= s.spec_tokens <= MAX_SPEC_TOKENS,
         f"spec_tokens must be in 0..{MAX_SPEC_TOKENS}, got {s.spec_tokens}"),
        (s.spec_policy in SPEC_POLICIES,
         f"spec_policy must be one of {', '.join(SPEC_POLICIES)}, got {s.spec_policy!r}"),
        (s.prefix_cache in ("on", "off"), "prefix_cache must be on or off"),
    ]


def _check(checks: list[tuple[bool, str]]) -> None:
    for ok, message in checks:
        if not ok:
            raise ValueError(message)


_DEFAULT = SchedulerSettings()


@dataclasses.dataclass(frozen=True)
class SchedulerConfig:
    """SchedulerSettings plus what the session knows (KV budget, model shape, executor)."""

    # KV bytes available: the memory budget minus the weights.
    kv_budget_bytes: int
    # K and V each further token adds (dense: 2 x layers x kv_heads x head_dim x dtype bytes;
    # others: the full-attention and MLA layers, as cache_layout.full_token_bytes).
    kv_bytes_per_token: int
    # Longest prompt + output the model accepts.
    max_model_len: int
    # The limits, as in SchedulerSettings (defaults from there).
    max_num_seqs: int = _DEFAULT.max_num_seqs
    max_num_batched_tokens: int = _DEFAULT.max_num_batched_tokens
    prefill_step_size: int = _DEFAULT.prefill_step_size
    policy: Policy = _DEFAULT.policy
    row_step: int = _DEFAULT.row_step
    spec_tokens: int = _DEFAULT.spec_tokens
    spec_policy: str = _DEFAULT.spec_policy
    # Not the same as reuse_prefixes: what the user asked (--prefix-cache), kept as asked for the
    # run's config.yaml; the scheduler reads reuse_prefixes, never this.
    prefix_cache: OnOff = _DEFAULT.prefix_cache
    # Pure-decode steps one plan may cover (1 for real execution; more lets a simulator skip ahead).
    max_lookahead_steps: int = 1
    # What the cache holds by layer kind (sliding windows, fixed states); None: dense, every layer
    # grows by kv_bytes_per_token. Its full_token_bytes must equal kv_bytes_per_token.
    cache_layout: CacheLayout | None = None
    # How the decode pool holds full-attention and MLA layers: padded rows, or paged blocks.
    kv_layout: KVLayout = "padded"
    # Whether the scheduler reuses cached prompt blocks: the session's answer to `prefix_cache`
    # for this model, False where reuse cannot apply whatever was asked (a sliding-window or
    # linear-attention layer, or quantized KV: every layer must be full attention or MLA at full
    # precision); never True while prefix_cache is off.
    reuse_prefixes: bool = False

    def __post_init__(self) -> None:
        checks = [
            (self.kv_bytes_per_token > 0, "kv_bytes_per_token must be > 0"),
            (self.max_model_len > 0, "max_model_len must be > 0"),
            *_limit_checks(self),
            (self.max_num_batched_tokens >= max(self.prefill_step_size, self.max_num_seqs),
             "max_num_batched_tokens must be >= prefill_step_size and >= max_num_seqs"),
            (self.max_lookahead_steps >= 1, "max_lookahead_steps must be >= 1"),
            (self.kv_layout in KV_LAYOUTS, f"kv_layout must be one of {', '.join(KV_LAYOUTS)}"),
            (not self.reuse_prefixes or (self.prefix_cache == "on" and self.layout.all_full),
             "reuse_prefixes needs prefix_cache on and every layer full attention or MLA"),
        ]
        if self.cache_layout is not None:
            checks[0] = (self.cache_layout.full_token_bytes == self.kv_bytes_per_token,
                         "kv_bytes_per_token must equal the cache layout's full_token_bytes")
        _check(checks)

    @property
    def layout(self) -> CacheLayout:
        """The cache layout the budget is priced by."""
        return self.cache_layout or CacheLayout.dense(self.kv_bytes_per_token)
