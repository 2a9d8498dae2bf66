"""Every published row predicted by simulating what its source ran, the fit on all of them, and its
cross-validation by source and chip (server.published: sim, fit, cv)."""

from __future__ import annotations

import argparse
import dataclasses

import pytest
import yaml
from batchsim.scripts import fit_macs
from batchsim.server.perf import gpu_fit, macs
from batchsim.server.perf.engines import ENGINES_DIR, load_engine
from batchsim.server.perf.reference import load_published
from batchsim.server.published import cv as mac_cv
from batchsim.server.published import fit as published_fit
from batchsim.server.published import sim as ps
from batchsim.server.published import solve
from batchsim.server.published.sim import MacModel


@pytest.fixture(scope="module")
def catalog():
    return macs.load_catalog()


@pytest.fixture(scope="module")
def rows():
    return list(load_published().rows)


def _row(rows, **kw):
    return next(r for r in rows if all(getattr(r, k) == v for k, v in kw.items()))


def test_a_server_figure_with_prefill_is_the_simulated_run(rows, catalog):
    fit = MacModel(gpu_fit.load_fit())
    row = _row(rows, batch=5, measures="aggregate", decode_only=False)
    run = ps.priced(row, catalog, fit)
    gen = ps.tokens(row)[1]
    # The fit's parts add up to the simulated run's time (pool copies aside)...
    sim_s = row.batch * gen / ps.predict_tok_s(row, catalog, fit)
    assert run.decode.total_s + run.prefill.total_s == pytest.approx(sim_s, rel=5e-3)
    assert run.prefill.total_s > 0
    # ...and counting prefill makes it slower than the same batch's decode alone.
    decode_only = dataclasses.replace(row, decode_only=True)
    assert ps.predict_tok_s(row, catalog, fit) < ps.predict_tok_s(decode_only, catalog, fit)
    one = dataclasses.replace(row, batch=1, measures="per_request")
    assert ps.predict_tok_s(one, catalog, fit) < ps.predict_tok_s(
        dataclasses.replace(one, decode_only=True), catalog, fit)


def test_a_prompt_cached_row_is_a_second_round_with_the_prompt_in_the_prefix_cache(rows, catalog):
    """mlxcel-server's ladder: each level's clients send the prompt the level before left cached."""
    fit = MacModel(gpu_fit.load_fit())
    row = _row(rows, id="mlxcel-m5max-llama-3.1-8b-q4-b4-agg")
    assert row.prompt_cached and row.prompt_tokens == 467
    cold = dataclasses.replace(row, prompt_cached=False)
    cached_tok_s = ps.predict_tok_s(row, catalog, fit)
    assert cached_tok_s > 1.2 * ps.predict_tok_s(cold, catalog, fit)
    # The fit's parts are the measured round's (its prefill only the uncached tail)...
    run, cold_run = ps.priced(row, catalog, fit), ps.priced(cold, catalog, fit)
    assert run.prefill.total_s < 0.1 * cold_run.prefill.total_s
    # ...and add up to its simulated time.
    sim_s = row.batch * ps.tokens(row)[1] / cached_tok_s
    assert run.decode.total_s + run.prefill.total_s == pytest.approx(sim_s, rel=5e-3)
    with pytest.raises(ValueError, match="prompt_cached"):
        dataclasses.replace(row, decode_only=True)


