"""A draft model inside the memory account: its weights and its K/V (one padded row per pool row,
CacheLayout.draft) are held by --memory-gb's budget, by the scheduler's byte account (admission,
preemption), by the executors' bytes (real and simulated), by the summary's peak memory and by
`size`'s max batch."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
from batchsim.scheduler.kv_bytes import CacheLayout
from batchsim.scheduler.pool_geometry import PoolGeometry
from batchsim.server.models.spec import zoo_spec
from batchsim.server.perf import macs, size_limits, spec_price
from batchsim.server.perf.spec_acceptance import Acceptance

from tests.cli_calls import cli_summary, draft_sweep_argv

GIB = 1 << 30


def test_a_pool_row_costs_the_targets_bytes_and_the_drafts():
    target, draft = CacheLayout(512, ((128, 64),), 1000), CacheLayout.dense(300)
    both = target.with_draft(draft)
    assert both.seq_bytes(256) == target.seq_bytes(256) + 256 * 300
    assert both.pool_bytes(PoolGeometry(4, 512)) == 4 * (target.seq_bytes(512) + 512 * 300)
    # Paged, the draft's rows stay padded: per row at the capacity, beside the target's blocks.
    assert both.pool_bytes(PoolGeometry(4, 512, 40)) == (
        target.pool_bytes(PoolGeometry(4, 512, 40)) + 4 * 512 * 300)
    # Private prefill caches and prefix blocks are the target's alone.
    assert both.private_bytes(256, 300) == target.private_bytes(256, 300)
    assert both.block_bytes == target.block_bytes
    assert both.alone_bytes(300) == target.seq_bytes(512) + 512 * 300
    assert not CacheLayout.dense(512).with_draft(draft).is_dense
    assert CacheLayout.dense(512).with_draft(draft).all_full


def test_a_simulated_draft_model_shares_the_budget(tmp_path, capsys):
    # Qwen3-0.6B drafting for Qwen3-8B at 20 GiB: its 1.19 GB of weights leave less for K/V,
    # and its rows (0.78 x the target's bytes a token) fit fewer sequences beside them.
    argv = ["run", "--executor", "sim", "--model", "qwen3-8b", "--device-profile", "M2 Ultra",
            "--memory-gb", "20", "--num-prompts", "40", "--request-rate", "inf",
            "--input-len", "2048", "--output-len", "64", "--max-num-seqs", "64", "--seed", "3",
            "--no-progress", "--no-timeline", "--spec-tokens", "4", "--acceptance", "0.6"]
    ngram = cli_summary(capsys, [*argv, "--out", str(tmp_path / "a"), "--spec-method", "ngram"])
    draft = cli_summary(capsys, [*argv, "--out", str(tmp_path / "b"), "--spec-method", "draft",
                                 "--draft-model", "qwen3-0.6b"])
    assert draft["weight_bytes"] == ngram["weight_bytes"] + zoo_spec("qwen3-0.6b").weight_bytes(
        "float16")
    assert draft["kv_budget_bytes"] == ngram["kv_budget_bytes"] - zoo_spec(
        "qwen3-0.6b").weight_bytes("float16")
    row = 2304 * (147456 + 114688)  # a sequence's padded row, the target's and the draft's
    assert draft["max_batch_size"] <= draft["kv_budget_bytes"] // row < ngram["max_batch_size"]
    assert draft["kv_account_mismatches"] == ngram["kv_account_mismatches"] == 0
    assert draft["peak_memory_bytes"] > draft["weight_bytes"] > ngram["peak_memory_bytes"] - (
        ngram["kv_budget_bytes"])


def test_a_real_draft_model_shares_the_budget(tmp_path, capsys, batchsim_home):
    # The tiny model drafting for itself (float32: 427 kB of weights, 512 B of K/V a token
    # each): a budget of the weights twice and about 4.6 target rows of 256 tokens runs 2
    # sequences at once with the draft model's rows (4 with the n-gram drafter), and the
    # executor's bytes (its draft pool included) match the scheduler's every step.
    weights = zoo_spec("tiny").weight_bytes("float32")
    memory_gb = (2 * weights + 600_000) / GIB
    argv = ["run", "--model", "tiny", "--dtype", "float32", "--memory-gb", f"{memory_gb:.9f}",
            "--num-prompts", "6", "--request-rate", "inf", "--input-len", "48",
            "--output-len", "10", "--max-num-seqs", "6", "--seed", "3", "--no-progress",
            "--no-timeline", "--spec-tokens", "2", "--spec-policy", "fixed"]
    ngram = cli_summary(capsys, [*argv, "--out", str(tmp_path / "a"), "--spec-method", "ngram"])
    draft = cli_summary(capsys, [*argv, "--out", str(tmp_path / "b"), "--spec-method", "draft",
                                 "--draft-model", "tiny"])
    assert draft["weight_bytes"] == 2 * ngram["weight_bytes"] == 2 * weights
    assert draft["max_batch_size"] == 2 < ngram["max_batch_size"]
    assert draft["spec_decode_num_drafts"] > 0 and draft["completed"] == 6
    assert draft["kv_account_mismatches"] == ngram["kv_account_mismatches"] == 0


def test_a_draft_models_rows_stay_held_and_priced_in_steps_that_draft_nothing(tmp_path, capsys,
                                                                                 batchsim_home):
    # --spec-policy shrink verifies no drafts above 32 rows (K = 0), yet the real drafter's pool
    # mirrors the target's geometry every step (DraftModelDrafter.resize): it holds a row per
    # sequence, so the account prices them there too (docs/how-it-works.md: why not released).
    argv = ["run", "--model", "tiny", "--dtype", "float32", "--num-prompts", "40",
            "--request-rate", "inf", "--input-len", "16", "--output-len", "6", "--max-num-seqs",
            "40", "--seed", "3", "--no-progress", "--no-timeline", "--spec-tokens", "2",
            "--spec-policy", "shrink", "--out"]
    summary = cli_summary(capsys, [*argv, str(tmp_path / "draft"), "--spec-method", "draft",
                                   "--draft-model", "tiny"])
    cli_summary(capsys, [*argv, str(tmp_path / "ngram"), "--spec-method", "ngram"])
    wide = [r for r in _steps(tmp_path / "draft") if r["batch_size"] > 32
            and not r["num_prefill_tokens"]]
    target = {_geometry(r): r["kv_bytes"] for r in _steps(tmp_path / "ngram")}  # no draft rows
    assert wide and summary["kv_account_mismatches"] == 0
    assert {_geometry(r) for r in wide} <= set(target)
    # Beside all the target holds (ngram's account at the same pool geometry), the draft (tiny,
    # as the target: 512 B of K/V a token in float32) holds a full row per pool row.
    assert all(r["kv_bytes"] == r["kv_bytes_measured"] == target[_geometry(r)]
               + r["pool_rows"] * r["pool_capacity_tokens"] * 512 for r in wide)


def _steps(out: Path) -> list[dict]:
    (steps,) = out.glob("*/steps.jsonl")
    return list(map(json.loads, steps.read_text().splitlines()))


def _geometry(record: dict) -> tuple[int, int]:
    return record["pool_rows"], record["pool_capacity_tokens"]


def test_size_fits_the_draft_models_weights_and_rows():
    catalog = macs.load_catalog()
    (mac,) = [m for m in catalog.chips if m.label == "M2 Ultra 76c"]
    spec, draft = zoo_spec("qwen3-8b"), zoo_spec("qwen3-0.6b")
    ctx = size_limits.context_fit("4096", spec.max_context)
    bw, _ = macs.bandwidth_efficiency(catalog, macs.weight_format(None))
    cmp, _ = macs.compute_efficiency(catalog)
    plain = size_limits.Settings("float16", None, bw, cmp, 8.0, spec_tokens=4,
                                 acceptance=Acceptance((0.6,)))
    rows = [size_limits.mac_row(spec, mac, 64, ctx, s, catalog.metal_working_set)
            for s in (plain, dataclasses.replace(plain, draft=draft))]
    assert rows[1]["weight_bytes"] == rows[0]["weight_bytes"] + draft.weight_bytes("float16")
    assert rows[1]["draft_kv_bytes_per_token"] == 114688  # 78% of the target's 147456
    budget = rows[1]["usable_bytes"] - rows[1]["weight_bytes"]
    assert rows[0]["max_batch_padded"] == 58
    assert rows[1]["max_batch_padded"] == rows[1]["max_batch_paged"] == budget // (
        4096 * (147456 + 114688)) == 31
    # The draft's row is the scheduler's price of it (CacheLayout.seq_bytes).
    layout = spec_price.draft_cache(draft, "float16")
    assert size_limits.draft_curve(ctx, layout)[3] == 3 * layout.seq_bytes(4096)
    # --kv-bits 8: the draft's K/V quantized as the target's (the real drafter's pool is).
    kv8 = size_limits.mac_row(spec, mac, 64, ctx, dataclasses.replace(plain, draft=draft,
                              kv_bits=8), catalog.metal_working_set)
    assert kv8["draft_kv_bytes_per_token"] == draft.kv_bytes_per_token("float16", 8) < 114688


@pytest.mark.parametrize("layout", ["padded", "paged"])
def test_the_sim_executor_holds_what_the_scheduler_prices(tmp_path, capsys, layout):
    # Llama-3.2-1B drafting for Llama-3.1-8B (4-bit, K/V in float16: 32 kB and 128 kB a token)
    # in 7 GiB: decoding rows outgrow the budget and are preempted, every step's bytes agree.
    argv = ["run", "--executor", "sim", "--model", "llama-3.1-8b", "--quantize", "4",
            "--device-profile", "M2 Ultra", "--memory-gb", "7", "--num-prompts", "30",
            "--request-rate", "inf", "--input-len", "700", "--output-len", "300",
            "--kv-layout", layout, "--prefix-cache", "off", "--no-progress", "--no-timeline",
            "--spec-method", "draft", "--draft-model", "llama-3.2-1b", "--spec-tokens", "3",
            "--acceptance", "0.5", "--out", str(tmp_path)]
    s = cli_summary(capsys, argv)
    assert s["completed"] == 30 and s["kv_account_mismatches"] == 0
    assert s["num_preemptions"] > 0  # decoding rows outgrew the budget: preemption saw them
    if layout == "padded":  # steps holding the pool alone: rows x capacity x both models' bytes
        (steps,) = tmp_path.glob("*/steps.jsonl")
        pool = [json.loads(line) for line in steps.read_text().splitlines()]
        pool = [r for r in pool if r["num_running"] == r["batch_size"] > 0
                and not r["num_prefill_requests"]]
        assert pool and all(r["kv_bytes"] == r["pool_rows"] * r["pool_capacity_tokens"] * (
            131072 + 32768) for r in pool)


def test_a_sweeps_draft_points_hold_the_draft_model_and_its_analytic_limit(tmp_path, capsys):
    # sweep --draft-model: each speculative point's session counts the draft model's weights and
    # rows (Session.renewed), and the analytic limit with them is the batch those points reach.
    # Llama-3.1-8B 4-bit, 700 + 64 tokens: 96 MiB a sequence, Llama-3.2-1B's 695 MB and 24 MiB
    # a row beside it. --limit-batch 6 sized the budget from the target's weights alone (6 x 96
    # MiB of room: the draft model did not fit, and the sweep failed without --memory-gb); it
    # holds both models now, and 6 is the speculative points' limit (plain batching fits more).
    argv = draft_sweep_argv(tmp_path, "--output-len", "64", "--batches", "4,8", "--spec-tokens",
                            "3")
    res = cli_summary(capsys, argv)
    assert res["spec_analytic_max_batch"] == 6 and res["analytic_overrun_batch"] > 6
    draft = spec_price.draft_weight_bytes(zoo_spec("llama-3.2-1b"), "float16", 4)
    for entry in (r["spec"][0] for r in res["rows"]):
        s = json.loads((tmp_path / entry["run_dir"] / "summary.json").read_text())
        assert s["weight_bytes"] == res["weight_bytes"] + draft
        assert s["kv_account_mismatches"] == 0
    assert s["max_batch_size"] == 6  # the batch-8 point: the analytic limit
