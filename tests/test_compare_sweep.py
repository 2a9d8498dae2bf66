"""`batchsim compare` and `batchsim sweep`: the sweep arithmetic against hand-computed values, the
measured overrun against the analytic one (fake executor: policy only, milliseconds), one real MLX
sweep on the tiny model, and both output contracts with their JSONL and PNG."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from batchsim.scripts.cli import main
from batchsim.server.perf import sweep_limits as sweep_math

from tests.cli_calls import last_json
from tests.sim_records import sweep_step

GIB = 1 << 30
SMOLLM2_WEIGHTS_F32 = 538_060_032  # zoo spec: 134,515,008 params x 4 bytes
SMOLLM2_KV_F32 = 2 * 30 * 3 * 64 * 4  # K and V x layers x kv_heads x head_dim x float32 = 46,080
TINY_KV_F32 = 2 * 2 * 2 * 16 * 4  # 512


def cli_json(capsys, argv: list[str]) -> dict:
    assert main(argv) == 0
    return last_json(capsys.readouterr().out)


# -- arithmetic --------------------------------------------------------------------------------
def test_seq_kv_tokens_counts_the_last_token_out():
    # 192 + 64 - 1 = 255 tokens cached at the last decode: one 256-token step.
    assert sweep_math.seq_kv_tokens(192, 64) == 256
    assert sweep_math.seq_kv_tokens(192, 65) == 256
    assert sweep_math.seq_kv_tokens(192, 66) == 512
    assert sweep_math.seq_kv_tokens(300, 1) == 512  # the prefill cache alone
    assert sweep_math.batch_kv_bytes(12, 192, 64, SMOLLM2_KV_F32) == 12 * 256 * 46_080


def test_analytic_limit_by_hand():
    budget = int(0.64 * GIB)  # 687,194,767
    # (687,194,767 - 538,060,032) // (256 x 46,080 = 11,796,480) = 149,134,735 // 11,796,480 = 12
    assert sweep_math.analytic_max_batch(budget, SMOLLM2_WEIGHTS_F32, 192, 64, SMOLLM2_KV_F32) == 12
    assert sweep_math.analytic_max_batch(budget, SMOLLM2_WEIGHTS_F32, 192, 66, SMOLLM2_KV_F32) == 6
    assert sweep_math.analytic_max_batch(SMOLLM2_WEIGHTS_F32, SMOLLM2_WEIGHTS_F32, 192, 64,
                                         SMOLLM2_KV_F32) == 0


@pytest.mark.parametrize("limit", [1, 7, 12, 24, 63])
@pytest.mark.parametrize("prompt,output", [(192, 64), (100, 300), (1000, 2)])
def test_budget_for_limit_lands_on_the_limit(limit, prompt, output):
    budget = sweep_math.budget_for_limit(limit, SMOLLM2_WEIGHTS_F32, prompt, output, SMOLLM2_KV_F32)
    for b in (budget, int(budget / GIB * GIB)):  # also after the round trip through --memory-gb
        assert sweep_math.analytic_max_batch(b, SMOLLM2_WEIGHTS_F32, prompt, output,
                                             SMOLLM2_KV_F32) == limit


def test_default_batches():
    assert sweep_math.default_batches(12, 64) == [1, 2, 4, 8, 11, 12, 13, 14, 16]
    assert sweep_math.default_batches(12, 12) == [1, 2, 4, 8, 11, 12]
    assert sweep_math.default_batches(30, 64) == [1, 2, 4, 8, 16, 29, 30, 31, 32, 64]
    assert sweep_math.default_batches(1, 64) == [1, 2, 3, 4]
    assert sweep_math.default_batches(0, 64) == [1, 2, 4]
    assert sweep_math.default_batches(10_000, 64) == [1, 2, 4, 8, 16, 32, 64]


def test_agreement_counts_list_steps():
    batches = [1, 2, 4, 8, 11, 12, 13, 14, 16]
    assert sweep_math.analytic_first_overrun(batches, 12) == 13
    assert sweep_math.agree_within_one_step(batches, 12, 13)
    assert sweep_math.agree_within_one_step(batches, 12, 12)
    assert sweep_math.agree_within_one_step(batches, 12, 14)
    assert not sweep_math.agree_within_one_step(batches, 12, 11)
    assert not sweep_math.agree_within_one_step(batches, 12, None)
    assert sweep_math.agree_within_one_step(batches, 100, None)  # nothing overruns, as predicted
    assert sweep_math.agree_within_one_step(batches, 100, 16)
    assert not sweep_math.agree_within_one_step(batches, 100, 14)


def test_scaling_stop():
    batches = [1, 2, 4, 8, 16]
    # Doubling gains 90%, 80%, then 3% (< 5% per doubling): stops at 8.
    assert sweep_math.scaling_stop(batches, batches, [10, 19, 34.2, 35.2, 60], 0.05) == 8
    assert sweep_math.scaling_stop(batches, batches, [10, 19, 34.2, 60, 100], 0.05) is None
    # A point that decoded no larger batch than the previous one has stopped, whatever its rate.
    assert sweep_math.scaling_stop(batches, [1, 2, 4, 8, 8], [10, 19, 34, 60, 90], 0.05) == 16
    assert sweep_math.scaling_stop(batches, batches, [10, None, 19, 34, 60], 0.05) is None


def test_memory_waits_exclude_the_token_budget():
    steps = [
        # 10 prefills fill the 2048-token step: waiting is expected
        sweep_step(0, 0, 1920, 10, 4),
        sweep_step(1, 10, 384, 12, 2),  # room for another 192-token chunk, yet 2 wait: memory
        sweep_step(2, 12, 0, 12, 2),
        sweep_step(3, 12, 384, 14, 0),  # a request finished: both are admitted
    ]
    admitted = [10, 2, 0, 2]
    assert sweep_math.memory_wait_steps(steps, admitted, 14, 2048, 192) == 2
    assert sweep_math.memory_wait_steps(steps, admitted, 12, 2048, 192) == 0  # no seat free


def test_a_request_that_arrived_during_a_step_is_no_memory_wait():
    """A real run's request arrives while a step runs and waits after it, though the next plan
    admits it: counted as held back for memory, it failed the end-to-end sweep test at load 8-10
    (longer steps: more such arrivals)."""
    steps = [sweep_step(0, 2, 0, 2, 1), sweep_step(1, 2, 192, 3, 0), sweep_step(2, 3, 0, 3, 0)]
    assert sweep_math.memory_wait_steps(steps, [0, 1, 0], 4, 2048, 192) == 0
    held = [sweep_step(i, 2, 0, 2, 1) for i in range(3)]  # never admitted
    assert sweep_math.memory_wait_steps(held, [0, 0, 0], 4, 2048, 192) == 2


def test_later_prefill_chunks_are_no_admissions():
    """Chunked prefill: step 1 prefills the second chunks of the two requests step 0 admitted;
    counted as two admissions of the two waiting, the waits memory caused went unseen."""
    from batchsim.server.results.records import RequestRecord

    steps = [sweep_step(0, 0, 384, 2, 2), sweep_step(1, 0, 384, 2, 2), sweep_step(2, 2, 0, 2, 2)]
    requests = [RequestRecord(i, "unfinished", 0.0, 0.0 if i < 2 else None, (), None, 1000, 0)
                for i in range(4)]
    admitted = sweep_math.admitted_per_step(steps, requests)
    assert list(admitted) == [2, 0, 0]
    assert sweep_math.memory_wait_steps(steps, admitted, 4, 2048, 192) == 2


# -- sweep, end to end -------------------------------------------------------------------------
def sweep_json(capsys, tmp_path: Path, *extra: str) -> dict:
    return cli_json(capsys, ["sweep", "--executor", "fake", "--no-progress", "--out",
                             str(tmp_path), "--runs-dir", str(tmp_path / "runs"), *extra])


def test_sweep_smollm2_memory_gb_overrun_agrees(capsys, tmp_path):
    res = sweep_json(capsys, tmp_path, "--model", "smollm2-135m", "--memory-gb", "0.64")
    assert res["weight_bytes"] == SMOLLM2_WEIGHTS_F32
    assert res["kv_bytes_per_token"] == SMOLLM2_KV_F32
    assert res["analytic_overrun_batch"] == 12  # test_analytic_limit_by_hand
    batches = [r["batch"] for r in res["rows"]]
    assert batches == [1, 2, 4, 8, 11, 12, 13, 14, 16]
    measured = res["measured_overrun_batch"]
    assert measured in (12, 13) and res["agree_within_one_step"]
    for r in res["rows"]:
        assert {"batch", "decode_tok_s", "kv_bytes"} <= set(r)
        assert r["kv_bytes"] <= res["kv_budget_bytes"]  # the budget held
        assert r["kv_bytes_measured"] == r["kv_bytes"]
        assert r["completed"] == r["batch"]  # queued, not dropped
        assert r["overrun"] == (r["batch"] >= measured)
        if r["batch"] < measured:
            assert r["decoded_batch"] == r["batch"] and r["num_preemptions"] == 0
    assert all(r["decoded_batch"] < r["batch"] for r in res["rows"] if r["batch"] > 12)
    lines = (tmp_path / "sweep.jsonl").read_text().splitlines()
    assert len(lines) == len(batches)
    first = json.loads(lines[0])
    assert first["kind"] == "sweep" and first["env"]["backend"] and first["batch"] == 1
    assert Path(res["png"]).stat().st_size > 10_000 and Path(res["png"]).parent == tmp_path
    assert len(list((tmp_path / "runs").iterdir())) == len(batches)


def test_sweep_preempts_past_the_limit_when_rows_grow(capsys, tmp_path):
    # 64 + 250 - 1 = 313 tokens: the pool grows from 256 to 512 tokens a row while decoding, so
    # batches admitted at 256 overrun later and the newest requests are preempted.
    res = sweep_json(capsys, tmp_path, "--model", "tiny", "--prompt-len", "64", "--output-len",
                     "250", "--limit-batch", "6", "--batches", "4,5,6,7,8")
    assert res["seq_kv_tokens"] == 512
    assert res["analytic_overrun_batch"] == 6
    rows = {r["batch"]: r for r in res["rows"]}
    assert not any(rows[b]["overrun"] for b in (4, 5, 6))
    assert rows[7]["preempted"] and rows[8]["preempted"]
    assert res["measured_overrun_batch"] == 7 and res["agree_within_one_step"]
    assert rows[6]["kv_bytes"] == 6 * 512 * TINY_KV_F32 == rows[6]["kv_bytes_analytic"]


def test_sweep_limit_batch_sets_the_budget(capsys, tmp_path):
    res = sweep_json(capsys, tmp_path, "--model", "tiny", "--limit-batch", "3",
                     "--prompt-len", "32", "--output-len", "8")
    per_seq = 256 * TINY_KV_F32
    assert res["kv_bytes_per_seq"] == per_seq
    assert (res["prompt_len"], res["output_len"]) == (32, 8) and "mean_prompt_len" not in res
    assert 3 * per_seq <= res["kv_budget_bytes"] < 4 * per_seq
    assert res["analytic_overrun_batch"] == 3
    assert [r["batch"] for r in res["rows"]] == [1, 2, 3, 4, 5, 8]
    assert res["measured_overrun_batch"] == 4  # all prefill in one step: no spare-row effect


def test_sweep_real_mlx_tiny(capsys, tmp_path, tiny):
    res = cli_json(capsys, ["sweep", "--model", "tiny", "--dtype", "float32", "--no-progress",
                            "--prompt-len", "32", "--output-len", "8", "--limit-batch", "2",
                            "--batches", "1,2,3", "--out", str(tmp_path), "--runs-dir",
                            str(tmp_path / "runs")])
    assert res["executor"] == "mlx" and res["analytic_overrun_batch"] == 2
    assert res["measured_overrun_batch"] == 3 and res["agree_within_one_step"]
    for r in res["rows"]:
        assert r["kv_bytes_measured"] == r["kv_bytes"]  # MLX's arrays match the account
        assert r["peak_memory_source"] == "measured"
        assert r["active_memory_bytes"] >= res["weight_bytes"] + r["kv_bytes"] // 2
        assert r["decode_tok_s"] > 0 and r["decode_tok_s_source"] == "steady"
    assert [r["decoded_batch"] for r in res["rows"]] == [1, 2, 2]


def test_sweep_runs_the_users_workload_at_each_batch(capsys, tmp_path):
    """--workload (and the other workload flags `run` takes): each batch runs that traffic, its
    longest request sizing the analytic limit."""
    from batchsim.workloads.lengths import LengthSpec
    from batchsim.workloads.requests import build_requests
    from batchsim.workloads.spec import builtin_workload, with_overrides

    res = sweep_json(capsys, tmp_path, "--model", "tiny", "--workload", "shared-prompt",
                     "--num-prompts", "12", "--request-rate", "8", "--output-len", "16",
                     "--batches", "2,4")  # 8 req/s: 1.5 s of real traffic a batch, not 6
    assert res["workload"] == "shared-prompt" and res["num_prompts"] == 12
    assert all(r["completed"] == 12 for r in res["rows"])
    # its requests arrive over time: fewer than B decode together, yet none waited for memory
    assert not any(r["overrun"] for r in res["rows"]) and res["rows"][1]["decoded_batch"] < 4
    want = with_overrides(builtin_workload("shared-prompt"), num_prompts=12,
                          output_len=LengthSpec("fixed", value=16))
    requests = build_requests(want)
    longest = max(p.prompt_len + p.output_len for p in requests)
    assert res["longest_prompt_len"] + res["longest_output_len"] == longest
    prompts = [p.prompt_len for p in requests]
    # no one length: the workload's mean and max, not the longest request's, under their names
    assert res["mean_prompt_len"] == sum(prompts) / 12 and res["max_prompt_len"] == max(prompts)
    assert res["max_output_len"] == res["mean_output_len"] == res["longest_output_len"] == 16
    assert res["prompt_len"] is None and res["output_len"] is None
    assert min(prompts) < max(prompts)  # else the mean could pass for the longest
    rows = [json.loads(line) for line in (tmp_path / "sweep.jsonl").read_text().splitlines()]
    assert rows[-1]["mean_prompt_len"] == res["mean_prompt_len"] and rows[-1]["prompt_len"] is None
    trace = sweep_json(capsys, tmp_path, "--model", "tiny", "--trace",
                       "mooncake_conversation_slice.jsonl", "--num-prompts", "6",
                       "--max-input-len", "300", "--max-output-len", "8", "--batches", "2")
    assert trace["workload"] == "mooncake_conversation_slice"
    assert trace["rows"][0]["completed"] == 6 and trace["max_prompt_len"] <= 300


@pytest.mark.parametrize("argv, says", [
    (["--request-rate", "2"], "--request-rate: only with --workload or --trace"),
    (["--output-len", "uniform:4:8"], "--output-len: sweep's built-in workload takes a number"),
    (["--workload", "poisson", "--prompt-len", "64"], "--prompt-len sizes sweep's built-in"),
    (["--workload", "nope"], "workload 'nope': no such built-in"),
])
def test_sweep_workload_flags_misused_are_one_line_errors(argv, says, capsys, tmp_path):
    rc = main(["sweep", "--executor", "fake", "--model", "tiny", "--out", str(tmp_path), *argv])
    err = capsys.readouterr().err
    assert rc == 2 and says in err.strip().splitlines()[-1] and "Traceback" not in err


# -- compare -----------------------------------------------------------------------------------
def test_compare_fake_contract_and_same_requests(capsys, tmp_path):
    res = cli_json(capsys, ["compare", "--model", "tiny", "--executor", "fake", "--batch", "4",
                            "--num-prompts", "6", "--output-len", "uniform:4:12",
                            "--out", str(tmp_path), "--runs-dir", str(tmp_path / "runs")])
    b1, bn = res["batch1"], res["batched"]
    assert res["batch"] == 4 and b1["max_num_seqs"] == 1 and bn["max_num_seqs"] == 4
    assert b1["max_batch_size"] == 1 and bn["max_batch_size"] == 4
    assert b1["completed"] == bn["completed"] == 6
    for key in ("total_input_tokens", "total_output_tokens"):
        assert b1[key] == bn[key]
    assert res["speedup"] == pytest.approx(bn["output_throughput"] / b1["output_throughput"])
    assert res["ratios"]["mean_ttft_ms"] == pytest.approx(bn["mean_ttft_ms"] / b1["mean_ttft_ms"])

    def lengths(run_dir: str) -> list[tuple[int, int, int]]:
        lines = (Path(run_dir) / "requests.jsonl").read_text().splitlines()
        rows = [json.loads(x) for x in lines]
        return sorted((r["request_id"], r["num_prompt_tokens"], r["num_output_tokens"])
                      for r in rows)

    assert lengths(b1["run_dir"]) == lengths(bn["run_dir"])
    assert len({n for _, _, n in lengths(b1["run_dir"])}) > 1  # the lengths really vary
    (line,) = (tmp_path / "compare.jsonl").read_text().splitlines()
    row = json.loads(line)
    assert row["kind"] == "compare" and row["speedup"] == pytest.approx(res["speedup"])
    assert row["batch1"]["max_batch_size"] == 1 and row["env"]["backend"]
    assert row["batch1"]["peak_memory_bytes"] == b1["peak_memory_bytes"]  # bytes beside the GB
    assert Path(res["png"]).stat().st_size > 10_000


def test_compare_default_workload(capsys, tmp_path):
    res = cli_json(capsys, ["compare", "--model", "tiny", "--executor", "fake",
                            "--out", str(tmp_path), "--runs-dir", str(tmp_path / "runs")])
    assert res["batched"]["workload"] == "burst" and res["batch"] == 32
    assert res["batch1"]["completed"] == 20 and res["batch1"]["total_output_tokens"] == 20 * 32
    assert res["batched"]["max_batch_size"] == 20  # all at once: every request decodes together


def test_sweep_png_names_its_weights_as_size_does(tmp_path, capsys):
    """A 4-bit sweep's PNG was named sweep-MODEL-float16-...: the dtype, not the weights."""
    from batchsim.scripts import cli

    assert cli.main(["sweep", "--executor", "sim", "--device-profile", "M2 Max", "--model",
                     "llama-3.2-1b", "--quantize", "4", "--batches", "1,2", "--out",
                     str(tmp_path), "--runs-dir", str(tmp_path / "runs"), "--no-timeline",
                     "--no-progress", "--json"]) == 0
    png = last_json(capsys.readouterr().out)["png"]
    assert Path(png).name.startswith("sweep-llama-3.2-1b-q4-")


def test_a_trace_whose_longest_request_decodes_nothing_names_its_row(tmp_path, capsys):
    """Said "--output-len >= 2", a flag the user did not pass: now the trace, row and field."""
    trace = tmp_path / "t.jsonl"
    trace.write_text('{"timestamp": 50, "input_length": 10, "output_length": 5}\n\n'
                     '{"timestamp": 10, "input_length": 900, "output_length": 0}\n')
    assert main(["sweep", "--executor", "sim", "--device-profile", "M2 Max", "--model",
                 "llama-3.2-1b", "--trace", str(trace), "--out", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert f"trace {trace}: row 1, output_length 0" in err and "--output-len" not in err, err