def test_a_row_whose_requests_partly_reused_the_cached_prompt_mixes_both_runs(rows, catalog):
    """mlxcel-server --parallel 1 (one request at a time): about half the requests adopted the
    cached prompt (cached_share 0.5); the figure is half a cached run's time and half a cold one's,
    and the fit's parts mix the same way."""
    fit = MacModel(gpu_fit.load_fit())
    row = _row(rows, id="mlxcel-m1ultra-llama-3.1-8b-q4-b4-p1")
    assert row.cached_share == 0.5 and not row.prompt_cached
    (w1, cached), (w2, cold) = ps.mixed(row)
    assert (w1, w2, cached.prompt_cached, cold.prompt_cached) == (0.5, 0.5, True, False)
    rate = [ps.predict_tok_s(r, catalog, fit) for r in (cached, cold)]
    assert ps.predict_tok_s(row, catalog, fit) == pytest.approx(2 / (1 / rate[0] + 1 / rate[1]))
    assert rate[1] < ps.predict_tok_s(row, catalog, fit) < rate[0]
    parts = [sum(x.total_s for x in ps.priced(r, catalog, fit)) for r in (row, cached, cold)]
    assert parts[0] == pytest.approx((parts[1] + parts[2]) / 2)
    for bad in ({"cached_share": 1.0}, {"prompt_cached": True}, {"decode_only": True}):
        with pytest.raises(ValueError, match="cached_share"):
            dataclasses.replace(row, **bad)


def test_gain_pairs_a_batched_row_with_its_batch_1_row(rows):
    b5 = _row(rows, batch=5, measures="aggregate")
    b1 = next(r for r in rows if r.batch == 1 and mac_cv._setup(r) == mac_cv._setup(b5))
    per_req = dataclasses.replace(b5, id="x", measures="per_request", tok_s=b5.tok_s / 5)
    other = dataclasses.replace(b1, id="y", src="elsewhere")  # another source: no partner
    pick = [b1, b5, per_req, other]
    assert mac_cv.gain_pairs(pick) == [(1, 0), (2, 0)]
    predicted = [2 * b1.tok_s, 3 * b5.tok_s, 3 * per_req.tok_s, other.tok_s]
    errs = mac_cv.errors(pick, predicted)
    assert [e for _, e in errs["gain"]] == pytest.approx([0.5, 0.5])  # (3 / 2) - 1
    assert [e for _, e in errs["b1"]] == pytest.approx([1.0, 0.0])
    assert mac_cv.summary([0.1, -0.3, 0.2]) == {"n": 3, "median_abs": 0.2, "worst_abs": 0.3}
    assert mac_cv.summary([])["n"] == 0


def test_fit_recovers_known_terms_from_rows_it_predicted(rows, catalog):
    zero = dataclasses.replace(gpu_fit.load_fit(), attention_row_us=0.0, sampling_row_us=0.0,
                               ultra_layer_us=0.0, ultra_bandwidth_slowdown=0.0,
                               quantized_gemm_efficiency={}, kv_bandwidth_efficiency=0.0,
                               quantized_gemv_row_efficiency=0.0, ultra_gemv_row_slowdown=0.0)
    true = MacModel(dataclasses.replace(zero, bandwidth_efficiency={
        "float": 0.8, "q8": 0.7, "q4": 0.6}, layer_overhead_us=40.0, forward_overhead_us=0.0,
        compute_efficiency=0.5, expert_bandwidth_efficiency=0.5, ultra_layer_us=30.0,
        kv_bandwidth_efficiency=0.75, quantized_gemv_row_efficiency=0.4,
        ultra_gemv_row_slowdown=2.5))
    made = [dataclasses.replace(r, tok_s=ps.predict_tok_s(r, catalog, true)) for r in rows]
    got = published_fit.fit_published(made, catalog, MacModel(zero)).fit
    for f, v in true.fit.bandwidth_efficiency.items():
        assert got.bandwidth_efficiency[f] == pytest.approx(v, rel=0.02)
    assert got.layer_overhead_us == pytest.approx(40.0, rel=0.05)
    assert got.ultra_layer_us == pytest.approx(30.0, rel=0.1)
    assert got.expert_bandwidth_efficiency == pytest.approx(0.5, abs=0.03)
    assert got.quantized_gemv_row_efficiency == pytest.approx(0.4, rel=0.05)  # qmv's rows
    assert got.ultra_gemv_row_slowdown == pytest.approx(2.5, rel=0.05)  # ... on two dies
    # Held out by source: exact for batch-1 decode-only rows (bandwidth and fixed costs), but where
    # the source took its format's only rows with it (bfloat16); batched and prefill rows need
    # compute rates that only a few sources pin down. Five sources (four chips, both formats, an
    # Ultra, a single-source engine) are held out in turn: every fold is a full fit (seconds each).
    fitter = mac_cv.published_fitter(())  # no prompt rates: the prior compute rate
    errs = []
    for src in HELD_SOURCES:
        fit = fitter([r for r in made if r.src != src], catalog)
        errs += [ps.predict_tok_s(r, catalog, fit) / r.tok_s - 1 for r in made
                 if r.src == src and r.weights != "bfloat16" and r.decode_only and r.batch == 1]
    assert len(errs) >= 40 and max(map(abs, errs)) < 0.03


