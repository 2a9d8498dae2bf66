"""The paged KV layout (`--kv-layout paged`): full-attention and MLA layers in PAGE_TOKENS-token
blocks with a block table per row. The same tokens as the padded layout for every model family,
and the executor's arrays byte-equal to the scheduler's block account at every step (drive()
asserts it)."""

from __future__ import annotations

import itertools

import mlx.core as mx
import pytest
from batchsim.scheduler.pool_geometry import PAGE_TOKENS, row_blocks
from batchsim.scheduler.request import Request, SamplingParams
from batchsim.scheduler.scheduler import Scheduler
from batchsim.server.executors.block_pool import BlockPool
from batchsim.server.executors.mlx_executor import MLXExecutor
from batchsim.server.perf import size_limits

from tests.drivers import config, drive, float32_model, random_specs


def _run(model, layout, specs, kv_layout: str, **cfg):
    sched = Scheduler(config(kv_bytes_per_token=layout.full_token_bytes, cache_layout=layout,
                             kv_layout=kv_layout, **cfg))
    ex = MLXExecutor(model, kv_layout=kv_layout)
    arrivals = [(step, Request(i, len(ids), SamplingParams(max_tokens=out, ignore_eos=True), 0.0,
                               prompt_token_ids=list(ids)))
                for i, (step, ids, out) in enumerate(specs)]
    trace = drive(sched, ex, arrivals)
    return {rid: r.output_token_ids for rid, r in trace.requests.items()}, trace


# Per model: requests, prompt and output bounds (the hybrid model is slow on the CPU: few tokens).
CASES = {"tiny": (6, 300, 40), "tiny-moe": (4, 200, 20), "tiny-sliding": (5, 300, 30),
         "tiny-hybrid": (3, 260, 8), "tiny-mla": (5, 300, 30)}


@pytest.mark.parametrize("name", list(CASES))
def test_paged_tokens_equal_padded(name, batchsim_home):
    ref, model = float32_model(name)
    layout = ref.spec.cache_layout("float32")
    n, max_prompt, max_out = CASES[name]
    specs = random_specs(ref.spec.vocab_size, n, seed=35, max_prompt=max_prompt, max_out=max_out)
    padded, _ = _run(model, layout, specs, "padded")
    paged, trace = _run(model, layout, specs, "paged")
    assert paged == padded
    assert all(p.pool.blocks is not None for p in trace.plans)
    assert max(p.pool.blocks for p in trace.plans) > 0


def test_paged_under_a_tight_budget_preempts_and_matches(batchsim_home):
    # A budget that holds a few rows' blocks: rows join, leave, are preempted; blocks move when
    # the pool shrinks; tokens stay those of the padded layout under the same budget.
    ref, model = float32_model("tiny")
    layout = ref.spec.cache_layout("float32")
    specs = random_specs(ref.spec.vocab_size, 8, seed=7, max_prompt=40, max_out=200)
    budget = 400 * layout.full_token_bytes
    padded, _ = _run(model, layout, specs, "padded", kv_budget_bytes=budget, max_num_seqs=6)
    paged, trace = _run(model, layout, specs, "paged", kv_budget_bytes=budget, max_num_seqs=6)
    assert paged == padded
    assert sum(r.num_preemptions for r in trace.requests.values()) > 0
    blocks = [p.pool.blocks for p in trace.plans]
    assert any(b < a for a, b in itertools.pairwise(blocks) if b)  # shrunk: blocks compacted


