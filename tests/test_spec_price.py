"""Speculative decoding priced per Mac: the expected tokens per verify step, a verify step priced
as the decode step plus the prefill price of K more tokens a row (the step cost's own functions),
the batch-1 gain while decode is bandwidth-bound, the batch where speculation stops paying, and
`size`'s contract."""

from __future__ import annotations

import argparse

import pytest
from batchsim.configs import ConfigError
from batchsim.scripts import size
from batchsim.server.models.spec import zoo_spec
from batchsim.server.perf import spec_price
from batchsim.server.perf.spec_acceptance import Acceptance
from batchsim.server.perf.stepcost import StepCost

from tests.mac_costs import m2_ultra_cost


def _a(rate: float) -> Acceptance:
    return Acceptance((rate,))


def test_expected_tokens_per_step():
    assert _a(0.6).expected_tokens(4) == pytest.approx((1 - 0.6**5) / 0.4)
    assert _a(1.0).expected_tokens(4) == 5
    assert _a(1e-9).expected_tokens(8) == pytest.approx(1.0)


@pytest.fixture(scope="module")
def cost():
    return m2_ultra_cost()


def test_verify_step_is_decode_plus_the_prefill_price_of_k_more_tokens_a_row(cost):
    plain = cost.step_time(decode_rows=8, width=2048).total_s
    extra = (cost.prefill_time(5, 2048, True, rows=8).total_s
             - cost.prefill_time(1, 2048, True, rows=8).total_s)
    ngram = 8 * (spec_price.NGRAM_ROW_US * 1e-6 + spec_price.NGRAM_TOKEN_NS * 1e-9 * 2048)
    assert spec_price.verify_step(cost, 8, 4, 2048) == pytest.approx(plain + extra + ngram)
    assert spec_price.verify_step(cost, 8, 0, 2048) == pytest.approx(plain)
    assert plain < plain + extra < 5 * plain  # one weight read for 5 tokens a row


def test_a_draft_model_costs_k_of_its_decode_forwards_at_the_batchs_rows(cost):
    draft = spec_price.model_drafter(cost, zoo_spec("llama-3.2-1b"), "float16")
    assert (draft.cost.profile, draft.cost.engine, draft.cost.fmt) == (
        cost.profile, cost.engine, cost.fmt)  # the same device, engine and weight format
    one = draft.cost.decode_time(8, 2048).total_s
    assert spec_price.draft_s(draft, 8, 4, 2048) == pytest.approx(4 * one)
    parts = spec_price.verify_time(cost, 8, 4, 2048, draft)
    assert parts.draft_s == pytest.approx(4 * one)  # the part size --explain names
    assert parts.total_s == pytest.approx(spec_price.verify_step(cost, 8, 4, 2048, draft))
    # The drafter's time lowers the gain: a 1B drafter's more than the n-gram lookups.
    a, plain = _a(0.6), cost.step_time(decode_rows=1, width=2048).total_s
    free = a.expected_tokens(4) * plain / (plain + spec_price.verify_extra_s(cost, 1, 4, 2048))
    assert (spec_price.gain(cost, 1, 4, a, 2048, draft) < spec_price.gain(cost, 1, 4, a, 2048)
            < free)
    assert spec_price.draft_s(spec_price.NGRAM, 8, 0, 2048) == 0.0  # nobody asked for drafts


def test_speculation_pays_at_batch_1_and_stops_with_the_batch(cost):
    assert spec_price.gain(cost, 1, 4, _a(0.6), 2048) > 1.3  # bandwidth-bound: verify nearly free
    b = spec_price.break_even_batch(cost, 4, _a(0.6), 2048, 4096)
    assert b is not None and b > 1
    assert spec_price.gain(cost, b - 1, 4, _a(0.6), 2048) > 1 >= spec_price.gain(
        cost, b, 4, _a(0.6), 2048)
    assert spec_price.break_even_batch(cost, 4, _a(0.0), 2048, 4096) == 1  # drafts all rejected
    assert spec_price.break_even_batch(cost, 4, _a(0.6), 2048, b - 1) is None  # pays to max batch


@pytest.mark.parametrize("argv,said", [
    (["--acceptance", "0.6", "--memory-gb", "4"], "not_computed"),  # no batch fits
    (["--acceptance", "0.01"], "never_pays"),  # drafts all but rejected
    # every draft kept, at most 4 rows (32k contexts in 36 GB): still bandwidth-bound
    (["--acceptance", "1", "--context", "32768", "--memory-gb", "36"], "pays_at_every_batch"),
])
def test_size_says_what_its_break_even_batch_means(tmp_path, argv, said):
    (row,) = _size(tmp_path, "--model", "llama-3.1-8b", "--quantize", "4", "--spec-tokens", "4",
                   "--mac", "M4 Max 40c", *argv)["rows"][:1]
    assert row["spec_break_even"] == said
    assert row["spec_break_even_batch"] == (1 if said == "never_pays" else None)


def test_break_even_verdicts():
    verdict = spec_price.break_even_verdict
    assert [verdict(7), verdict(1), verdict(None), verdict(None, computed=False)] == [
        "stops_paying", "never_pays", "pays_at_every_batch", "not_computed"]


def _size(tmp_path, *argv: str) -> dict:
    parser = argparse.ArgumentParser()
    size.add_parser(parser)
    return size.run(parser.parse_args([*argv, "--out", str(tmp_path)]))