HELD_SOURCES = ("mlx_examples_1029", "mlxcel_m1ultra_tests", "vllm_mlx_llm", "mlx_lm_benchmarks",
                "llmfit_1031")


def test_fit_macs_reports_cv_by_source_and_chip(monkeypatch, rows):
    few = [r for r in rows if r.src in {"vllm_mlx_llm", "rapid_mlx_636", "mlx_examples_1029"}]
    published = dataclasses.replace(load_published(), rows=tuple(few))
    monkeypatch.setattr(fit_macs, "load_published", lambda: published)
    parser = argparse.ArgumentParser()
    fit_macs.add_parser(parser)
    cv = fit_macs.run(parser.parse_args([]))["cv"]
    for fold in ("leave_one_source_out", "leave_one_chip_out"):
        for k in ("b1", "batched", "gain"):
            assert set(cv[fold][k]) == {"n", "median_abs", "worst_abs"}
            assert set(cv["before"][fold][k]) == {"n", "median_abs", "worst_abs"}
        assert cv[fold]["batched"]["n"] == sum(r.batch > 1 for r in few)
        assert set(cv[fold]["by_engine"]) == {ps.engine_name(r) for r in few}
    assert [r["id"] for r in cv["rows"]] == [r.id for r in few]
    assert all(r["before_tok_s"] > 0 and r["after_tok_s"] > 0
               and r["leave_one_source_out_tok_s"] > 0 for r in cv["rows"])
    # the batch-1-only fit's held-out predictions too: its summary under `before` is theirs
    for fold in ("leave_one_source_out", "leave_one_chip_out"):
        before = [r[f"before_{fold}_tok_s"] for r in cv["rows"]]
        assert mac_cv.report(few, before)["b1"] == cv["before"][fold]["b1"]


def test_two_die_terms_apply_to_ultra_chips_only(catalog):
    fit = dataclasses.replace(gpu_fit.load_fit(), layer_overhead_us=20.0, ultra_layer_us=50.0,
                              ultra_bandwidth_slowdown=0.5, cpu_exponent=0.0)  # CPU: its own test
    (ultra,) = [m for m in catalog.chips if m.label == "M3 Ultra 60c"]
    (single,) = [m for m in catalog.chips if m.label == "M4 Max 40c"]
    eff = fit.bandwidth_efficiency["q4"]
    p = gpu_fit.mac_profile(ultra, fit, 4)
    assert p.layer_overhead_s == pytest.approx(70e-6)
    assert p.bandwidth_efficiency == pytest.approx(1 / (1 / eff + 0.5))
    q = gpu_fit.mac_profile(single, fit, 4)
    assert (q.layer_overhead_s, q.bandwidth_efficiency) == (pytest.approx(20e-6), eff)


