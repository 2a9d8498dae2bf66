"""Serving-engine profiles (configs/engines/NAME.yaml): what an engine costs on the host beyond
the device's forward passes (per step, per generated token: scheduling, sampling, detokenizing,
streaming; per request) and what it batches. The step cost (server.perf.stepcost) prices every
step with one; `batchsim` (this project's own engine) is the default. Pure Python, data only: the
numbers live in the YAML files, where a fit may overwrite them."""

from __future__ import annotations

import dataclasses
import math
import re
from functools import lru_cache
from typing import NamedTuple

from batchsim.configs import CONFIG_DIR, ConfigError, from_dict, load_yaml
from batchsim.server.models.spec import dtype_bytes

ENGINES_DIR = CONFIG_DIR / "engines"
DEFAULT_ENGINE = "batchsim"
ENGINE_KINDS = ("", "server", "library")  # kind: whose pooled host costs are an engine's prior
SAMPLERS = ("batched", "per_row")  # one sampler call over the batch's logits, or one per row


@dataclasses.dataclass(frozen=True)
class EngineProfile:
    """One serving engine's host costs and batching, as the step cost reads them."""

    name: str  # the file's stem: what --engine takes
    host_step_us: float  # host work per engine step (scheduling, graph building, hand-off)
    host_token_us: float  # host work per generated token (sampling, detokenizing, streaming)
    # Host work per request, once before its first token (an HTTP server's request parsing,
    # chat templating, tokenizing, hand-off): priced on the prefill chunk that samples a request's
    # first token, or a one-token prompt's first decode step (StepPlan.num_joined_directly), in
    # its TTFT, serially, as a step's other host work. No shipped profile sets it: fitted per
    # engine on the published rows that count TTFT (commit a69c817's variant B:
    # mlx-inference-server 94 ms a request), it left held-out medians
    # worse (h5, 2026-12-05), so `fit-macs` keeps to per-step and per-token costs; a profile of
    # your own server may set a measured one. A preempted request's recompute does not pay it
    # again (PrefillChunk.fresh).
    host_request_us: float = 0.0
    # False: every request runs alone, one row at a time (a B-row step costs B one-row passes).
    batches: bool = True
    # Architectures (mlx-lm model_type) it runs one row at a time even when it batches others.
    serial_model_types: tuple[str, ...] = ()
    # True: those one-row forwards are built as one graph per row and evaluated together (they
    # share each layer's weight reads; each row pays the forward's fixed cost); False: one after
    # another.
    serial_rows_together: bool = False
    # The engine version from which it batches an architecture of serial_model_types.
    batched_since: dict[str, str] = dataclasses.field(default_factory=dict)
    # True: its batched forward runs attention one sequence at a time (a loop over the rows),
    # each decode row past the first costing row_dispatch_forwards x one forward's dispatch with
    # every layer at the reference layer's (StepCost.loop_dispatch_s: the loop repeats each
    # layer's attention, not its FFN or MoE block, which run batched); fitted.
    attention_loop: bool = False
    row_dispatch_forwards: float = 0.0
    # server (HTTP requests, streaming) or library (an in-process loop): an engine the Mac fit has
    # no rows of gets its kind's prior, the pooled host costs of the fitted engines of that kind;
    # "" (none): zero host costs.
    kind: str = ""
    # batched: the step's rows sampled by one call (no per-row sampling cost); per_row: a sampler
    # call per sampled row, each paying the device's fitted sampling_row_us.
    sampler: str = "batched"
    # The sampler's nucleus (top-p), with temperature > 0 (mlx-lm's make_sampler ignores top_p at
    # temperature 0): under 1, mlx-lm's sample_utils.apply_top_p argsorts every sampled row's
    # whole vocabulary each step, one call over the batch or one per row alike
    # (top_p_bytes_per_logit prices its traffic); None: no top-p filter (greedy or unstated).
    top_p: float | None = None
    # Whose top-p code it runs (TOP_P_CODES: its passes over each sampled row's vocabulary), and
    # the engine version it came in (before it: mlx-lm's apply_top_p; "": always).
    top_p_code: str = "mlx-lm"
    top_p_code_since: str = ""
    host_basis: str = ""  # how the fit set the host costs: its rows, and the prior it used
    version: str = ""  # the engine version the numbers describe
    source: str = ""  # the published measurements the numbers come from, or why they are zero
    note: str = ""

    def __post_init__(self) -> None:
        for key in ENGINE_LIMITS:  # finite here: StepCost's copy is scaled by a host_scale
            value = getattr(self, key)
            if not 0 <= value < math.inf:
                raise ValueError(_past_limit(key, value))
        if self.kind not in ENGINE_KINDS:
            raise ValueError(f"kind must be one of {', '.join(ENGINE_KINDS)} or empty, "
                             f"got {self.kind!r}")
        if self.sampler not in SAMPLERS:
            raise ValueError(f"sampler must be one of {', '.join(SAMPLERS)}, got {self.sampler!r}")
        if self.top_p is not None and not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_p_code not in TOP_P_CODES:
            raise ValueError(f"top_p_code must be one of {', '.join(TOP_P_CODES)}, "
                             f"got {self.top_p_code!r}")
        since = self.top_p_code_since
        if since and not re.fullmatch(r"\d+(\.\d+)*([-+.]\w+)*", since):
            raise ValueError(f"top_p_code_since must be a version such as '0.6.83', "
                             f"got {self.top_p_code_since!r}")

    def serial_for(self, model_type: str) -> bool:
        """Whether this engine runs a model of `model_type` one row at a time."""
        return not self.batches or model_type in self.serial_model_types

    def at_version(self, version: str | None) -> EngineProfile:
        """This profile as the engine ran at `version` (None: as written): the architectures it
        batched by then leave serial_model_types."""
        if version is None:
            return self
        ran = _release(version)
        serial = tuple(t for t in self.serial_model_types
                       if t not in self.batched_since or ran < _release(self.batched_since[t]))
        code = ("mlx-lm" if self.top_p_code_since and ran < _release(self.top_p_code_since)
                else self.top_p_code)
        if serial == self.serial_model_types and code == self.top_p_code:
            return self
        return dataclasses.replace(self, serial_model_types=serial, top_p_code=code)

    def batching_note(self) -> str:
        """What it batches, in words (size --explain): '' for an engine batching everything."""
        notes = [] if self.batches else ["runs one request at a time"]
        if self.batches and self.serial_model_types:
            how = ("as one-row graphs evaluated together (weights read once, each row's forward "
                   "fixed cost)" if self.serial_rows_together else "one row at a time")
            notes.append(f"{', '.join(self.serial_model_types)} {how}")
        if self.sampler == "per_row":
            notes.append("a sampler call per row")
        if self.attention_loop:
            notes.append(f"attention one sequence at a time ({self.row_dispatch_forwards:.2f} "
                         f"forwards' layer dispatch per decode row past the first)")
        return "".join(f"; {n}" for n in notes)

    def sampler_bytes_per_logit(self, vocab: int, dtype: str) -> float:
        """Memory traffic the sampler adds per logit of every sampled row whose logits are
        `dtype` (0: none priced)."""
        if self.top_p is None or self.top_p >= 1:
            return 0.0
        return top_p_bytes_per_logit(vocab, dtype, TOP_P_CODES[self.top_p_code])

    @property
    def host_step_s(self) -> float:
        return self.host_step_us * 1e-6

    @property
    def host_token_s(self) -> float:
        return self.host_token_us * 1e-6

    @property
    def host_request_s(self) -> float:
        return self.host_request_us * 1e-6

    def joined_s(self, joined: int) -> float:
        """host_request_s of `joined` new one-token prompts, which join the decode pool with no
        prefill chunk: their decode row samples their first token, so that step pays it."""
        return joined * self.host_request_s


