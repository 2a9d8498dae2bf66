"""Speculative decoding: n-gram drafts verified in one batched forward pass give exactly the tokens
plain greedy decoding gives (tiny model and the real default model, alone and batched), rejected
drafts are rolled back with the scheduler's KV account exact at every step, and the scheduler
budgets the drafted tokens."""

from __future__ import annotations

import random

import pytest
from batchsim.scheduler.request import Request, SamplingParams
from batchsim.scheduler.scheduler import Scheduler
from batchsim.scheduler.spec_budget import step_spec_tokens
from batchsim.server.executors.mlx_executor import MLXExecutor
from batchsim.server.executors.speculative import NgramDrafter, ngram_proposal

from tests.cli_calls import last_json
from tests.drivers import config, drive, make_request


def test_ngram_proposal_follows_vllm_prompt_lookup():
    # vLLM's docstring example: [4, 2, 3] has no earlier match, [2, 3] does; 3 tokens follow it.
    assert ngram_proposal([1, 2, 3, 4, 2, 3], k=4, min_n=2, max_n=3) == [4, 2, 3]
    assert ngram_proposal([1, 2, 3, 4, 2, 3], k=2, min_n=2, max_n=3) == [4, 2]
    # The longest n wins; among its matches the earliest.
    assert ngram_proposal([7, 1, 2, 9, 5, 1, 2, 8, 5, 1, 2], k=1, min_n=2, max_n=3) == [8]
    assert ngram_proposal([1, 2, 5, 1, 2, 6, 1, 2], k=1, min_n=2, max_n=2) == [5]
    assert ngram_proposal([1, 2, 3, 4], k=3) == []  # no match
    assert ngram_proposal([1, 2, 1, 2], k=0) == []


def test_spec_tokens_shrink_with_the_batch_and_fit_the_token_budget():
    assert [step_spec_tokens(4, "shrink", b, 2048) for b in (1, 8, 16, 32, 64)] == [4, 4, 3, 1, 0]
    assert [step_spec_tokens(4, "fixed", b, 2048) for b in (1, 32, 64)] == [4, 4, 4]
    assert step_spec_tokens(8, "fixed", 64, 256) == 3  # 64 rows x (1 + 3) = 256 tokens
    assert step_spec_tokens(0, "fixed", 1, 2048) == 0


def _requests(prompts: list[list[int]], max_tokens: int, eos: frozenset[int] = frozenset()):
    sampling = SamplingParams(max_tokens=max_tokens, ignore_eos=not eos)
    return [(i % 3, Request(i, len(ids), sampling, 0.0, prompt_token_ids=list(ids),
                            eos_token_ids=eos))
            for i, ids in enumerate(prompts)]


def _run(model, kvt: int, arrivals, spec_tokens: int = 0, kv_layout: str = "padded", **cfg):
    sched = Scheduler(config(kv_bytes_per_token=kvt, spec_tokens=spec_tokens,
                             kv_layout=kv_layout, **cfg))
    ex = MLXExecutor(model, drafter=NgramDrafter() if spec_tokens else None, kv_layout=kv_layout)
    if kv_layout == "paged":
        ex = _RowsHoldTheirBlocks(ex)
    trace = drive(sched, ex, arrivals)  # checks the KV account and the executor's bytes per step
    return {rid: r.output_token_ids for rid, r in trace.requests.items()}, trace


class _RowsHoldTheirBlocks:
    """Executor wrapper: after every step each paged row holds exactly the blocks of its tokens
    (those taken for rejected drafts are free again)."""

    def __init__(self, ex) -> None:
        self.ex = ex

    def execute(self, plan, max_elapsed_s=float("inf")):
        from batchsim.scheduler.pool_geometry import row_blocks

        result = self.ex.execute(plan, max_elapsed_s)
        pool = self.ex.pool
        assert [len(t) for t in pool.blocks.tables] == [row_blocks(n) for n in pool.lengths]
        return result


def _drafts(trace) -> int:
    return sum(sum(p.decode_spec_tokens) for p in trace.plans)


