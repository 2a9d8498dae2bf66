"""Speculative decoding in the simulated executor and the acceptance it draws from: a verify step
of B x (K+1) tokens priced by the one step cost, accepted drafts drawn per position (seeded), the
scheduler's budget as in real runs, acceptance that falls with the batch, and the run flags."""

from __future__ import annotations

import json

import pytest
from batchsim.configs import ConfigError
from batchsim.server.executors.sim_executor import SimExecutor
from batchsim.server.executors.sim_spec import SpecDraws
from batchsim.server.models.spec import zoo_spec
from batchsim.server.perf import macs, spec_price
from batchsim.server.perf.gpu_fit import load_fit, mac_profile
from batchsim.server.perf.spec_acceptance import Acceptance, curve_points, parse_rates
from batchsim.server.perf.stepcost import StepCost

from tests.cli_calls import cli_exit_code, last_json
from tests.drivers import config, drive, make_request


@pytest.fixture(scope="module")
def cost():
    mac, _ = macs.load_catalog().variant("M2 Ultra 76c")
    return StepCost(zoo_spec("llama-3.1-8b"), mac_profile(mac, load_fit(), 4), "float16", 4)


def _run(cost, spec_tokens: int, rates: tuple[float, ...], rows: int = 4, out: int = 21,
         seed: int = 0, drafter: spec_price.Drafter = spec_price.NGRAM):
    from batchsim.scheduler.scheduler import Scheduler

    sched = Scheduler(config(kv_bytes_per_token=cost.kv_bytes_per_token, max_num_seqs=rows,
                             spec_tokens=spec_tokens, spec_policy="fixed"))
    spec = SpecDraws(Acceptance(rates), seed, drafter) if spec_tokens else None
    ex = SimExecutor(cost, spec=spec)
    results = []
    real_execute = ex.execute

    def execute(plan, max_elapsed_s=float("inf")):
        results.append((plan, real_execute(plan, max_elapsed_s)))
        return results[-1][1]

    ex.execute = execute
    trace = drive(sched, ex, [(0, make_request(i, 64, out)) for i in range(rows)])
    return trace, results


def _verify_steps(results):
    return [(p, r) for p, r in results if p.decode_spec_tokens]


def test_full_acceptance_emits_k_plus_1_tokens_a_step_at_the_verify_price(cost):
    trace, results = _run(cost, 4, (1.0,), rows=4, out=1 + 4 * 5)  # 4 verify steps of 5 tokens
    steps = _verify_steps(results)
    assert len(steps) == 4 and not [p for p, _ in results if p.decode_ids and
                                    not p.decode_spec_tokens]
    same_pool = 0
    for (plan, result), (before, _) in zip(steps, [results[0], *steps]):
        assert result.accepted_ids == ((0,) * 4,) * 4 and result.num_drafted == (4,) * 4
        start = max(plan.decode_positions)
        price = (cost.step_overhead_s + cost.decode_forward_s(4, start + 1)
                 + spec_price.verify_extra_s(cost, 4, 4, start)
                 + spec_price.draft_s(spec_price.NGRAM, 4, 4, start + 1))  # 4 rows' lookups
        if plan.pool == before.pool:  # else the pool's copies are priced too
            same_pool += 1
            assert result.elapsed_s == pytest.approx(price)
    assert same_pool >= 2
    assert all(r.num_output_tokens == 21 for r in trace.requests.values())


def test_a_draft_model_is_priced_as_k_of_its_decode_forwards_over_the_rows(cost):
    # ... and, the first time a row asks, as a prefill of its context (the real drafter's
    # catch-up: draft_model.py), at the draft model's price of a prefill of that many tokens.
    draft = spec_price.model_drafter(cost, zoo_spec("llama-3.2-1b"), "float16")
    _, ngram = _run(cost, 4, (0.5,), rows=4, out=21, seed=1)
    _, model = _run(cost, 4, (0.5,), rows=4, out=21, seed=1, drafter=draft)
    assert [p.decode_spec_tokens for p, _ in ngram] == [p.decode_spec_tokens for p, _ in model]
    caught_up: list[int] = []
    held_more = 0  # verify steps where the draft model holds rows that ask for no drafts
    for (plan, a), (_, b) in zip(ngram, model):
        caught_up = [rid for rid in caught_up if rid not in plan.free_ids]  # left: forgotten
        if plan.decode_spec_tokens:
            width, asked = max(plan.decode_positions) + 1, plan.decode_spec_tokens
            k, n = max(asked), sum(x > 0 for x in asked)  # rows near max_tokens ask for fewer
            # The draft model drafts every row it holds at K (draft_model.py), asking or not.
            held = len({*caught_up, *(r for r, x in zip(plan.decode_ids, asked) if x)})
            held_more += held > n
            forwards = k * draft.cost.decode_time(held, width).total_s
            new = [pos for rid, pos, x in zip(plan.decode_ids, plan.decode_positions, asked)
                   if x and rid not in caught_up]
            caught_up += [rid for rid, x in zip(plan.decode_ids, asked)
                          if x and rid not in caught_up]
            prefill = sum(draft.cost.prefill_forward_s(pos, 0, False) for pos in new)
            assert b.elapsed_s - a.elapsed_s == pytest.approx(
                forwards + prefill - spec_price.draft_s(spec_price.NGRAM, n, k, width))
        else:
            assert b.elapsed_s == a.elapsed_s
    assert held_more  # a row at its last token asked for none and was drafted for
    # 64 prompt tokens and the first sampled one: 64 tokens prefilled, the 65th fed by drafting
    first = next(p for p, _ in model if p.decode_spec_tokens)
    assert set(first.decode_positions) == {64}
    # (before: priced as one token, inside the first of the K decode forwards)
    assert spec_price.catch_up_s(draft, [64]) > 2 * draft.cost.decode_time(1, 65).total_s