# MLX's Metal sort (mlx/backend/metal/sort.cpp, 0.31-0.32): a row longer than one threadgroup's
# bn * tn = 512 * 4 values is sorted in blocks of SORT_BLOCK (each value read, value and uint32
# index written), then merged in ceil(log2(blocks)) passes, each reading and writing both; an
# argsort copies its indices out.
SORT_BLOCK = 2048
INDEX_BYTES = 4  # uint32 sort indices
MASK_BYTES = 1  # MLX's bool


class TopPCode(NamedTuple):
    """A top-p sampler's passes over a sampled row's vocabulary besides its sort: reads and writes
    per logit, of values (the width it works in), uint32 indices and bool masks; and the logit
    dtypes it casts to float32 first (one read and a 4-byte write), then sorting and working in
    float32; any other dtype it sorts and works in as it came."""

    casts: tuple[str, ...]
    value_passes: int
    index_passes: int
    mask_passes: int = 0


# MLX's random.categorical uncompiled (mlx/random.cpp, 0.31-0.32: bits, then uniform's divide,
# minimum, multiply and add, gumbel's log, negative, log, negative, the add to the logits, argmax),
# as (values, indices): (19, 2).
CATEGORICAL_PASSES = (19, 2)
TOP_P_CODES = {
    # mlx-lm sample_utils (0.28-0.31) apply_top_p, as (values, indices) read or written: exp
    # (2, 0), take_along_axis (2, 1), cumsum (2, 0), zeros_like and arange (0, 2), put_along_axis
    # (0, 5: the zeros copied, indices and updates read, scattered), the inverse take_along_axis
    # (2, 1), where (3, 0); then categorical_sampling, mx.compile'd: uniform bits (0, 1), Gumbel
    # noise added to the tempered logits (2, 1), argmax (1, 0). None fuses: a gather, scan,
    # scatter or sort ends an mx.compile graph's fused elementwise run. In the model's dtype.
    "mlx-lm": TopPCode((), 14, 11),
    # mlx-swift-lm's TopPSampler (ekryski/mlx-swift-lm 137bd31, Libraries/MLXLMCommon/
    # Evaluate.swift:305, no MLX.compile): bfloat16 logits cast to float32 (:328, `if logits.dtype
    # == .bfloat16`: float16 logits stay float16), logSoftmax (3 values: logsumexp read, subtract),
    # applyTopP: argSort, takeAlong (2, 1), exp (2), cumsum (2), the compare (1 value, 1 mask),
    # where (2, 1 mask), putAlong of the filtered values back into a copy of logprobs (4, 1); the
    # scale by 1 / temp (2) and MLX's categorical uncompiled.
    "mlx-swift-lm": TopPCode(("bfloat16",),
                             3 + 2 + 2 + 2 + 1 + 2 + 4 + 2 + CATEGORICAL_PASSES[0],
                             1 + 1 + CATEGORICAL_PASSES[1], 1 + 1),
    # Rapid-MLX's fused sampler (raullenchai/Rapid-MLX PR #542, commit 06635d0, v0.6.83 through
    # 0.10.5, vllm_mlx/_sampler_fast_path.py; one Python function, uncompiled): the cast of any
    # non-float32 logits to float32, exp (2), argsort, two take_along_axis in sorted space (4, 2),
    # cumsum (2), arange == vocab - 1 (0, 2 indices: written, read; 1 mask), cumulative > 1 - top_p
    # (1, 1 mask), the `|` (3 masks), the scale by 1 / temp (2), where (2, 1 mask), MLX's
    # categorical uncompiled. More bytes than mlx-lm's chain (uncompiled, float32): what the PR
    # measured it saves, the closures' Python dispatch and the inverse-permutation scatter's GPU
    # time (its docstring: ~0.9 ms and ~3.3 ms a token on an M3 Ultra), is no memory traffic this
    # prices. Its arange == vocab - 1 mask is built once a call, priced here per row (9 B a
    # logit too many for each row of a call past the first), and top_k > 0 adds mask passes not
    # counted; no shipped row hits either (the rows at 0.6.83+ are batch 1, their harness top_k 0).
    "rapid-mlx-fused": TopPCode(("float16", "bfloat16"),
                                2 + 4 + 2 + 1 + 2 + 2 + CATEGORICAL_PASSES[0],
                                2 + 2 + CATEGORICAL_PASSES[1], 1 + 1 + 3 + 1),
}


