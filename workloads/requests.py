"""Turn a WorkloadSpec into the concrete request list: arrival offsets and token lengths, seeded.

Arrival processes follow vLLM's `benchmarks/serve.py` `get_request`: gaps are
gamma(shape=burstiness, scale=1 / (rate * burstiness)), so the mean gap is 1/rate and the squared
coefficient of variation is 1/burstiness (burstiness 1 = Poisson, inf = constant). Like vLLM, the
fixed-rate processes ('poisson', 'gamma') are rescaled so the whole run spans exactly its nominal
length (the raw sums drift a few percent between seeds); 'ramp' is not rescaled. Unlike vLLM, the
first request arrives at t = 0 rather than after one gap.
"""

from __future__ import annotations

import dataclasses
import math
import sys
from typing import Any

import numpy as np
from batchsim.configs import ConfigError
from batchsim.server.results.jsonio import MAX_ARRIVAL_S
from batchsim.workloads.chat import ChatSpec, chat_token_ids, prompt_text
from batchsim.workloads.prefixes import (
    Segment,
    SharingSpec,
    segment_block_hashes,
    segment_token_ids,
    session_segments,
    trace_segments,
)
from batchsim.workloads.spec import TraceSpec, WorkloadSpec
from batchsim.workloads.traces import read_trace, scale_length


@dataclasses.dataclass(slots=True)  # not frozen: a run builds one per request, 4x faster so
class RequestSpec:
    index: int  # 0..n-1 in arrival order
    arrival_s: float  # offset from the run's start (0.0 for closed loop: the driver issues them)
    prompt_len: int  # prompt tokens
    output_len: int  # tokens to generate
    # The prompt as shared segments (workloads/prefixes.py); (): its own seeded random tokens.
    segments: tuple[Segment, ...] = ()


def _gamma_gaps(rng: np.random.Generator, shape: float, rates: np.ndarray) -> np.ndarray:
    if math.isinf(shape):  # the limit of gamma as the shape grows: every gap is its mean
        return 1.0 / rates
    return rng.gamma(shape, 1.0 / (rates * shape))


def _gaps(spec: WorkloadSpec, n_gaps: int, rng: np.random.Generator) -> np.ndarray:
    rate = spec.request_rate
    if spec.arrival == "constant":
        return np.full(n_gaps, 1.0 / rate)
    if spec.arrival in ("poisson", "gamma"):
        shape = spec.burstiness if spec.arrival == "gamma" else 1.0
        gaps = _gamma_gaps(rng, shape, np.full(n_gaps, rate))
        total = gaps.sum()
        # vLLM's rescaling: the run spans exactly n_gaps / rate, so throughput comparisons
        # between seeds and burstiness values see the same offered load.
        return gaps * (n_gaps / rate / total) if total > 0 else gaps
    if spec.arrival == "ramp":
        # vLLM's linear ramp-up: the rate is linear in the request index, from request_rate at the
        # first request to ramp_end_rate at the last; each gap is drawn at its request's rate
        # (exponential for burstiness 1, so an inhomogeneous Poisson process in index).
        assert spec.ramp_end_rate is not None
        rates = np.linspace(rate, spec.ramp_end_rate, n_gaps + 1)[1:]
        return _gamma_gaps(rng, spec.burstiness, rates)
    raise ConfigError(f"arrival {spec.arrival!r}: no synthetic arrival times (see build_requests)")


def arrival_times(spec: WorkloadSpec, n: int, rng: np.random.Generator) -> np.ndarray:
    """n non-decreasing arrival offsets in seconds, the first at 0. 'closed' and an infinite rate
    give all zeros."""
    if n <= 0:
        return np.zeros(0)
    if spec.arrival == "closed" or (spec.arrival != "ramp" and math.isinf(spec.request_rate)):
        return np.zeros(n)
    with np.errstate(over="ignore", invalid="ignore"):  # overflow: build_requests says so
        return np.concatenate([[0.0], np.cumsum(_gaps(spec, n - 1, rng))])


def _rngs(seed: int) -> tuple[np.random.Generator, ...]:
    # Independent streams, so changing the arrival process leaves the lengths unchanged (and back).
    return tuple(np.random.default_rng(s) for s in np.random.SeedSequence(seed).spawn(3))


def trace_length(trace: TraceSpec) -> int:
    """Rows from trace.start on: how many requests replaying the whole trace sends."""
    n = len(read_trace(trace.path, trace.format, trace.start))
    if n == 0:
        raise ConfigError(f"trace {trace.path!r}: no rows from row {trace.start}")
    return n


def trace_requests(trace: TraceSpec, num_prompts: int) -> list[RequestSpec]:
    """num_prompts requests from trace.start on, sorted by arrival, times and lengths scaled."""
    rows = read_trace(trace.path, trace.format, trace.start, num_prompts)
    if len(rows) < num_prompts:
        raise ConfigError(
            f"trace {trace.path!r}: only {len(rows)} rows from row {trace.start}, "
            f"but num_prompts is {num_prompts}"
        )
    rows = sorted(rows, key=lambda r: r.t_s)  # stable; production traces are already in order
    t0 = rows[0].t_s
    out = []
    for i, row in enumerate(rows):
        prompt_len = scale_length(row.input_len, trace.input_scale, trace.max_input_len)
        out.append(RequestSpec(
            index=i,
            arrival_s=(row.t_s - t0) * trace.time_scale,
            prompt_len=prompt_len,
            output_len=scale_length(row.output_len, trace.output_scale, trace.max_output_len),
            segments=trace_segments(row.hash_ids, trace.start + i, prompt_len, trace.input_scale),
        ))
    return out