def test_block_pool_refcounts_tables_and_compaction():
    pool = BlockPool()
    pool.resize(6)
    a = pool.add_row(2 * PAGE_TOKENS)  # blocks 0, 1
    b = pool.add_row(PAGE_TOKENS + 1)  # blocks 2, 3
    assert (a, b, pool.num_free) == ([0, 1], [2, 3], 2)
    pool.incref(a[:1])  # a shared block (a cached prefix) outlives its first row
    pool.remove_rows([0], [0], [1])  # row 0 leaves, row 1 moves into it
    assert pool.tables == [[2, 3]] and pool.refcount[:4] == [1, 0, 1, 1]
    assert pool.fit_row(0, 3 * PAGE_TOKENS) and pool.tables[0] == [2, 3, 1]
    assert pool.fit_row(0, 1) and pool.tables[0] == [2] and pool.num_free == 4
    src, dst = pool.resize(2)  # block 2 moves below the new size; block 0 stays shared
    assert (src, dst, pool.tables) == ([2], [1], [[1]]) and pool.refcount == [1, 1]
    with pytest.raises(RuntimeError, match="blocks asked"):
        pool.allocate(1)
    pool.decref([0])
    with pytest.raises(RuntimeError, match="freed twice"):
        pool.decref([0])


def test_row_blocks_is_the_account():
    assert [row_blocks(n) for n in (0, 1, PAGE_TOKENS, PAGE_TOKENS + 1)] == [0, 1, 1, 2]
    assert mx.array([1]).item() == 1


def test_size_paged_max_batch_is_what_a_paged_run_holds(batchsim_home):
    # `size`'s paged column, on the budget of exactly five sequences at full context: five run
    # together to the end without a preemption (padded holds two), a sixth forces preemptions.
    ref, model = float32_model("tiny")
    layout = ref.spec.cache_layout("float32")
    kvt, context = layout.full_token_bytes, 100
    ctx = size_limits.context_fit(str(context), ref.spec.max_context)
    budget = int(ctx.paged_tokens[5]) * kvt
    fits = size_limits.max_batch(ctx.paged_tokens, budget, kvt)
    assert fits == 5 and size_limits.max_batch(ctx.padded_tokens, budget, kvt) == 2

    def run(seqs: int):  # one-token prompts: no private prefill cache, only the pool's blocks
        specs = [(0, [i + 1], context - 1) for i in range(seqs)]
        return _run(model, layout, specs, "paged", kv_budget_bytes=budget, max_num_seqs=seqs)[1]

    held = run(fits)
    assert sum(r.num_preemptions for r in held.requests.values()) == 0
    assert max(len(p.decode_ids) for p in held.plans) == fits
    assert max(p.kv_bytes for p in held.plans) == budget  # drive(): the executor's bytes too
    over = run(fits + 1)
    assert sum(r.num_preemptions for r in over.requests.values()) > 0


def test_run_kv_layout_flag_same_tokens_fewer_bytes(batchsim_home):
    # `run --kv-layout` end to end (in-process): both layouts account byte-exactly, agree token
    # for token, and the paged run holds fewer KV bytes at its peak (rows past 256 tokens: the
    # padded pool grows every row to 512, the paged one by blocks).
    from batchsim.scripts.cli import build_parser
    from batchsim.scripts.run_args import config_from_args
    from batchsim.server.engine.runner import run_workload
    from batchsim.server.engine.session import open_session

    runs = {}
    for layout in ("padded", "paged"):
        args = build_parser().parse_args([
            "run", "--model", "tiny", "--dtype", "float32", "--kv-layout", layout,
            "--num-prompts", "4", "--request-rate", "inf", "--input-len", "uniform:200:250",
            "--output-len", "uniform:40:80"])
        cfg = config_from_args(args)
        runs[layout] = run_workload(open_session(cfg), cfg.workload, out_dir=None,
                                    label=layout).summary
    padded, paged = runs["padded"], runs["paged"]
    assert (padded["kv_layout"], paged["kv_layout"]) == ("padded", "paged")
    assert padded["kv_account_mismatches"] == paged["kv_account_mismatches"] == 0
    assert paged["output_tokens_sha256"] == padded["output_tokens_sha256"]
    assert paged["peak_kv_bytes_measured"] < padded["peak_kv_bytes_measured"]