def test_an_engine_is_named_by_what_the_source_ran_and_never_priced_unfitted(rows):
    assert ps.engine_name(_row(rows, engine="mlx-lm", batch=1)) == "mlx-lm"
    # mlx_lm.benchmark -b 16 runs batch_generate: mlx-lm's BatchGenerator loop.
    assert ps.engine_name(_row(rows, engine="mlx-lm", batch=16)) == "mlx-lm-batch"
    assert ps.engine_name(_row(rows, engine="vllm-mlx", streamed=False)) == "vllm-mlx"
    assert ps.engine_name(_row(rows, engine="vllm-mlx", streamed=True)) == "vllm-mlx-server"
    held_out = MacModel(gpu_fit.load_fit()).engine("vllm-mlx-server")  # no fitted costs: none
    assert (held_out.host_step_us, held_out.host_token_us) == (0.0, 0.0)
    assert held_out.batches == load_engine("vllm-mlx-server").batches


def test_write_keeps_an_engine_file_but_its_fitted_numbers(tmp_path, monkeypatch):
    src = ENGINES_DIR / "mlx-lm-server.yaml"
    (tmp_path / src.name).write_text(src.read_text())
    monkeypatch.setattr(fit_macs, "ENGINES_DIR", tmp_path)
    fitted = dataclasses.replace(load_engine("mlx-lm-server"), host_step_us=12.5,
                                 host_token_us=300.0)
    fit_macs.save_engine(fitted, "configs/reference/published.yaml: 9 rows")
    data = yaml.safe_load((tmp_path / src.name).read_text())
    assert (data["host_step_us"], data["host_token_us"]) == (12.5, 300.0)
    assert data["source"].endswith("published.yaml: 9 rows")
    assert data["serial_model_types"] == list(load_engine("mlx-lm-server").serial_model_types)


def test_cv_reports_all_rows_and_the_explained_ones_apart(rows):
    b5 = _row(rows, batch=5, measures="aggregate")
    b1 = next(r for r in rows if r.batch == 1 and mac_cv._setup(r) == mac_cv._setup(b5))
    other = _row(rows, batch=1, engine="mlx-lm")
    pick = [b1, b5, other]
    predicted = [b1.tok_s, 2 * b5.tok_s, 1.1 * other.tok_s]
    rep = mac_cv.report(pick, predicted, keep=[True, True, False])
    assert rep["b1"]["n"] == 2 and rep["explained_only"]["b1"] == {
        "n": 1, "median_abs": 0.0, "worst_abs": 0.0}
    assert rep["explained_only"]["gain"]["n"] == 1
    rep = mac_cv.report(pick, predicted, keep=[False, True, True])  # its batch-1 row left out
    assert rep["gain"]["n"] == 1 and rep["explained_only"]["gain"]["n"] == 0


def test_write_adds_a_fitted_term_the_file_lacks(tmp_path, monkeypatch):
    src = ENGINES_DIR / "mlx-lm-server.yaml"
    (tmp_path / src.name).write_text(src.read_text())
    monkeypatch.setattr(fit_macs, "ENGINES_DIR", tmp_path)
    fitted = dataclasses.replace(load_engine("mlx-lm-server"), row_dispatch_forwards=0.75)
    fit_macs.save_engine(fitted, "configs/reference/published.yaml: 9 rows")
    data = yaml.safe_load((tmp_path / src.name).read_text())
    assert data["row_dispatch_forwards"] == 0.75
    assert data["host_token_us"] == load_engine("mlx-lm-server").host_token_us


def test_rows_the_model_cannot_explain_are_scored_not_fitted(rows, catalog):
    model = MacModel(gpu_fit.load_fit())
    out = [r for r in rows if not published_fit.explained(r, model)]
    assert all(r.unexplained or r.batch > 1 for r in out)  # marked, or one-row forwards
    serial = [r for r in out if not r.unexplained]
    assert serial and all(published_fit.explained(r, model) for r in rows
                          if r.batch == 1 and not r.unexplained)
    # Fitted without them or with them removed first: the same fit.
    few = [r for r in rows if r.src == serial[0].src]
    kept = [r for r in few if published_fit.explained(r, model)]
    assert 0 < len(kept) < len(few)
    a = published_fit.fit_published(few, catalog, model)
    b = published_fit.fit_published(kept, catalog, model)
    assert fit_macs.same_model(a, b)