def test_simulated_draft_model_runs_and_refuses_another_vocabulary(tmp_path, capsys):
    argv = ["run", "--executor", "sim", "--model", "llama-3.1-8b", "--quantize", "4",
            "--device-profile", "M2 Ultra", "--num-prompts", "2", "--output-len", "9",
            "--out", str(tmp_path), "--no-progress", "--no-timeline", "--spec-method", "draft",
            "--spec-tokens", "2", "--acceptance", "0.6", "--draft-model"]
    assert cli_exit_code([*argv, "llama-3.2-1b"]) == 0
    assert last_json(capsys.readouterr().out)[
        "spec_decode_num_drafts"] > 0
    for draft, message in (("qwen3-0.6b", "must share the tokenizer"),
                           ("tiny-sliding", "sliding-attention layers")):
        assert cli_exit_code([*argv, draft]) == 2
        err = capsys.readouterr().err
        assert message in err.strip().splitlines()[-1] and "Traceback" not in err


def test_sweep_prices_a_draft_model(capsys, tmp_path):
    args = ("--batches", "1", "--spec-tokens", "2", "--acceptance", "0.6")
    ngram = _sweep(capsys, tmp_path, *args)["rows"][0]["spec"][0]
    model = _sweep(capsys, tmp_path, *args, "--draft-model", "llama-3.2-1b")["rows"][0]["spec"][0]
    assert model["spec_decode_acceptance_length"] == ngram["spec_decode_acceptance_length"]
    assert model["gain"] < ngram["gain"]  # the same tokens, two 1B forwards a step more


def test_no_acceptance_gives_plain_decodes_tokens_at_the_verify_price(cost):
    _, plain = _run(cost, 0, (), rows=4, out=9)
    _, spec = _run(cost, 4, (0.0,), rows=4, out=9)
    plain_steps = sum(r.num_steps for p, r in plain if p.decode_ids)
    assert sum(r.num_steps for p, r in spec if p.decode_ids) == plain_steps == 8  # a token each
    verify = _verify_steps(spec)
    assert len(verify) == 7  # the last token drafts nothing (max_tokens)
    assert all(not any(r.accepted_ids) for _, r in verify)
    plain_s = sum(r.elapsed_s for _, r in plain)
    spec_s = sum(r.elapsed_s for _, r in spec)
    extra = sum(spec_price.verify_extra_s(cost, 4, max(p.decode_spec_tokens),
                                          max(p.decode_positions))
                + spec_price.draft_s(spec_price.NGRAM, sum(k > 0 for k in p.decode_spec_tokens),
                                     max(p.decode_spec_tokens), max(p.decode_positions) + 1)
                for p, _ in verify)
    assert spec_s == pytest.approx(plain_s + extra)


def test_draws_follow_the_per_position_rates_and_the_seed():
    rates = (0.8, 0.5, 0.2)
    draws = SpecDraws(Acceptance(rates), seed=3)
    kept = [len(a) for _ in range(4000) for a in draws.draw((3,), 1)[0]]
    for i, rate in enumerate(rates):
        assert sum(n > i for n in kept) / len(kept) == pytest.approx(rate, abs=0.03)
    again = SpecDraws(Acceptance(rates), seed=3)
    assert [len(a) for _ in range(4000) for a in again.draw((3,), 1)[0]] == kept
    accepted, drafted = draws.draw((3, 0), 3)  # a prefill row sampled too: nothing drafted
    assert drafted == (3, 0, 0) and accepted[1:] == ((), ())