def top_p_bytes_per_logit(vocab: int, dtype: str,
                          code: TopPCode = TOP_P_CODES["mlx-lm"]) -> float:
    """Bytes a top-p sampler (`code`: mlx-lm's unless named) moves per logit of a sampled row
    whose logits are `dtype` (mlx-lm samples the model's dtype: generate.py at a790972,
    line 540, `logprobs = logits - logsumexp(logits)` with no cast, and its heads return the
    activation dtype): MLX's argsort of the row and the sampler's other passes. Their time is
    StepTime.top_p_s (StepCost.top_p_s, GpuFit.top_p_slowdown)."""
    value_bytes = dtype_bytes(dtype)
    work = 4 if dtype in code.casts else value_bytes
    cast = value_bytes + work if dtype in code.casts else 0
    passes = math.ceil(math.log2(max(math.ceil(vocab / SORT_BLOCK), 1)))
    pair = work + INDEX_BYTES
    sort = (work + pair) + passes * 2 * pair + 2 * INDEX_BYTES
    return (cast + sort + code.value_passes * work + code.index_passes * INDEX_BYTES
            + code.mask_passes * MASK_BYTES)


def _release(version: str) -> tuple[int, ...]:
    """'0.7.0-beta.1' -> (0, 7, 0, 1): every number, in order (a final release after its betas is
    not ordered: name the build that first batched)."""
    return tuple(int(x) for x in re.findall(r"\d+", version))


