"""A published figure predicted by simulating what its source ran. A decode-only figure is the
decode step at the row's batch and context; a figure that includes prefill (decode_only false) is
a closed loop of `batch` clients, each sending one request of the row's prompt and output lengths,
through the scheduler and the simulated executor on the virtual clock (`run --executor sim`), so
TTFT and prefill count as the source counted them.

A row is anything with PublishedRow's fields (server.perf.reference)."""

from __future__ import annotations

import dataclasses
from functools import lru_cache
from typing import Any, NamedTuple

from batchsim.server.engine.run_config import RunConfig
from batchsim.server.engine.runner import run_workload
from batchsim.server.engine.session import open_session
from batchsim.server.executors.sim_executor import SimExecutor
from batchsim.server.models.spec import ModelSpec, zoo_spec
from batchsim.server.perf import macs
from batchsim.server.perf.engines import EngineProfile, load_engine
from batchsim.server.perf.gpu_fit import GpuFit, mac_profile
from batchsim.server.perf.reference import (
    DEFAULT_GENERATED_TOKENS,
    DEFAULT_PROMPT_TOKENS,
    row_mac,
)
from batchsim.server.perf.stepcost import StepCost, StepTime
from batchsim.workloads.lengths import LengthSpec
from batchsim.workloads.prefixes import SharingSpec
from batchsim.workloads.spec import WorkloadSpec

UNSTATED_MEMORY_GB = 512.0  # a row without its Mac's memory: room for any model in the set


class HostPrior(NamedTuple):
    """The pooled host costs of the fitted engines of one kind (their mean)."""

    host_step_us: float
    host_token_us: float
    engines: int  # how many fitted engines it pools

    def describe(self) -> str:
        return (f"{self.host_step_us:.0f} us per step + {self.host_token_us:.0f} per token "
                f"(pooled over {self.engines} engines)")


def engine_name(row: Any) -> str:
    """The engine profile (configs/engines) of what the row's source ran: the row's engine, vllm-mlx
    streamed through its server as vllm-mlx-server, mlx-lm at batch > 1 as mlx-lm-batch
    (mlx_lm.benchmark -b B runs batch_generate: the BatchGenerator loop)."""
    if row.engine == "mlx-lm" and row.batch > 1:
        return "mlx-lm-batch"
    return "vllm-mlx-server" if row.engine == "vllm-mlx" and row.streamed else row.engine


@dataclasses.dataclass(frozen=True)
class MacModel:
    """What predicts a published row: the GPU step's terms, the engines' host costs and, for an
    engine absent here, its kind's prior (none: no host time; never a value fitted on rows held
    out)."""

    fit: GpuFit
    engines: dict[str, EngineProfile] = dataclasses.field(default_factory=dict)
    priors: dict[str, HostPrior] = dataclasses.field(default_factory=dict)  # by engine kind

    def engine(self, name: str) -> EngineProfile:
        if name in self.engines:
            return self.engines[name]
        base = load_engine(name)
        prior = self.priors.get(base.kind, HostPrior(0.0, 0.0, 0))
        basis = (f"no rows in the fit: the {base.kind} prior, {prior.describe()}"
                 if prior.engines else "no rows in the fit, no prior: none")
        return dataclasses.replace(base, host_step_us=prior.host_step_us,
                                   host_token_us=prior.host_token_us, host_request_us=0.0,
                                   row_dispatch_forwards=0.0, host_basis=basis)

    def prior_of(self, name: str) -> str | None:
        """The engine kind whose prior prices `name` (None: fitted here, or no prior)."""
        kind = load_engine(name).kind
        return kind if name not in self.engines and kind in self.priors else None

    def engine_of(self, row: Any) -> EngineProfile:
        """The engine as the row's source ran it (its version's batching, its harness's
        sampler and top-p)."""
        engine = self.engine(engine_name(row)).at_version(row.engine_version)
        harness = {k: v for k in ("sampler", "top_p") if (v := getattr(row, k)) is not None}
        return dataclasses.replace(engine, **harness) if harness else engine


def tokens(row: Any) -> tuple[int, int]:
    """(prompt, generated) tokens per request; a short chat turn where the source does not say."""
    prompt = DEFAULT_PROMPT_TOKENS if row.prompt_tokens is None else row.prompt_tokens
    out = DEFAULT_GENERATED_TOKENS if row.generated_tokens is None else row.generated_tokens
    return prompt, out


def context_tokens(row: Any) -> int:
    """The mean context a decode step of the row's run reads: prompt plus half the output."""
    prompt, out = tokens(row)
    return prompt + out // 2


@lru_cache(maxsize=64)
def model_spec(model: str) -> ModelSpec:
    return zoo_spec(model)