def test_a_draft_share_below_1_leaves_rows_undrafted_and_prices_the_step_by_what_was_drafted(
        cost):
    draws = SpecDraws(Acceptance((1.0,), draft_share=0.3), seed=2)
    results = [draws.draw((4,) * 8, 8) for _ in range(500)]
    drafted = [d for _, ds in results for d in ds]
    assert sum(d > 0 for d in drafted) / len(drafted) == pytest.approx(0.3, abs=0.03)
    assert all(len(a) == d for acc, ds in results for a, d in zip(acc, ds))  # rate 1: all kept
    assert Acceptance((0.5,), draft_share=0.2).expected_tokens(2) == pytest.approx(1 + 0.2 * 0.75)
    _, never = _run(cost, 4, (1.0,), rows=1, out=9)
    plan = _verify_steps(never)[0][0]
    elapsed = {}
    for share in (1e-9, 1.0):  # the same step from the same state, drafting or not
        ex = SimExecutor(cost, spec=SpecDraws(Acceptance((1.0,), draft_share=share), 0))
        ex.execute(never[0][0])  # the prefill: the row joins the pool
        result = ex.execute(plan)
        elapsed[share] = result.elapsed_s
        assert result.num_drafted == ((0,) if share < 1 else (4,))
    start = max(plan.decode_positions)
    assert elapsed[1.0] - elapsed[1e-9] == pytest.approx(spec_price.verify_extra_s(cost, 1, 4,
                                                                                   start))
    assert spec_price.verify_extra_s(cost, 1, 4, start) > 0


def test_acceptance_from_a_run_reads_its_draft_share(tmp_path):
    from batchsim.server.perf.spec_acceptance import from_run

    (tmp_path / "summary.json").write_text(json.dumps({
        "spec_decode_per_position_acceptance_rates": [0.6, 0.3], "total_output_tokens": 100,
        "completed": 4, "spec_decode_accepted_tokens": 16, "spec_decode_num_drafts": 20}))
    assert from_run(tmp_path) == ((0.6, 0.3), pytest.approx(20 / 80))  # 80 decode steps


def test_draws_fall_with_the_batch_on_a_falling_curve():
    def kept(curve: str, batch: int) -> float:
        draws = SpecDraws(Acceptance((0.9, 0.8, 0.7), curve), seed=1)
        return sum(len(a) for _ in range(300) for a in draws.draw((3,) * batch, batch)[0])

    assert kept("flat", 8) / 8 == pytest.approx(kept("flat", 1), rel=0.1)
    assert kept("dflash-mlx-vlm", 8) / 8 < 0.15 * kept("dflash-mlx-vlm", 1)  # 0.22 / 3.1


def test_rates_extend_past_the_list_and_fall_with_a_curve():
    assert Acceptance((0.6,)).expected_tokens(4) == pytest.approx((1 - 0.6**5) / 0.4)
    assert Acceptance((0.8, 0.4)).position_rates(4) == pytest.approx([0.8, 0.4, 0.2, 0.1])
    assert Acceptance((0.8, 0.4)).expected_tokens(0) == 1.0  # K = 0: plain decoding
    dflash = Acceptance((0.9, 0.8), "dflash-mlx-vlm")
    assert dflash.expected_tokens(2, 1) == pytest.approx(2.7)
    assert dflash.expected_tokens(2, 8) - 1 == pytest.approx(1.7 * (0.22 / 3.1))
    assert dflash.expected_tokens(2, 64) == dflash.expected_tokens(2, 8)  # held past its end
    (b1, f1), *_, (b32, f32) = curve_points("mtplx")
    assert (b1, f1, b32) == (1, 1.0, 32) and f32 == pytest.approx(1.829 / 2.879)


@pytest.mark.parametrize(("text", "message"), [
    ("0.5,0.7", "cannot rise"), ("1.5", "in 0..1"), ("x", "not a rate")])
def test_bad_rates_are_one_line_errors(text, message):
    with pytest.raises(ConfigError, match=message):
        parse_rates(text)


def test_a_simulated_run_speculates_from_a_real_runs_rates(tmp_path, capsys):
    src = tmp_path / "real"
    src.mkdir()
    (src / "summary.json").write_text(json.dumps(
        {"spec_decode_per_position_acceptance_rates": [0.7, 0.4]}))
    argv = ["run", "--executor", "sim", "--model", "llama-3.1-8b", "--device-profile",
            "M2 Ultra", "--num-prompts", "4", "--request-rate", "inf", "--input-len", "64",
            "--output-len", "33", "--out", str(tmp_path / "runs"), "--no-progress",
            "--no-timeline", "--spec-method", "ngram", "--spec-tokens", "2",
            "--acceptance-from", str(src)]
    assert cli_exit_code(argv) == 0
    summary = last_json(capsys.readouterr().out)
    assert summary["spec_decode_num_drafts"] > 0
    assert summary["spec_decode_per_position_acceptance_rates"][0] == pytest.approx(0.7, abs=0.2)
    assert summary["completed"] == 4 and summary["kv_account_mismatches"] == 0


