"""`batchsim size`: the Mac catalog, working-set arithmetic, KV bytes and max batch against
hand-computed values, padded vs paged under a length distribution, and the output contract."""

from __future__ import annotations

import json
import warnings
from pathlib import Path

import numpy as np
import pytest
import yaml
from batchsim.configs import ConfigError
from batchsim.scheduler.pool_geometry import padded_batch_bytes, paged_bytes
from batchsim.scripts.common import dumps
from batchsim.server.models.spec import zoo_spec
from batchsim.server.perf import macs, size_limits

GIB = 1 << 30
KV_8B_FP16 = 2 * 32 * 8 * 128 * 2  # llama-3.1-8b: K and V x layers x kv_heads x head_dim x fp16

from tests.cli_calls import last_json, run_size


@pytest.fixture(scope="module")
def catalog() -> macs.Catalog:
    return macs.load_catalog()


def settings(catalog, quantize_bits=None, dtype="float16", reserve=None) -> size_limits.Settings:
    bw, _ = macs.bandwidth_efficiency(catalog, macs.weight_format(quantize_bits))
    cmp, _ = macs.compute_efficiency(catalog)
    ws = catalog.metal_working_set
    reserve = ws.os_reserve_gb if reserve is None else reserve
    return size_limits.Settings(dtype, quantize_bits, bw, cmp, reserve)


def one_mac(catalog, label: str) -> macs.Mac:
    (mac,) = [m for m in catalog.chips if m.label == label]
    return mac


def row_for(catalog, model: str, label: str, memory_gb: float, context: str = "4096",
            quantize_bits: int | None = None) -> dict:
    spec = zoo_spec(model)
    ctx = size_limits.context_fit(context, spec.max_context)
    return size_limits.mac_row(spec, one_mac(catalog, label), memory_gb, ctx,
                        settings(catalog, quantize_bits), catalog.metal_working_set)


def test_catalog_loads_with_sources(catalog):
    assert len(catalog.chips) == 34
    assert all(m.src and set(m.src) <= set(catalog.sources) for m in catalog.chips)
    m5 = [m for m in catalog.chips if m.chip.startswith("M5")]
    assert all(m.compute_known for m in catalog.chips)  # M5: estimated, never unlimited
    assert m5 and all(m.estimate and "mlxcel_m5max_batch" in m.src for m in m5)
    assert one_mac(catalog, "M3 Max 40c").estimate and not one_mac(catalog, "M2 Max 38c").estimate
    assert [u.chip for u in catalog.unconfirmed] == ["M5 Ultra"]
    assert macs.CATALOG_PATH.parent.name == "configs"  # never ../shared at run time


def test_the_24_core_m1_max_comes_with_32_or_64_gb(catalog):
    """Apple sold the 24-core M1 Max MacBook Pro with 32 GB, configurable to 64 GB (tech specs
    SP854, SP858, cited in macs.yaml): the catalog listed 32 GB only, so `size` never sized the
    64 GB one and the chip's default budget was 32 GB's."""
    from batchsim.server.perf.devices import mac_budget

    mac, _ = catalog.variant("M1 Max 24c")
    assert mac.gpu_cores == 24 and mac.mem_gb == (32, 64)
    assert mac_budget("M1 Max 24c")[1] == "M1 Max 24c 64 GB: default Metal working set"


def test_catalog_is_strict(tmp_path):
    data = yaml.safe_load(macs.CATALOG_PATH.read_text())
    data["chips"][0]["gpu_core"] = 7  # a typo
    bad = tmp_path / "macs.yaml"
    bad.write_text(yaml.safe_dump(data))
    with pytest.raises(ConfigError, match="gpu_core"):
        macs.load_catalog(bad)
    data = yaml.safe_load(macs.CATALOG_PATH.read_text())
    data["chips"][0]["src"] = ["nowhere"]
    bad.write_text(yaml.safe_dump(data))
    with pytest.raises(ConfigError, match="nowhere"):
        macs.load_catalog(bad)