def stagger_steps(batch: int, out: int) -> tuple[tuple[int, int], ...]:
    """(rows decoding, steps) of a run whose `batch` rows join the decode one step apart and
    each decode `out` tokens: request i decodes steps i .. i + out - 1, so out + batch - 1 steps
    ramp up and down through 1..batch rows (batch 4, 128 tokens: 1, 2, 3, 125 x 4, 3, 2, 1)."""
    counts: dict[int, int] = {}
    for s in range(out + batch - 1):
        rows = min(s, batch - 1) - max(0, s - out + 1) + 1
        counts[rows] = counts.get(rows, 0) + 1
    return tuple(sorted(counts.items()))


def decode_step(row: Any, cost: StepCost) -> StepTime:
    """A decode-only row's seconds per step as measured_s counts them (its timed window over the
    tokens each request decodes): the step at the row's batch, or, a staggered row, every step of
    its ramp (stagger_steps) over the tokens one request decodes."""
    width = context_tokens(row)
    if not row.staggered:
        return cost.step_time(row.batch, width)
    out = tokens(row)[1]
    parts = [cost.step_time(rows, width).times(n) for rows, n in stagger_steps(row.batch, out)]
    return sum(parts[1:], parts[0]).times(1.0 / out)


def row_cost(row: Any, catalog: macs.Catalog, model: MacModel) -> StepCost:
    mac = row_mac(catalog, row.chip, row.gpu_cores)
    profile = mac_profile(mac, model.fit, row.quantize_bits)
    if row.mlx_version:  # the MLX the source ran chose its kernels
        profile = dataclasses.replace(profile, mlx_version=row.mlx_version)
    return StepCost(model_spec(row.model), profile, row.dtype, row.quantize_bits,
                    engine=model.engine_of(row))


def measured_s(row: Any) -> float:
    """The seconds the row's figure stands for: one decode step (decode only), else the run."""
    per_stream = row.tok_s / row.batch if row.measures == "aggregate" else row.tok_s
    return 1.0 / per_stream if row.decode_only else tokens(row)[1] / per_stream


def mixed(row: Any) -> tuple[tuple[float, Any], ...]:
    """(share of the time, row as simulated) of the runs the row's figure mixes: a row whose
    server started a share of its requests from the cached prompt is that share of a cached run's
    time and the rest of a cold one's (exact where requests run one at a time); else itself."""
    share = row.cached_share
    if share is None:
        return ((1.0, row),)
    return ((share, dataclasses.replace(row, prompt_cached=True, cached_share=None)),
            (1.0 - share, dataclasses.replace(row, cached_share=None)))


def predict_tok_s(row: Any, catalog: macs.Catalog, model: MacModel) -> float:
    """The row's figure (per request or aggregate, as it measures) by the simulated run."""
    if row.cached_share is not None:  # time mixes: the rates' weighted harmonic mean
        return 1.0 / sum(w / predict_tok_s(r, catalog, model) for w, r in mixed(row))
    cost = row_cost(row, catalog, model)
    if row.decode_only:
        per_stream = 1.0 / decode_step(row, cost).total_s
    else:
        records = measured_records(row, _run(row, cost).requests)
        gen = tokens(row)[1]
        if row.measures == "aggregate":
            span_s = max(r.finished_s for r in records) - min(r.arrival_s for r in records)
            return len(records) * gen / span_s
        per_stream = sum(gen / (r.finished_s - r.arrival_s) for r in records) / len(records)
    return per_stream * row.batch if row.measures == "aggregate" else per_stream


# A row whose server held its prompt from the run before (prompt_cached): the measured round
# starts this long after a first round of the same prompts (the clients' think time: an idle gap).
CACHED_ROUND_GAP_S = 1000.0


def _workload(row: Any) -> WorkloadSpec:
    prompt, out = tokens(row)
    fixed = LengthSpec("fixed", value=out)
    if row.prompt_cached:  # the same prompt (a last token of its own), sent twice per client
        return WorkloadSpec(name=f"published-{row.batch}-cached", num_prompts=2 * row.batch,
                            arrival="closed", concurrency=row.batch,
                            think_time_s=CACHED_ROUND_GAP_S, input_len=LengthSpec("fixed", value=1),
                            output_len=fixed, sharing=SharingSpec(system_tokens=prompt - 1))
    return WorkloadSpec(name=f"published-{row.batch}", num_prompts=row.batch, arrival="closed",
                        concurrency=row.batch, input_len=LengthSpec("fixed", value=prompt),
                        output_len=fixed)


def measured_records(row: Any, records: list) -> list:
    """The requests the row's figure counts: a prompt_cached row's second round."""
    return [r for r in records if r.request_id >= row.batch] if row.prompt_cached else records


