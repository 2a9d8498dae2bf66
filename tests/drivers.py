"""Synchronous drivers that feed requests to a scheduler by step index (no asyncio, no clock)."""

from __future__ import annotations

import random
import threading
from dataclasses import dataclass, field

from batchsim.scheduler.config import SchedulerConfig
from batchsim.scheduler.plan import StepPlan
from batchsim.scheduler.request import Request, SamplingParams
from batchsim.scheduler.scheduler import Scheduler
from hypothesis import strategies as st


@dataclass
class Trace:
    plans: list[StepPlan] = field(default_factory=list)
    admitted: list[int] = field(default_factory=list)  # first admissions, in order
    requests: dict[int, Request] = field(default_factory=dict)
    steps: int = 0


def make_request(rid: int, prompt_len: int, max_tokens: int, ids: bool = False, vocab: int = 512,
                 ignore_eos: bool = True) -> Request:
    prompt = [(rid * 31 + i * 17) % vocab for i in range(prompt_len)] if ids else None
    return Request(rid, prompt_len, SamplingParams(max_tokens=max_tokens, ignore_eos=ignore_eos),
                   arrival_s=0.0, prompt_token_ids=prompt)


def drive(scheduler: Scheduler, executor, arrivals: list[tuple[int, Request]],
          check=True, max_steps: int = 100_000) -> Trace:
    """Add each request at its arrival step; run until everything is done."""
    trace = Trace()
    pending = sorted(arrivals, key=lambda a: a[0])
    i = 0
    while i < len(pending) or scheduler.has_work():
        while i < len(pending) and pending[i][0] <= trace.steps:
            r = pending[i][1]
            trace.requests[r.request_id] = r
            scheduler.add_request(r)
            i += 1
        if not scheduler.has_work():
            if i == len(pending):
                break
            trace.steps = pending[i][0]
            continue
        plan = scheduler.schedule()
        for new in plan.new_requests:
            if new.request_id not in trace.admitted:
                trace.admitted.append(new.request_id)
        horizon = pending[i][0] - trace.steps if i < len(pending) else float("inf")
        result = executor.execute(plan, max_elapsed_s=horizon)  # a 1 s fake step = one step index
        scheduler.update_from_output(plan, result)
        trace.plans.append(plan)
        trace.steps += result.num_steps
        if check:
            scheduler.check_integrity()
            assert result.kv_bytes == plan.kv_bytes
        if trace.steps > max_steps:
            raise AssertionError("no progress: the scheduler starves a request")
    return trace


def config(**kw) -> SchedulerConfig:
    base = {"kv_budget_bytes": 1 << 40, "kv_bytes_per_token": 512, "max_model_len": 8192}
    base.update(kw)
    return SchedulerConfig(**base)


def run_mlx(model, kvt: int, specs, run_ahead=True, kv_bits=None, **cfg):
    """Drive the scheduler (config(**cfg), kvt bytes a token) and an MLXExecutor (kept as
    run_mlx.executor) on (arrival step, prompt ids, max tokens) specs: the tokens of each request
    id, the scheduler and the trace. The driver asserts executor bytes == scheduler bytes after
    every step."""
    from batchsim.server.executors.mlx_executor import MLXExecutor

    sched = Scheduler(config(kv_bytes_per_token=kvt, **cfg))
    ex = run_mlx.executor = MLXExecutor(model, kv_bits=kv_bits, run_ahead=run_ahead)
    arrivals = [(step, Request(i, len(ids), SamplingParams(max_tokens=out, ignore_eos=True), 0.0,
                               prompt_token_ids=list(ids)))
                for i, (step, ids, out) in enumerate(specs)]
    trace = drive(sched, ex, arrivals)
    return {rid: r.output_token_ids for rid, r in trace.requests.items()}, sched, trace


def run_alone(model, kvt: int, specs, **kw):
    """Each spec's tokens when it runs alone (run_mlx at max_num_seqs=1, with kw), by its
    index."""
    return {i: run_mlx(model, kvt, [(0, ids, out)], max_num_seqs=1, **kw)[0][0]
            for i, (_, ids, out) in enumerate(specs)}


def kv_per_token(ref, dtype="float32") -> int:
    """The KV bytes one token of ref's model holds in dtype."""
    return ref.spec.kv_bytes_per_token(dtype)


@st.composite
def random_arrivals(draw, max_requests: int) -> list[tuple[int, int, int]]:
    """(arrival step, prompt tokens, output tokens) per request, for scheduler property tests."""
    return [(draw(st.integers(0, 40)), draw(st.integers(1, 1500)), draw(st.integers(1, 48)))
            for _ in range(draw(st.integers(1, max_requests)))]


@st.composite
def step_limits(draw, max_seqs: int) -> dict:
    """Random scheduler limits (SchedulerConfig keys) beside a test's own budget and model."""
    prefill = draw(st.sampled_from([256, 512]))
    seqs = draw(st.integers(1, max_seqs))
    return {
        "max_num_seqs": seqs, "prefill_step_size": prefill,
        "max_num_batched_tokens": draw(st.integers(max(prefill, seqs), 3000)),
        "policy": draw(st.sampled_from(["decode-first", "prefill-first"])),
        "row_step": draw(st.sampled_from([1, 2, 8])),
        "max_lookahead_steps": draw(st.sampled_from([1, 1, 16])),
    }


_MODELS: dict = {}


def float32_model(name: str):
    """(ref, model) of a zoo model in float32, loaded once per test process."""
    if name not in _MODELS:
        from batchsim.server.models.loader import load, resolve

        ref = resolve(name, "float32", None)
        _MODELS[name] = (ref, load(ref)[0])
    return _MODELS[name]


def random_specs(vocab: int, n: int, seed: int, max_prompt: int, max_out: int):
    """n (arrival step, prompt ids, max tokens) with random prompts, seeded."""
    rng = random.Random(seed)
    return [(rng.randint(0, 3), [rng.randrange(vocab) for _ in range(rng.randint(1, max_prompt))],
             rng.randint(2, max_out)) for _ in range(n)]


class WatchesServeStderr:
    """For a test's handle on a `batchsim serve` process (`self.proc`, text pipes): its stderr
    drained on a thread so the pipe never fills, kept in `stderr`, and the URL it listens on."""

    def watch_stderr(self) -> threading.Thread:
        from batchsim.scripts.serve_cmd import LISTENING

        self.stderr: list[str] = []
        self.url = ""
        self.listening = threading.Event()

        def read() -> None:
            for line in self.proc.stderr:
                self.stderr.append(line)
                if LISTENING in line:
                    self.url = line.split(LISTENING, 1)[1].strip()
                    self.listening.set()

        reader = threading.Thread(target=read, daemon=True)
        reader.start()
        return reader