def test_usable_memory_rule(catalog):
    ws = catalog.metal_working_set
    # <= 36 GB: 2/3 of RAM; larger: 3/4 (Apple's "GB" of RAM is GiB).
    assert macs.default_working_set_bytes(16, ws) == int(16 * GIB * 2 / 3) == 11_453_246_122
    assert macs.default_working_set_bytes(36, ws) == 24 * GIB
    assert macs.default_working_set_bytes(128, ws) == 96 * GIB
    # Raised: RAM - 8 GB reserve, never below the default.
    assert macs.raised_working_set_bytes(128, ws) == 120 * GIB
    assert macs.raised_working_set_bytes(16, ws) == macs.default_working_set_bytes(16, ws)
    assert macs.raised_working_set_bytes(16, ws, os_reserve_gb=4) == 12 * GIB


def test_kv_bytes_per_sequence_llama_8b_fp16(catalog):
    row = row_for(catalog, "llama-3.1-8b", "M2 Ultra 76c", 192)
    assert row["kv_bytes_per_token"] == KV_8B_FP16 == 131_072
    assert row["kv_bytes_per_seq"] == 4096 * 131_072 == 536_870_912


def test_max_batch_padded_vs_paged_fixed_context():
    # L=300: padded rows hold round_up(300, 256)=512 tokens, pages round_up(300, 16)=304.
    ctx = size_limits.context_fit("300", 131072)
    budget = GIB
    assert size_limits.max_batch(ctx.padded_tokens, budget, KV_8B_FP16) == 16  # 2^30 / (512 x 2^17)
    # floor(2^30 / (304 x 2^17))
    assert size_limits.max_batch(ctx.paged_tokens, budget, KV_8B_FP16) == 26
    kvt = KV_8B_FP16
    assert padded_batch_bytes([300] * 16, kvt) <= budget < padded_batch_bytes([300] * 17, kvt)
    assert paged_bytes([300] * 26, kvt) <= budget < paged_bytes([300] * 27, kvt)
    assert size_limits.max_batch(ctx.padded_tokens, 512 * KV_8B_FP16 - 1, KV_8B_FP16) == 0
    assert size_limits.max_batch(ctx.padded_tokens, -5, KV_8B_FP16) == 0


def test_max_batch_is_capped():
    ctx = size_limits.context_fit("16", 131072)
    assert size_limits.max_batch(ctx.paged_tokens, 1 << 50, 1) == size_limits.MAX_BATCH_CAP


def test_row_budget_is_usable_minus_weights(catalog):
    row = row_for(catalog, "llama-3.1-8b", "M4 Max 40c", 64, "300", quantize_bits=4)
    weights = zoo_spec("llama-3.1-8b").weight_bytes("float16", 4)
    assert row["weight_bytes"] == weights
    assert row["max_batch"] == row["max_batch_padded"] == (48 * GIB - weights) // (512 * KV_8B_FP16)
    assert row["max_batch_paged"] == (48 * GIB - weights) // (304 * KV_8B_FP16)
    assert row["max_batch_padded_raised"] == (56 * GIB - weights) // (512 * KV_8B_FP16)
    assert row["fits"] and row["max_batch_padded"] < row["max_batch_paged"]


def test_model_that_does_not_fit(catalog):
    row = row_for(catalog, "llama-3.1-70b", "M4 Max 40c", 128)
    assert row["weight_bytes"] > row["usable_bytes_raised"]
    assert row["max_batch"] == row["max_batch_paged"] == row["max_batch_paged_raised"] == 0
    assert row["fits"] is False and row["fits_raised"] is False
    assert row["decode_tok_s_b1"] is None and row["decode_tok_s_max_batch"] is None