def shared_requests(sharing: SharingSpec, seed: int,
                    requests: list[RequestSpec]) -> list[RequestSpec]:
    """The requests as chat-session turns after a shared system prompt: each drawn prompt length
    is its new user message, each output length its reply."""
    lengths = [(rs.prompt_len, rs.output_len) for rs in requests]
    out = []
    for rs in requests:
        segments = session_segments(sharing, seed, rs.index, lengths)
        out.append(dataclasses.replace(rs, prompt_len=sum(n for _, n in segments),
                                       segments=segments))
    return out


_YEAR_S = 365.25 * 86400
# What brings the last arrival in, per setting: a trace's rows are capped by num_prompts too.
_SOONER = {"request_rate": "a larger rate or fewer prompts (--num-prompts)",
           "trace.time_scale": "a smaller time scale or fewer prompts (--num-prompts)"}


def _check_finite(arrivals_s, key: str, value: float) -> None:
    """Arrivals past a float's range would never come, and past MAX_ARRIVAL_S the run's records
    are damage to `report` (it rebuilt such a run with fewer requests): one line naming the
    setting (`key`, a key of _SOONER) and what to change."""
    if not np.all(np.isfinite(arrivals_s)):
        raise ConfigError(f"{key} {value:g}: the last arrivals fall beyond "
                          f"{sys.float_info.max:.3g} s (a float's range); use {_SOONER[key]}")
    last_s = float(np.max(arrivals_s, initial=0.0))
    if last_s > MAX_ARRIVAL_S:
        raise ConfigError(f"{key} {value:g}: the last request arrives at {last_s:.3g} s, past the "
                          f"{MAX_ARRIVAL_S:.0e} s ({MAX_ARRIVAL_S / _YEAR_S:.0f} years) a "
                          f"workload's arrivals may span; use {_SOONER[key]}")


def build_requests(spec: WorkloadSpec) -> list[RequestSpec]:
    """The run's requests, deterministic in spec.seed and sorted by arrival_s. For 'trace' the
    arrivals and lengths come from the trace (scaled and capped by spec.trace)."""
    if spec.arrival == "trace":
        assert spec.trace is not None
        requests = trace_requests(spec.trace, spec.num_prompts)
        _check_finite([r.arrival_s for r in requests], "trace.time_scale", spec.trace.time_scale)
        return requests
    n = spec.num_prompts
    rng_arrival, rng_input, rng_output = _rngs(spec.seed)
    times = arrival_times(spec, n, rng_arrival)
    _check_finite(times, "request_rate", spec.request_rate)
    prompt = spec.input_len.sample(n, rng_input)
    output = spec.output_len.sample(n, rng_output)
    # Python floats and ints first (an element read from an array costs ~0.1 us each: 18,000
    # requests x 3); int() of what tolist() gives: the lengths' dtype may be float.
    requests = list(map(RequestSpec, range(n), times.tolist(), map(int, prompt.tolist()),
                        map(int, output.tolist())))
    return shared_requests(spec.sharing, spec.seed, requests) if spec.sharing else requests


def prompt_token_ids(seed: int, index: int, length: int, vocab_size: int) -> list[int]:
    """Seeded random prompt ids per request: the same workload gives the same prompts everywhere."""
    rng = np.random.default_rng([seed, index])
    return rng.integers(0, vocab_size, size=length).tolist()


def request_token_ids(seed: int, rs: RequestSpec, vocab_size: int) -> list[int]:
    """The request's prompt ids: its segments' tokens, else its own seeded random ones."""
    if rs.segments:
        return segment_token_ids(rs.segments, vocab_size)
    return prompt_token_ids(seed, rs.index, rs.prompt_len, vocab_size)


def request_block_hashes(rs: RequestSpec) -> tuple[int, ...] | None:
    """The simulator's block hashes of a request with segments (None: none shared, or the
    prefix cache works them out from the token ids)."""
    return segment_block_hashes(rs.segments) if rs.segments else None


def chat_requests(chat: ChatSpec, requests: list[RequestSpec],
                  tokenizer: Any) -> tuple[list[RequestSpec], dict[int, list[int]]]:
    """The requests with their real prompt lengths and the client's max_tokens, and the prompt
    token ids by request index."""
    if tokenizer is None:
        raise ConfigError("a chat workload sends text: it needs the model's tokenizer (run it with "
                          "--executor mlx, or against a server with --target)")
    ids = {rs.index: chat_token_ids(tokenizer, prompt_text(chat, rs.index)) for rs in requests}
    out = [dataclasses.replace(rs, prompt_len=len(ids[rs.index]), output_len=chat.max_tokens)
           for rs in requests]
    return out, ids


def sampling_seed(workload_seed: int, index: int) -> int:
    """A per-request sampling seed: the same workload samples the same replies."""
    return workload_seed * 1_000_003 + index