def engine_names() -> list[str]:
    return sorted(p.stem for p in ENGINES_DIR.glob("*.yaml"))


def engine_help() -> str:
    """The --engine flag's help, for every command that takes it."""
    return (f"serving engine whose host costs and batching the simulated step prices "
            f"(configs/engines: {', '.join(engine_names())}); a real run records it")


# Each number's limits in a profile (>= 0, at most this), past any engine (shipped host costs are
# under 1.1 ms; row_dispatch_forwards is fitted, configs/reference/mlx-fit.yaml): a typo such as a
# request's 2e15 us (63 years) ran a run whose clock `report` then read as damage (records past
# jsonio.MAX_CLOCK_S), 1e300 overflowed. The maximum is a file's (load_engine): a StepCost's
# copy, scaled by the device's host_scale (at most profile.MAX_HOST_SCALE), may pass it.
ENGINE_LIMITS = {"host_step_us": 1e7, "host_token_us": 1e7, "host_request_us": 1e7,
                 "row_dispatch_forwards": 1e3}


def _past_limit(key: str, value: float) -> str:
    """One message for both checks: an engine file's (the bound) and EngineProfile's (finite,
    its copy scaled by a device's host_scale may pass the bound)."""
    return (f"{key} must be >= 0 and at most {ENGINE_LIMITS[key]:g} (finite once scaled by a "
            f"device's host_scale), got {value:g}")


@lru_cache(maxsize=32)
def load_engine(name: str | None = None) -> EngineProfile:
    """The engine profile `name` names (None: the default); an unknown name is a one-line error
    listing the known ones."""
    name = DEFAULT_ENGINE if name is None else name  # "" is no name (it priced batchsim)
    path = ENGINES_DIR / f"{name}.yaml"
    if "/" in name or not path.is_file():
        raise ConfigError(f"unknown engine {name!r}; known: {', '.join(engine_names())}")
    profile = from_dict(EngineProfile, {**load_yaml(path), "name": name}, str(path))
    for key, most in ENGINE_LIMITS.items():
        if getattr(profile, key) > most:
            raise ConfigError(f"{path}: {_past_limit(key, getattr(profile, key))}")
    return profile