def test_distribution_fit_is_seeded_and_padded_le_paged():
    a = size_limits.context_fit("lognormal:2000:1500:8192", 131072, seed=7)
    b = size_limits.context_fit("lognormal:2000:1500:8192", 131072, seed=7)
    c = size_limits.context_fit("lognormal:2000:1500:8192", 131072, seed=8)
    assert np.array_equal(a.padded_tokens, b.padded_tokens)
    assert np.array_equal(a.paged_tokens, b.paged_tokens)
    assert not np.array_equal(a.paged_tokens, c.paged_tokens)
    for curve in (a.padded_tokens, a.paged_tokens):
        assert np.all(np.diff(curve) >= 0)  # what makes one searchsorted the max batch
    assert np.all(a.padded_tokens >= a.paged_tokens)
    for budget in (GIB, 8 * GIB, 40 * GIB):
        padded = size_limits.max_batch(a.padded_tokens, budget, KV_8B_FP16)
        paged = size_limits.max_batch(a.paged_tokens, budget, KV_8B_FP16)
        assert 0 < padded < paged
    assert 1800 < a.mean_tokens < 2200


def test_degenerate_distribution_matches_fixed():
    fixed = size_limits.context_fit("300", 131072)
    dist = size_limits.context_fit("uniform:300:300", 131072)
    assert dist.trials == size_limits.FIT_TRIALS and not dist.fixed
    assert np.array_equal(fixed.padded_tokens, dist.padded_tokens)
    assert np.array_equal(fixed.paged_tokens, dist.paged_tokens)


def test_fit_quantile_is_a_drawn_batch():
    # Lengths in [100, 300]: one sequence pads to 256 or 512 tokens; 22% exceed 256, so p95 is 512.
    ctx = size_limits.context_fit("uniform:100:300", 131072, quantile=0.95)
    assert ctx.padded_tokens[1] == 512
    assert size_limits.context_fit("uniform:100:300", 131072, quantile=0.5).padded_tokens[1] == 256


def test_efficiency_derived_from_4167(catalog):
    fr = dict(macs.bandwidth_fractions(catalog.decode_reference, "F16"))
    # M2 Ultra 76c: 41.02 tok/s x 12.55 GiB / 800 GB/s.
    assert fr["M2 Ultra 76c"] == pytest.approx(41.02 * 12.55 * GIB / 800e9)
    assert "M1 8c" not in fr  # no F16 measurement for the 8 GB M1
    assert macs.bandwidth_efficiency(catalog, "Q4_0")[0] == pytest.approx(0.717, abs=1e-3)
    assert macs.bandwidth_efficiency(catalog, "F16")[0] == pytest.approx(0.834, abs=1e-3)
    assert macs.compute_efficiency(catalog)[0] == pytest.approx(0.748, abs=1e-3)


def test_decode_tok_s_batch_1_by_hand(catalog):
    # Batch 1 on a roofline is bandwidth-bound: every linear layer streams its 4-bit weights (0.5 B
    # + fp16 scale and bias per 64) and its activations, attention reads 4096 tokens of K/V, and
    # the elementwise ops move their bytes, all at the achievable bandwidth.
    spec = zoo_spec("llama-3.1-8b")
    row = row_for(catalog, "llama-3.1-8b", "M2 Ultra 76c", 192, quantize_bits=4)
    eff = macs.bandwidth_efficiency(catalog, "Q4_0")[0]
    linear = [(k * n * (0.5 + 4 / 64) + (k + n) * 2) for n, k in spec.layer_linear_shapes]
    head = (spec.hidden_size * spec.vocab_size * (0.5 + 4 / 64)
            + (spec.hidden_size + spec.vocab_size) * 2)
    per_layer = 6 * spec.hidden_size + 3 * spec.intermediate_size + 2 * 48 * 128  # 32 + 2 x 8 heads
    elementwise = spec.num_layers * per_layer * 2 + spec.vocab_size * 4
    moved = sum(linear) * spec.num_layers + head + 4096 * KV_8B_FP16 + elementwise
    assert row["decode_tok_s_b1"] == pytest.approx(800e9 * eff / moved, rel=1e-12)
    assert row["decode_tok_s_max_batch"] > row["decode_tok_s_b1"]
    assert row["bound_at_max_batch"] == "compute"  # hundreds of rows share each weight