def _few(rows, srcs):
    return [r for r in rows if r.src in srcs]


def test_an_engine_without_rows_is_priced_at_its_kinds_pooled_prior(rows, catalog):
    few = _few(rows, {"vllm_mlx_llm", "rapid_mlx_636", "mlx_inference_server"})
    fit = published_fit.fit_published(few, catalog, MacModel(gpu_fit.load_fit()))
    servers = [e for e in fit.engines.values() if e.kind == "server"]
    assert {e.name for e in servers} == {"rapid-mlx", "mlx-inference-server"}
    prior = fit.priors["server"]
    assert prior.engines == 2
    one_row_us = [e.host_step_us + e.host_token_us for e in servers]
    assert prior.host_step_us + prior.host_token_us == pytest.approx(sum(one_row_us) / 2)
    assert sum(one_row_us) > 0
    unseen = fit.engine("mlx-lm-server")  # a server the rows lack: the servers' mean, said so
    assert (unseen.host_step_us, unseen.host_token_us) == (prior.host_step_us,
                                                          prior.host_token_us)
    assert fit.prior_of("mlx-lm-server") == "server" and "server prior" in unseen.host_basis
    assert fit.prior_of("rapid-mlx") is None and "fitted on" in fit.engine("rapid-mlx").host_basis
    kindless = fit.engine("mlx-lm-generate")  # no kind: no prior, no host cost
    assert fit.prior_of("mlx-lm-generate") is None and kindless.host_token_us == 0.0
    # Held out, the source's engines (seen nowhere else) are priced at their kinds' priors.
    used: list = [None] * len(few)
    mac_cv.held_out(few, catalog, mac_cv.FOLDS["leave_one_source_out"],
                    mac_cv.published_fitter(()), used)
    assert {u for u, r in zip(used, few) if r.src == "mlx_inference_server"} == {
        "library", "server"}


def test_a_one_row_engine_is_shrunk_towards_its_kinds_prior(rows, catalog, monkeypatch):
    few = [r for r in _few(rows, {"vllm_mlx_llm", "rapid_mlx_636", "mlx_inference_server"})
           if r.engine != "mlx-inference-server" or r.model == "qwen2.5-7b"]  # one row of it
    start = MacModel(gpu_fit.load_fit())

    def gap() -> float:
        fit = published_fit.fit_published(few, catalog, start)
        one, prior = fit.engines["mlx-inference-server"], fit.priors["server"]
        return abs(one.host_step_us + one.host_token_us
                   - prior.host_step_us - prior.host_token_us)

    pulled = gap()
    monkeypatch.setattr(solve, "PRIOR_ROWS", 0.0)
    assert pulled < 0.8 * gap()


def test_a_catalog_mac_has_no_per_row_attention_kernel_cost(rows):
    """MLX's decode attention is one kernel over every row: the fit has no per-row attention
    unknown, so one source's per-row engine work (mlx_lm_1540 samples row by row) cannot become
    every Mac's attention cost."""
    assert "attention_row_s" not in published_fit.columns(rows)
    assert gpu_fit.load_fit().attention_row_us == 0.0