def test_size_rows_carry_the_spec_keys(tmp_path):
    summary = _size(tmp_path, "--model", "llama-3.1-8b", "--mac", "M4 Max 40c",
                    "--spec-tokens", "4", "--acceptance", "0.6")
    assert summary["spec_tokens"] == 4 and summary["acceptance"] == [0.6]
    for row in summary["rows"]:
        assert row["decode_tok_s_b1_spec"] > row["decode_tok_s_b1"]
        assert row["spec_break_even_batch"] is None or 1 <= row["spec_break_even_batch"] <= max(
            row["max_batch"], 1)
    plain = _size(tmp_path, "--model", "llama-3.1-8b", "--mac", "M4 Max 40c")
    assert "decode_tok_s_b1_spec" not in plain["rows"][0]


def test_size_spec_flags_go_together(tmp_path):
    with pytest.raises(ConfigError, match="--spec-tokens and --acceptance .* go together"):
        _size(tmp_path, "--model", "llama-3.1-8b", "--spec-tokens", "4")


def test_size_spec_columns_with_macs_the_model_does_not_fit(tmp_path):
    summary = _size(tmp_path, "--model", "qwen3-30b-a3b", "--quantize", "4", "--mac", "M1 8c",
                    "--spec-tokens", "4", "--acceptance", "0.55,0.37,0.28,0.23",
                    "--acceptance-curve", "mtplx")
    assert summary["acceptance"] == [0.55, 0.37, 0.28, 0.23]
    assert summary["acceptance_curve"] == "mtplx" and summary["draft_share"] == 1.0
    assert all(r["decode_tok_s_b1"] is None for r in summary["rows"])  # 8 and 16 GB: no fit


def test_a_falling_curve_moves_the_break_even_batch_down(cost):
    flat, dflash = Acceptance((0.8,)), Acceptance((0.8,), "dflash-mlx-vlm")
    assert spec_price.gain(cost, 1, 4, dflash, 2048) == spec_price.gain(cost, 1, 4, flat, 2048)
    assert spec_price.gain(cost, 8, 4, dflash, 2048) < spec_price.gain(cost, 8, 4, flat, 2048)
    falling = spec_price.break_even_batch(cost, 4, dflash, 2048, 4096)
    still = spec_price.break_even_batch(cost, 4, flat, 2048, 4096)
    assert falling is not None and (still is None or falling <= still)


def test_a_paged_verify_step_pays_the_gather_once_for_its_k_plus_1_tokens(cost):
    # The real paged store gathers each row's blocks once per layer per forward (paged_store.py),
    # however many query tokens the row verifies: the decode read carries PAGED_READ_RATIO, the
    # K more tokens a row add no second read.
    cost, paged = (StepCost(cost.spec, cost.profile, "float16", 4, paged=p) for p in (0, 1))
    extra = spec_price.verify_extra_s(cost, 8, 4, 2048)
    assert spec_price.verify_extra_s(paged, 8, 4, 2048) == pytest.approx(extra)
    gather = (paged.step_time(decode_rows=8, width=2048).attention_s
              - cost.step_time(decode_rows=8, width=2048).attention_s)
    assert gather > 0
    assert (spec_price.verify_step(paged, 8, 4, 2048) - spec_price.verify_step(cost, 8, 4, 2048)
            == pytest.approx(gather))


def test_size_explain_names_the_drafters_part(tmp_path):
    (row,) = _size(tmp_path, "--model", "llama-3.1-8b", "--quantize", "4", "--mac",
                   "M4 Max 40c", "--memory-gb", "48", "--spec-tokens", "4", "--acceptance",
                   "0.6", "--explain")["rows"]
    assert row["parts_b1"]["draft_s"] == 0.0  # plain decoding drafts nothing
    assert row["parts_spec_b1"]["draft_s"] == pytest.approx(
        spec_price.draft_s(spec_price.NGRAM, 1, 4, 4096))


def test_size_refuses_a_draft_model_a_run_refuses(tmp_path):
    """`size --draft-model` checked only the vocabulary and priced a sliding-window drafter that
    `run` (real or simulated) refuses: one check now serves all three."""
    from batchsim.configs import ConfigError

    with pytest.raises(ConfigError, match="sliding-attention layers, whose cache cannot roll"):
        _size(tmp_path, "--model", "tiny", "--mac", "M4 Max 40c", "--spec-tokens", "2",
              "--acceptance", "0.5", "--draft-model", "tiny-sliding")
    # nor speculation on a target whose own cache cannot roll back (run refuses it up front)
    with pytest.raises(ConfigError, match="--spec-method ngram: the model has sliding-attention"):
        _size(tmp_path, "--model", "tiny-sliding", "--mac", "M4 Max 40c", "--spec-tokens", "2",
              "--acceptance", "0.5")
    _size(tmp_path, "--model", "tiny-sliding", "--mac", "M4 Max 40c")  # without it: fine


def test_size_refuses_a_stored_draft_in_another_format_as_run_does(tiny, tmp_path):
    """`size --draft-model DIR` priced a float32 directory as a 4-bit draft (run refuses it:
    mlx-lm loads it as stored); the one check (spec_price.draft_spec) serves both now."""
    from batchsim.configs import ConfigError

    args = ("--model", "tiny", "--mac", "M4 Max 40c", "--spec-tokens", "2", "--acceptance",
            "0.5", "--dtype", "float32", "--draft-model", str(tiny[0].path))
    with pytest.raises(ConfigError, match="stored as float32 weights"):
        _size(tmp_path, *args, "--quantize", "4")
    _size(tmp_path, *args)  # in the target's format: priced