def test_a_mac_without_flops_is_refused_not_unlimited(catalog):
    import dataclasses

    spec = zoo_spec("llama-3.1-8b")
    mac = dataclasses.replace(one_mac(catalog, "M5 Max 40c"), fp16_tflops=None, fp32_tflops=None)
    row = size_limits.mac_row(spec, mac, 128, size_limits.context_fit("128", spec.max_context),
                              settings(catalog, 4), catalog.metal_working_set)
    assert row["decode_tok_s_b1"] is None and row["decode_tok_s_max_batch"] is None
    assert row["refused"] == ("M5 Max 40c: no FLOP/s figure in configs/macs.yaml, tok/s not "
                              "predicted")
    assert row["max_batch"] > 0  # the memory side still answers
    with pytest.raises(ConfigError, match="no FLOP/s figure"):
        mac.profile(0.8, 0.9)


def test_m5_max_is_sane_next_to_an_m4_max(catalog):
    """The issue-34 case: llama-3.1-8b 4-bit at context 128 on a 128 GB M5 Max predicted 17,588
    tok/s at its max batch (no compute bound) against about 970 on an M4 Max. With the estimated
    FP16 peak it stays within the ratio of the two chips' matmul peaks."""
    m5, m4 = (row_for(catalog, "llama-3.1-8b", label, 128, "128", quantize_bits=4)
              for label in ("M5 Max 40c", "M4 Max 40c"))
    assert m5["bound_at_max_batch"] == m4["bound_at_max_batch"] == "compute"
    peaks = one_mac(catalog, "M5 Max 40c").fp16_tflops / one_mac(catalog, "M4 Max 40c").fp16_tflops
    assert 1 < m5["decode_tok_s_max_batch"] / m4["decode_tok_s_max_batch"] <= peaks
    assert 1 < m5["decode_tok_s_b1"] / m4["decode_tok_s_b1"] < 614 / 546 + 0.05  # bandwidth


def test_mac_filter(catalog):
    assert [m.label for m in catalog.select("M2")] == ["M2 8c", "M2 10c"]  # exact chip first
    assert [m.label for m in catalog.select("m2 ultra")] == ["M2 Ultra 60c", "M2 Ultra 76c"]
    assert [m.label for m in catalog.select("Ultra 76")] == ["M2 Ultra 76c"]
    assert len(catalog.select(None)) == len(catalog.chips)
    with pytest.raises(ConfigError, match="M4 Pro"):
        catalog.select("M9 Hyper")


def test_command_contract_and_files(tmp_path, capsys):
    summary = run_size(tmp_path, "--model", "llama-3.1-8b", "--quantize", "4", "--mac", "M4 Max")
    rows = summary["rows"]
    configs = [(r["gpu_cores"], r["memory_gb"]) for r in rows]
    assert configs == [(32, 36), (40, 48), (40, 64), (40, 128)]
    keys = {"chip", "gpu_cores", "memory_gb", "usable_bytes", "max_batch", "decode_tok_s_b1",
            "decode_tok_s_max_batch"}
    assert all(keys <= set(r) for r in rows)
    assert summary["fit_quantile"] == 0.95
    assert "configs/reference/" in summary["bandwidth_efficiency_source"]
    assert json.loads(dumps(summary))["rows"][0]["chip"] == "M4 Max"
    lines = (tmp_path / "size.jsonl").read_text().splitlines()
    assert len(lines) == 4 and json.loads(lines[0])["model"] == "llama-3.1-8b"
    png = list(tmp_path.glob("size-llama-3.1-8b-q4-*.png"))
    assert len(png) == 1 and png[0].read_bytes()[:4] == b"\x89PNG"
    assert "M4 Max" in capsys.readouterr().out


def test_command_memory_override_and_no_fit(tmp_path, capsys):
    summary = run_size(tmp_path, "--model", "llama-3.1-70b", "--mac", "M4 Max 40c",
                       "--memory-gb", "96", "--bandwidth-efficiency", "0.5")
    (row,) = summary["rows"]
    assert row["memory_gb"] == 96 and row["usable_bytes"] == 72 * GIB
    assert row["max_batch"] == 0 and not row["fits"] and not summary["fits_any"]
    assert summary["bandwidth_efficiency"] == 0.5
    assert "fits no Mac" in capsys.readouterr().out