def test_a_two_die_chip_pays_its_moe_layers_fixed_cost_once_per_forward(catalog):
    from batchsim.server.perf.engines import load_engine
    from batchsim.server.perf.stepcost import StepCost

    fit = dataclasses.replace(gpu_fit.load_fit(), ultra_moe_layer_us=100.0)
    (ultra,) = [m for m in catalog.chips if m.label == "M1 Ultra 64c"]
    (single,) = [m for m in catalog.chips if m.label == "M4 Max 40c"]
    assert gpu_fit.mac_profile(ultra, fit, 4).moe_layer_overhead_s == pytest.approx(100e-6)
    assert gpu_fit.mac_profile(single, fit, 4).moe_layer_overhead_s == 0.0

    def fixed_s(model: str, mac, f, engine: str = "mlx-lm") -> tuple[float, float]:
        cost = StepCost(ps.model_spec(model), gpu_fit.mac_profile(mac, f, 4), "bfloat16", 4,
                        engine=load_engine(engine).at_version("0.7.0-beta.1"))
        return cost.step_time(1, 512).fixed_s, cost.step_time(4, 512).attention_rows_s

    off = dataclasses.replace(fit, ultra_moe_layer_us=0.0)
    moe = ps.model_spec("qwen3-30b-a3b")
    assert moe.num_layers == 48
    assert fixed_s("qwen3-30b-a3b", ultra, fit)[0] - fixed_s("qwen3-30b-a3b", ultra, off)[0] == \
        pytest.approx(48 * 100e-6)
    assert fixed_s("llama-3.1-8b", ultra, fit) == fixed_s("llama-3.1-8b", ultra, off)  # dense
    # An engine's per-row attention loop repeats the forward's dispatches, not its MoE layers.
    loop = fixed_s("qwen3-30b-a3b", ultra, fit, "mlxcel-server")[1]
    assert loop > 0 and loop == pytest.approx(fixed_s("qwen3-30b-a3b", ultra, off,
                                                      "mlxcel-server")[1])


def test_per_row_sampling_is_shrunk_where_only_an_engines_token_cost_matches_it(
        rows, catalog, monkeypatch):
    """On per-row-sampler servers' rows the sampling column equals their per-token host column:
    unshrunk, the device-wide sampling term took their per-token cost (and priced it on every
    engine sampling per row); shrunk like the engine terms, it keeps less of it."""
    few = _few(rows, {"inference_speed_tests", "nexveridian", "rapid_mlx_readme_refresh",
                      "mlx_lm_benchmarks"})
    start = MacModel(gpu_fit.load_fit())
    shrunk = published_fit.fit_published(few, catalog, start).fit.sampling_row_us
    monkeypatch.setattr(solve, "SHRUNK_DEVICE", ())
    free = published_fit.fit_published(few, catalog, start).fit.sampling_row_us
    assert shrunk < 0.8 * free


def test_the_fit_picks_a_cpu_exponent_from_m1_to_m5_rows(rows, catalog):
    """Batch-1 rows of small models on M1 Ultra, M4 Max and M5 Max (the same engine): their fixed
    costs differ by more than the Ultra's own terms explain; the fit scales them by the CPU
    generation (GpuFit.cpu_exponent > 0)."""
    few = _few(rows, {"mlxcel_m1ultra_tests", "mlxcel_m5max_tests", "mlx_lm_benchmarks"})
    start = MacModel(gpu_fit.load_fit())
    assert published_fit.fit_published(few, catalog, start).fit.cpu_exponent > 0


def test_fit_at_takes_the_weighting_benchmarks_row_weights_and_transform():
    """solve.fit_at's variants (benchmarks/fit_weighting.py fitted with its own copy of it): the
    identity transform and unit weights are the shipped fit to the bit; weight on rows pulls the
    fit towards them, away from the others."""
    import numpy as np

    a = np.random.default_rng(0).uniform(0.1, 1.0, (8, 4))
    cols = ["layer_s", "forward_s", "step:mlx-lm-server", "token:mlx-lm-server"]
    loss, theta = solve.fit_at(a, cols)
    same_loss, same = solve.fit_at(a, cols, np.eye(8), np.ones(8))
    assert same_loss == loss and (same == theta).all()
    heavy = solve.fit_at(a, cols, row_weights=np.r_[np.full(4, 5.0), np.ones(4)])[1]
    before, after = (np.abs(a @ t - 1.0) for t in (theta, heavy))
    assert after[:4].sum() < before[:4].sum() and after[4:].sum() > before[4:].sum()