def _run(row: Any, cost: StepCost, on_step=None):
    wl = _workload(row)
    cfg = RunConfig(model=row.model, dtype=row.dtype, quantize=row.quantize_bits, executor="sim",
                    memory_gb=row.memory_gb or UNSTATED_MEMORY_GB, workload=wl)
    cache = cost.spec.cache_layout(cost.act_dtype, None)
    session = open_session(cfg, executor=SimExecutor(cost, cache=cache))
    outcome = run_workload(session, wl, out_dir=None, label="published", on_step=on_step)
    if outcome.interrupted:  # a Ctrl-C (or one Python swallowed before) the run counted and
        raise KeyboardInterrupt  # stopped on: fit-macs's, not a row's figure cut short
    return outcome


# -- the run as priced steps, for the fit ----------------------------------------------------------
class PrefillGroup(NamedTuple):
    """A plan's prefill chunks priced as one forward (prefill_groups.py)."""

    tokens: int  # each chunk's
    start: int  # cached tokens before each chunk
    sample: bool  # the chunks sample a token
    rows: int  # chunks
    started: int  # rows sampling their request's first token (they pay host_request_us)


class Step(NamedTuple):
    """One plan of a simulated run, as the cost model prices it."""

    prefills: tuple[PrefillGroup, ...]
    decode_rows: int
    first_width: int  # context of the first decode step; each further one reads one more
    num_steps: int  # decode steps the plan covers
    joined: int = 0  # new requests whose decode row samples their first token (one-token prompts)


def _steps_of(plan: Any, num_steps: int) -> Step:
    from batchsim.scheduler import prefill_groups

    groups = tuple(PrefillGroup(g[0].num_tokens, g[0].start, g[0].sample, len(g),
                                sum(c.fresh for c in g))
                   for g in prefill_groups.groups(list(plan.prefills)))
    width = max(plan.decode_positions) + 1 if plan.decode_ids else 0
    return Step(groups, len(plan.decode_ids), width, num_steps if plan.decode_ids else 0,
                plan.num_joined_directly)


_RUN_STEPS: dict[Any, tuple[Step, ...]] = {}


def run_steps(row: Any, catalog: macs.Catalog, model: MacModel) -> tuple[Step, ...]:
    """The plans of the row's closed-loop run. They do not depend on the step times (every client
    sends at once, no arrival follows), so one run under any fit serves them all."""
    if row not in _RUN_STEPS:
        steps: list[Step] = []
        first = row.batch if row.prompt_cached else 0  # the requests measured_records counts

        def record(engine, plan, result) -> None:
            ids = [*plan.decode_ids, *(c.request_id for c in plan.prefills)]
            if any(i >= first for i in ids):
                steps.append(_steps_of(plan, len(result.step_durations_s)))

        _run(row, row_cost(row, catalog, model), on_step=record)
        _RUN_STEPS[row] = tuple(steps)
    return _RUN_STEPS[row]


class Priced(NamedTuple):
    """A row's predicted seconds (as measured_s counts them) in parts."""

    decode: StepTime  # decode forwards, and every step's host work
    prefill: StepTime  # prefill forwards


def priced(row: Any, catalog: macs.Catalog, model: MacModel) -> Priced:
    """The parts of the row's predicted seconds under `model` (a plan's decode steps at their
    mean width: exact for dense models, close for windows)."""
    zero = StepTime(0.0, 0.0, 0.0, 0.0, 0.0, 0.0)
    if row.cached_share is not None:
        parts = [(w, priced(r, catalog, model)) for w, r in mixed(row)]
        return Priced(*(sum((p[k].times(w) for w, p in parts), zero) for k in (0, 1)))
    cost = row_cost(row, catalog, model)
    if row.decode_only:
        return Priced(decode_step(row, cost), zero)
    decode, prefill, steps = zero, zero, 0
    for s in run_steps(row, catalog, model):
        prefill = _add_prefills(prefill, cost, s)
        if s.num_steps:
            one = cost.decode_time(s.decode_rows, s.first_width + (s.num_steps - 1) // 2)
            decode += one.times(s.num_steps)
        steps += s.num_steps or (1 if s.prefills else 0)
    host = StepTime(0.0, 0.0, 0.0, 0.0, 0.0, steps * cost.device_overhead_s,
                    host_step_s=steps * cost.engine.host_step_s)
    return Priced(decode + host, prefill)


def _add_prefills(total: StepTime, cost: StepCost, step: Step) -> StepTime:
    """`total` and the step's prefill chunks (added one by one, as before), with the engine's cost
    of each request it starts paid once (a recompute's sampling chunk does not pay it; a
    one-token prompt's decode row does)."""
    for n, start, sample, rows, started in step.prefills:
        total += cost.prefill_time(n, start, sample, rows, started)
    if step.joined:
        total += StepTime(0.0, 0.0, 0.0, 0.0, 0.0, 0.0,
                          host_request_s=cost.engine.joined_s(step.joined))
    return total