def test_a_model_that_fits_no_mac_is_plotted_without_a_warning(tmp_path):
    """Max batch's log axis had no positive bar to scale to: matplotlib's 'Data has no positive
    values, and therefore cannot be log-scaled' UserWarning reached the user's stderr."""
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        summary = run_size(tmp_path, "--model", "llama-3.1-70b", "--mac", "M4 Max 40c",
                           "--memory-gb", "96")
    assert not summary["fits_any"] and Path(summary["png"]).read_bytes()[:4] == b"\x89PNG"


def test_context_longer_than_model_is_an_error():
    with pytest.raises(ConfigError, match="exceeds"):
        size_limits.context_fit("200000", 131072)


@pytest.mark.parametrize("model,quantize,mac,prompt,output", [
    ("llama-3.1-8b", "4", "M5 Max 40c", 512, 256),  # FLOP/s peak estimated (macs.yaml)
    ("qwen3-8b", "4", "M2 Max 38c", 3968, 256),
    ("llama-3.2-1b", None, "M4 Pro 20c", 192, 64),
])
def test_size_predicts_the_simulated_sweep_at_batch_1(tmp_path, capsys, model, quantize, mac,
                                                      prompt, output):
    """One performance model: `size` at batch 1 is what `sweep --executor sim` measures on the
    same Mac, model, weights and context (the sweep's mean decode width), within 2%."""
    from batchsim.scripts.cli import main
    from batchsim.server.perf.sweep_limits import mean_decode_width

    # Both in float16 (sweep's "auto" is the host backend's dtype: float32 on this CPU).
    quant = ["--dtype", "float16"] + (["--quantize", quantize] if quantize else [])
    assert main(["sweep", "--executor", "sim", "--device-profile", mac, "--model", model, *quant,
                 "--batches", "1", "--prompt-len", str(prompt), "--output-len", str(output),
                 "--no-progress", "--out", str(tmp_path), "--runs-dir", str(tmp_path)]) == 0
    swept = last_json(capsys.readouterr().out)["rows"][0]
    context = mean_decode_width(prompt, output)
    assert context == int(context)
    summary = run_size(tmp_path, "--model", model, *quant, "--mac", mac,
                       "--context", str(int(context)))
    predicted = summary["rows"][0]["decode_tok_s_b1"]
    assert swept["decode_tok_s"] == pytest.approx(predicted, rel=0.02)


def test_explain_shows_the_parts_of_the_predicted_step(tmp_path, capsys):
    summary = run_size(tmp_path, "--model", "llama-3.1-8b", "--quantize", "4", "--mac",
                       "M2 Max 38c", "--context", "640", "--explain")
    printed = capsys.readouterr().out
    assert "Predicted decode step by part" in printed and "attention ms" in printed
    for r in summary["rows"]:
        for batch, key, rate in ((1, "parts_b1", "decode_tok_s_b1"),
                                 (r["max_batch"], "parts", "decode_tok_s_max_batch")):
            parts = r[key]
            assert all(isinstance(v, float) for v in parts.values())  # flat: seconds by name
            named_s = sum(v for k, v in parts.items() if k != "total_s")
            assert named_s == pytest.approx(parts["total_s"])
            assert batch / parts["total_s"] == pytest.approx(r[rate])
        # Batch 1 streams the weights; hundreds of rows make the linear layers FLOP-bound.
        assert r["parts_b1"]["matmul_s"] == 0 and r["parts"]["matmul_s"] > 0
        assert r["engine"] == "batchsim"
    plain = run_size(tmp_path, "--model", "llama-3.1-8b", "--quantize", "4", "--mac", "M2 Max 38c")
    assert not {"parts", "parts_b1"} & set(plain["rows"][0])  # keys unchanged without --explain