@pytest.mark.parametrize("max_num_seqs", [1, 4])
def test_ngram_speculation_matches_plain_greedy_tiny(tiny, max_num_seqs):
    ref, model, _ = tiny
    kvt = ref.spec.kv_bytes_per_token("float32")
    rng = random.Random(3)
    # Repeating prompts: the drafter finds n-grams from the first step.
    prompts = [[rng.randrange(ref.spec.vocab_size) for _ in range(rng.randint(5, 40))] * 3
               for _ in range(6)]
    plain, _ = _run(model, kvt, _requests(prompts, 24), max_num_seqs=max_num_seqs)
    spec, trace = _run(model, kvt, _requests(prompts, 24), spec_tokens=4,
                       max_num_seqs=max_num_seqs, spec_policy="fixed")
    assert spec == plain
    steps = [p for p in trace.plans if p.decode_spec_tokens]
    assert steps and max(len(p.decode_ids) for p in steps) == max_num_seqs
    # Fewer steps than tokens: drafts were accepted (and the test's prompts make some rejected).
    assert len(trace.plans) < sum(map(len, plain.values()))


@pytest.mark.parametrize("policy", ["fixed", "shrink"])
def test_verify_budget_counts_against_batched_tokens(policy):
    from batchsim.server.executors.fake_executor import FakeExecutor

    sched = Scheduler(config(max_num_seqs=64, max_num_batched_tokens=256, prefill_step_size=256,
                             spec_tokens=8,
                             spec_policy=policy))
    arrivals = [(i // 8, make_request(i, 4, 20, ids=True)) for i in range(48)]
    trace = drive(sched, FakeExecutor(), arrivals)  # checks the KV account every step
    for p in trace.plans:
        rows, k = len(p.decode_ids), max(p.decode_spec_tokens, default=0)
        assert rows * (1 + k) + sum(c.num_tokens for c in p.prefills) <= 256
        assert k <= step_spec_tokens(8, policy, rows, 256)  # rows near max_tokens draft fewer
    ks: dict[int, int] = {}  # rows -> K of the first step with that many rows
    for p in trace.plans:
        ks.setdefault(len(p.decode_ids), max(p.decode_spec_tokens, default=0))
    if policy == "fixed":  # K only as the token budget allows; the drafts hold back admissions
        assert (ks[8], ks[32], max(ks)) == (8, 7, 32)
    else:
        assert (ks[8], ks[16], ks[32], ks[48]) == (7, 3, 1, 0)


@pytest.fixture(scope="module")
def real(batchsim_home):
    from batchsim.server.models.loader import load, resolve

    ref = resolve("smollm2-135m-instruct", "float32")
    model, tokenizer = load(ref)
    return ref, model, tokenizer


# A reply that copies from its prompt (drafts accepted, and one rejected where the model drops a
# word) and one that repeats itself.
QUESTIONS = ["Repeat after me three times: the quick brown fox jumps over the lazy dog.",
             "List the days of the week, one per line."]


@pytest.mark.slow
def test_ngram_speculation_matches_plain_greedy_real_weights(real):
    from batchsim.workloads.chat import chat_token_ids

    ref, model, tok = real
    kvt = ref.spec.kv_bytes_per_token(ref.dtype)
    prompts = [chat_token_ids(tok, q) for q in QUESTIONS]
    eos = frozenset(tok.eos_token_ids)
    plain, _ = _run(model, kvt, _requests(prompts, 20, eos), max_num_seqs=2)
    for max_num_seqs in (1, 2):  # alone, and both rows in one verify step
        spec, trace = _run(model, kvt, _requests(prompts, 20, eos), spec_tokens=4,
                           max_num_seqs=max_num_seqs)
        assert spec == plain
        assert _drafts(trace) > 0
        assert max(len(p.decode_ids) for p in trace.plans if p.decode_spec_tokens) == max_num_seqs


def test_paged_speculation_matches_paged_plain_and_padded_speculation(tiny):
    ref, model, _ = tiny
    kvt = ref.spec.kv_bytes_per_token("float32")
    rng = random.Random(3)
    prompts = [[rng.randrange(ref.spec.vocab_size) for _ in range(rng.randint(5, 40))] * 3
               for _ in range(6)]
    kw = {"max_num_seqs": 4, "spec_policy": "fixed"}
    padded, _ = _run(model, kvt, _requests(prompts, 24), spec_tokens=4, **kw)
    paged, _ = _run(model, kvt, _requests(prompts, 24), kv_layout="paged", **kw)
    spec, trace = _run(model, kvt, _requests(prompts, 24), spec_tokens=4, kv_layout="paged", **kw)
    assert spec == paged == padded
    assert _drafts(trace) > 0 and len(trace.plans) < sum(map(len, spec.values()))


def test_paged_speculation_never_writes_a_shared_prefix_block(tiny):
    # Rows referencing cached prompt blocks (prefix cache, paged) verify drafts past them; the
    # executor refuses to write into a block with more than one reference.
    ref, model, _ = tiny
    kvt = ref.spec.kv_bytes_per_token("float32")
    rng = random.Random(4)
    system = [rng.randrange(ref.spec.vocab_size) for _ in range(40)]
    prompts = [system + [rng.randrange(ref.spec.vocab_size) for _ in range(12)] * 2
               for _ in range(4)]
    arrivals = [(0 if i == 0 else 3, r) for i, (_, r) in enumerate(_requests(prompts, 16))]
    plain, _ = _run(model, kvt, _requests(prompts, 16), max_num_seqs=4)
    spec, trace = _run(model, kvt, arrivals, spec_tokens=3, kv_layout="paged", max_num_seqs=4,
                       spec_policy="fixed", reuse_prefixes=True)
    assert spec == plain and _drafts(trace) > 0
    assert any(c.start >= 32 for p in trace.plans for c in p.prefills)  # two cached blocks hit


def test_draft_model_speculation_matches_plain_greedy_tiny(tiny):
    # The model as its own draft: nearly every draft is accepted, and the output stays exact.
    from batchsim.server.executors.draft_model import DraftModelDrafter

    ref, model, _ = tiny
    kvt = ref.spec.kv_bytes_per_token("float32")
    rng = random.Random(5)
    prompts = [[rng.randrange(ref.spec.vocab_size) for _ in range(rng.randint(3, 30))]
               for _ in range(4)]
    plain, _ = _run(model, kvt, _requests(prompts, 16), max_num_seqs=4)
    ex = MLXExecutor(model, drafter=DraftModelDrafter(model))
    sched = Scheduler(config(kv_bytes_per_token=kvt, spec_tokens=3, max_num_seqs=4,
                             cache_layout=ex.cache_layout))  # the draft model's rows too
    trace = drive(sched, ex, _requests(prompts, 16))
    assert {rid: r.output_token_ids for rid, r in trace.requests.items()} == plain
    assert len(trace.plans) <= sum(map(len, plain.values())) // 3


@pytest.mark.parametrize(("flags", "message"), [
    (["--spec-tokens", "4"], "--spec-tokens needs --spec-method ngram or draft"),
    (["--spec-method", "ngram"], "--spec-method ngram needs --spec-tokens K"),
    (["--spec-method", "draft", "--spec-tokens", "2"], "--spec-method draft needs --draft-model"),
    (["--spec-method", "ngram", "--spec-tokens", "2", "--draft-model", "tiny"],
     "--draft-model needs --spec-method draft"),
    (["--spec-method", "ngram", "--spec-tokens", "2", "--executor", "fake"],
     "runs on --executor mlx or sim"),
    (["--spec-method", "ngram", "--spec-tokens", "2", "--acceptance", "0.5"],
     "are for --executor sim"),
    (["--spec-method", "ngram", "--spec-tokens", "99"], "spec_tokens must be in 0..32"),
    (["--model", "tiny-sliding", "--spec-method", "ngram", "--spec-tokens", "2"],
     "the model has sliding-attention layers, whose cache cannot roll back"),
    (["--model", "tiny-hybrid", "--dtype", "float32", "--spec-method", "ngram",
      "--spec-tokens", "2"], "the model has linear-attention layers"),
])
def test_bad_speculation_flags_are_one_line_errors(batchsim_home, tmp_path, capsys, flags,
                                                  message):
    from batchsim.scripts.cli import main

    assert main(["run", "--num-prompts", "1", "--out", str(tmp_path), "--model", "tiny",
                 *flags]) == 2
    err = capsys.readouterr().err
    assert message in err.strip().splitlines()[-1] and "Traceback" not in err, err


def test_spec_counts_are_vllms():
    from batchsim.scheduler.plan import StepResult
    from batchsim.server.results.spec_metrics import SpecCounts

    counts = SpecCounts()
    # Three rows: 4 drafted, 2 kept; 2 drafted, none kept; no draft (not counted as a draft).
    counts.add(StepResult(0, (1, 2, 3), ((7, 8, 9),), (0.1,), 0, ((5, 6), (), ()), (4, 2, 0)))
    counts.add(StepResult(1, (1,), ((7,),), (0.1,), 0, ((5, 6, 7, 8),), (4,)))
    counts.add(StepResult(2, (1,), ((7,),), (0.1,), 0))  # a plain step
    s = counts.summary()
    assert (s["spec_decode_num_drafts"], s["spec_decode_draft_tokens"],
            s["spec_decode_accepted_tokens"]) == (3, 10, 6)
    assert s["spec_decode_acceptance_rate"] == pytest.approx(60.0)
    assert s["spec_decode_acceptance_length"] == pytest.approx(1 + 6 / 3)
    assert s["spec_decode_per_position_acceptance_rates"] == pytest.approx([2 / 3, 2 / 3, 1 / 3,
                                                                            1 / 3])


def test_run_summary_reports_speculation(batchsim_home, tmp_path, capsys):

    from batchsim.scripts.cli import main

    argv = ["run", "--model", "tiny", "--num-prompts", "4", "--input-len", "32",
            "--output-len", "16", "--out", str(tmp_path), "--no-progress", "--no-timeline"]
    sums = []
    for extra in ([], ["--spec-method", "ngram", "--spec-tokens", "4", "--spec-policy", "fixed"]):
        assert main([*argv, *extra]) == 0
        sums.append(last_json(capsys.readouterr().out))
    plain, spec = sums
    assert spec["output_tokens_sha256"] == plain["output_tokens_sha256"]
    assert spec["kv_account_mismatches"] == 0 and "spec_decode_num_drafts" not in plain
    assert spec["spec_decode_num_drafts"] > 0
    assert spec["spec_decode_accepted_tokens"] <= spec["spec_decode_draft_tokens"]
    assert spec["spec_decode_acceptance_rate"] == pytest.approx(
        100 * spec["spec_decode_accepted_tokens"] / spec["spec_decode_draft_tokens"])
    assert spec["num_steps"] < plain["num_steps"]


def test_bench_decode_speculates_in_its_continuous_runs(batchsim_home, tmp_path, capsys):

    from batchsim.scripts.cli import main

    argv = ["bench-decode", "--model", "tiny", "--batch", "1", "--modes", "executor", "--reps",
            "1", "--steps", "2", "--out", str(tmp_path), "--spec-method", "ngram",
            "--spec-tokens", "2"]
    assert main(argv) == 2  # the flags speculate in --continuous runs only
    assert "--continuous" in capsys.readouterr().err
    assert main([*argv, "--continuous", "2"]) == 0
    (row,) = last_json(capsys.readouterr().out)["continuous"]
    assert (row["spec_method"], row["spec_tokens"]) == ("ngram", 2) and row["executor_tok_s"] > 0


def test_streams_deliver_accepted_drafts(tiny):
    # What `serve` streams: every token the scheduler kept, drafts included.
    import asyncio

    from batchsim.server.engine import clock
    from batchsim.server.engine.engine import Engine

    ref, model, _ = tiny
    kvt = ref.spec.kv_bytes_per_token("float32")
    rng = random.Random(3)
    prompt = [[rng.randrange(ref.spec.vocab_size) for _ in range(rng.randint(5, 40))] * 3
              for _ in range(5)][4]  # its reply repeats tokens: drafts are accepted
    plain, _ = _run(model, kvt, _requests([prompt], 24))

    async def main():
        sched = Scheduler(config(kv_bytes_per_token=kvt, spec_tokens=4, spec_policy="fixed"))
        engine = Engine(sched, MLXExecutor(model, drafter=NgramDrafter()))
        engine.start_clock()
        loop_task = asyncio.create_task(engine.run())
        queue = engine.stream(Request(0, len(prompt), SamplingParams(max_tokens=24,
                                                                     ignore_eos=True),
                                      0.0, prompt_token_ids=prompt))
        tokens = []
        while not isinstance(item := await queue.get(), Request):
            tokens.extend(item)
        engine.stop()
        await loop_task
        return tokens, item, engine.recorder.spec.accepted_tokens

    tokens, request, accepted = clock.run(main(), virtual=False)
    assert tokens == request.output_token_ids == plain[0] and accepted > 0


def test_a_verify_step_stops_at_the_first_stop_token():
    from batchsim.scheduler.spec_budget import until_stop

    r = Request(0, 3, SamplingParams(max_tokens=9, stop_token_ids=frozenset({7})), 0.0,
                prompt_token_ids=[1, 2, 3], eos_token_ids=frozenset({9}))
    assert until_stop(r, [4, 9, 5, 6]) == [4, 9]  # EOS among the accepted drafts
    assert until_stop(r, [7, 9]) == [7]
    assert until_stop(r, [4, 5, 9]) == [4, 5, 9]  # the sampled token: stop_reason's
    ignoring = Request(1, 3, SamplingParams(max_tokens=9, ignore_eos=True), 0.0,
                       prompt_token_ids=[1, 2, 3], eos_token_ids=frozenset({9}))
    assert until_stop(ignoring, [9, 9, 4]) == [9, 9, 4]


def test_text_stream_takes_a_verify_steps_tokens_up_to_its_stop_string():
    from batchsim.server.http.text_stream import TextStream

    from tests.char_detokenizer import CharDetokenizer

    ts = TextStream(CharDetokenizer(), ("cd",))
    assert ts.feed([ord("a")]) is None
    assert ts.feed([ord(c) for c in "bcde"]) == 3  # b, c, d: the stop string ends at d
    assert ts.take() + ts.take() + ts.finish() == "ab"


class _StopAt:
    """A stop string completed by the output's n-th token (what TextStream.feed answers)."""

    def __init__(self, n: int):
        self.n, self.seen = n, 0

    def feed(self, token_ids: list[int]) -> int | None:
        self.seen += len(token_ids)
        return len(token_ids) - (self.seen - self.n) if self.seen >= self.n else None


def test_a_stop_string_inside_accepted_drafts_cuts_the_ids_and_counts(tiny):
    # The stop string ends at the first accepted draft of a verify step that kept several: the
    # output, its count and the accepted drafts the records count all end there.
    from batchsim.server.engine import clock
    from batchsim.server.engine.engine import Engine

    ref, model, _ = tiny
    kvt = ref.spec.kv_bytes_per_token("float32")
    rng = random.Random(3)
    prompt = [[rng.randrange(ref.spec.vocab_size) for _ in range(rng.randint(5, 40))] * 3
              for _ in range(5)][4]
    steps: list[int] = []  # tokens each verify step gave the request

    def run(checker):
        async def main():
            sched = Scheduler(config(kv_bytes_per_token=kvt, spec_tokens=4, spec_policy="fixed"))
            engine = Engine(sched, MLXExecutor(model, drafter=NgramDrafter()))
            engine.start_clock()
            loop_task = asyncio.create_task(engine.run())
            r = Request(0, len(prompt), SamplingParams(max_tokens=24, ignore_eos=True), 0.0,
                        prompt_token_ids=prompt)
            r.stop_checker = checker
            queue = engine.stream(r)
            tokens = []
            while not isinstance(item := await queue.get(), Request):
                tokens.extend(item)
                steps.append(len(item))
            engine.stop()
            await loop_task
            return tokens, item, engine.recorder.spec.accepted_tokens

        return clock.run(main(), virtual=False)

    import asyncio

    full, _, _ = run(None)
    first = list(steps)  # greedy: the stopped run's steps are these until the stop
    i = next(i for i, n in enumerate(first) if n >= 3)  # a step that kept >= 2 drafts
    before = sum(first[:i])
    tokens, request, accepted = run(_StopAt(before + 1))
    assert tokens == request.output_token_ids == full[: before + 1]
    assert (request.num_output_tokens, request.finish_reason) == (before + 1, "stop")
    # each step: its accepted drafts and one token; the last step keeps one draft
    assert accepted == sum(n - 1 for n in first[:i]) + 1