@pytest.mark.parametrize(("extra", "message"), [
    (["--spec-method", "ngram", "--spec-tokens", "2"], "--acceptance A"),
    (["--spec-method", "ngram", "--spec-tokens", "2", "--acceptance", "0.5",
      "--acceptance-from", "x"], "give one"),
    (["--spec-method", "ngram", "--spec-tokens", "2", "--acceptance-from", "/nonexistent"],
     "cannot read"),
    (["--acceptance", "0.5"], "needs --spec-method")])
def test_bad_simulated_spec_flags_are_one_line_errors(tmp_path, capsys, extra, message):
    argv = ["run", "--executor", "sim", "--model", "llama-3.1-8b", "--num-prompts", "1",
            "--out", str(tmp_path), "--no-progress", *extra]
    assert cli_exit_code(argv) != 0
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err


def _sweep(capsys, tmp_path, *extra: str) -> dict:
    from batchsim.scripts.cli import main

    # float16: a verify step's few rows then stream the weights once (a 4-bit layer over a few
    # rows runs MLX's qmv, every row's arithmetic again: server/perf/qmv.py)
    assert main(["sweep", "--executor", "sim", "--model", "llama-3.1-8b", "--dtype", "float16",
                 "--device-profile", "M2 Ultra", "--memory-gb", "64", "--no-progress",
                 "--no-timeline",
                 "--prompt-len", "64", "--output-len", "17", "--out", str(tmp_path),
                 "--runs-dir", str(tmp_path / "runs"), *extra]) == 0
    return last_json(capsys.readouterr().out)


def test_sweep_spec_tokens_finds_where_speculation_stops_paying(capsys, tmp_path):
    res = _sweep(capsys, tmp_path, "--batches", "1,4,16", "--spec-tokens", "2,4",
                 "--acceptance", "0.6")
    gains = {r["batch"]: {e["spec_tokens"]: e["gain"] for e in r["spec"]} for r in res["rows"]}
    assert gains[1][2] > 1 and gains[1][4] > 1  # batch 1: bandwidth-bound, verify nearly free
    for k in (2, 4):
        assert gains[16][k] < gains[1][k]  # batching spends the same headroom
        stop = res["spec_break_even_batch"][str(k)]
        assert stop == min((b for b in (1, 4, 16) if gains[b][k] <= 1), default=None)
        assert res["spec_break_even"][str(k)] == (  # what a null means, said
            "pays_at_every_batch" if stop is None else "never_pays" if stop == 1
            else "stops_paying")
    assert res["spec_break_even_batch"]["4"] is not None
    assert all(e["spec_break_even_batch"] == res["spec_break_even_batch"][str(e["spec_tokens"])]
               for r in res["rows"] for e in r["spec"])
    entry = res["rows"][0]["spec"][0]
    assert entry["spec_decode_acceptance_length"] > 1 and entry["spec_decode_num_drafts"] > 0
    late = _sweep(capsys, tmp_path, "--batches", "16", "--spec-tokens", "4", "--acceptance",
                  "0.01")  # loses at its first swept batch, 16: batch 1 was not tried
    assert late["spec_break_even_batch"]["4"] == 16
    assert late["spec_break_even"]["4"] == "stops_paying"  # was never_pays
    few = _sweep(capsys, tmp_path, "--batches", "1", "--spec-tokens", "2", "--acceptance", "0.6",
                 "--draft-share", "0.5")["rows"][0]["spec"][0]
    assert 0 < few["spec_decode_num_drafts"] < entry["spec_decode_num_drafts"]


def test_sweep_spec_flags_are_checked_before_it_runs(capsys, tmp_path):
    from batchsim.scripts.cli import main

    for extra, message in ((["--acceptance", "0.5"], "need --spec-tokens"),
                           (["--spec-tokens", "2"], "--acceptance A")):
        assert main(["sweep", "--executor", "sim", "--model", "llama-3.1-8b", "--no-progress",
                     "--device-profile", "M2 Ultra", "--out", str(tmp_path), "--runs-dir",
                     str(tmp_path / "r"), *extra]) == 2
        err = capsys.readouterr().err
        assert message in err and "Traceback" not in err
        assert not (tmp_path / "r").exists()  # refused before any point ran