def test_explain_says_what_a_top_p_part_is_where_one_shows(capsys):
    from batchsim.scripts.size_view import PARTS, print_parts

    meta = {"spec_tokens": 0, "engine": "e", "context": "512", "context_mean_tokens": 512.0}
    for top_p_s in (2e-4, 0.0):
        parts = {**dict.fromkeys(PARTS, 0.0), "weights_s": 1e-3, "top_p_s": top_p_s,
                 "total_s": 1e-3 + top_p_s}
        print_parts([{"label": "M5 Max 40c", "memory_gb": 48, "max_batch": 8, "parts_b1": parts,
                      "parts": parts}], meta)
        printed = " ".join(capsys.readouterr().out.split())
        assert ("top p ms" in printed) == ("top p: its top-p sampler's" in printed) == (
            top_p_s > 0)


NON_DENSE = ("qwen3-30b-a3b", "gpt-oss-20b", "gpt-oss-120b", "gemma-3-27b", "qwen3-next-80b-a3b",
             "deepseek-v3", "tiny-moe", "tiny-sliding", "tiny-hybrid", "tiny-mla")


@pytest.mark.parametrize("name", NON_DENSE)
def test_size_row_for_every_family_uses_exact_per_sequence_bytes(catalog, name):
    spec = zoo_spec(name)
    row = row_for(catalog, name, "M3 Ultra 80c", 512, "3000", quantize_bits=4)
    per_seq = spec.kv_bytes_per_seq(3000)
    comp = row["kv_per_seq"]
    assert row["kv_bytes_per_seq"] == sum(comp.values()) == per_seq
    assert row["max_batch_padded"] == min((row["usable_bytes"] - row["weight_bytes"]) // per_seq,
                                          size_limits.MAX_BATCH_CAP)
    assert row["max_batch_paged"] >= row["max_batch_padded"] >= 1
    kinds = {lay.attention.kind for lay in spec.arch.layers}
    assert (comp["window_kv_bytes"] > 0) == ("sliding" in kinds)
    assert (comp["state_bytes"] > 0) == ("linear" in kinds)
    assert row["decode_tok_s_max_batch"] > row["decode_tok_s_b1"] > 0


def test_window_capped_bytes_stop_growing(catalog):
    spec = zoo_spec("gemma-3-27b")
    short, long = (size_limits.kv_composition(spec, n, "float16") for n in (8192, 32768))
    assert short.window_kv_bytes == long.window_kv_bytes > 0
    assert long.full_kv_bytes == 4 * short.full_kv_bytes


def test_size_command_on_moe_names_the_kv_composition(tmp_path, capsys):
    summary = run_size(tmp_path, "--model", "qwen3-next-80b-a3b", "--quantize", "4",
                       "--mac", "M4 Max 40c", "--memory-gb", "128", "--context-dist",
                       "uniform:1000:8000")
    (row,) = summary["rows"]
    assert row["kv_per_seq"]["state_bytes"] > 0
    assert row["max_batch_padded"] <= row["max_batch_paged"]
    text = " ".join(capsys.readouterr().out.split())
    assert "full/win/state" in text and "linear-attention state is fixed" in text
    q4 = run_size(tmp_path, "--model", "qwen3-next-80b-a3b", "--quantize", "4", "--kv-bits", "4",
                  "--mac", "M4 Max 40c", "--memory-gb", "128", "--context-dist",
                  "uniform:1000:8000")
    (row4,) = q4["rows"]  # full-attention K/V quantized, the linear layers' state untouched
    assert row4["kv_per_seq"]["state_bytes"] == row["kv_per_seq"]["state_bytes"]
    assert row4["kv_per_seq"]["full_kv_bytes"] < row["kv_per_seq"]["full_kv_bytes"] / 3
    assert row4["max_batch_padded"] > row["max_batch_padded"]
    with pytest.raises(ConfigError, match="cannot run a sliding layer"):
        run_size(tmp_path, "--model", "gpt-oss-20b", "--kv-bits", "4", "--mac", "M4 Max 40c")
