"""Serving-engine profiles and their host terms: each term prices what it names, defaults to
nothing, and the simulator charges what `step_time` says. The per-row terms and how engines batch
and sample are in test_engine_rows.py, the quantized ceilings in test_quantized_ceilings.py."""

from __future__ import annotations

import dataclasses
import re

import pytest
from batchsim.configs import ConfigError
from batchsim.scheduler.plan import PrefillChunk
from batchsim.server.models.spec import zoo_spec
from batchsim.server.perf import macs
from batchsim.server.perf.engines import (
    ENGINES_DIR,
    EngineProfile,
    engine_names,
    load_engine,
)
from batchsim.server.perf.gpu_fit import load_fit, mac_profile
from batchsim.server.perf.stepcost import StepCost

from tests.cli_calls import last_json
from tests.engine_profiles import bare_mac, host_engine
from tests.sim_profile import PROFILE


def test_every_shipped_engine_loads_and_says_where_its_numbers_come_from():
    names = engine_names()
    assert {"batchsim", "mlx-lm-generate", "mlx-lm-batch", "mlx-lm-server", "vllm-mlx",
            "lm-studio"} <= set(names)
    for name in names:
        e = load_engine(name)
        assert e.name == name and e.source
    assert load_engine().name == "batchsim"
    assert not load_engine("mlx-lm-generate").batches


def test_unknown_engine_is_one_line_listing_the_known_ones():
    with pytest.raises(ConfigError, match="unknown engine 'nope'; known: batchsim, ") as exc:
        load_engine("nope")
    assert "\n" not in str(exc.value)
    with pytest.raises(ConfigError, match="unknown engine"):
        load_engine("../devices/linux-x86_64-openblas-2core")
    with pytest.raises(ConfigError, match="unknown engine ''"):  # `--engine ""` priced batchsim
        load_engine("")  # and recorded engine "" in the summary


@pytest.mark.parametrize("line", ["host_request_us: 2e15", "host_step_us: 1e300",
                                  "row_dispatch_forwards: 1e308", "host_token_us: -1",
                                  "host_step_us: .inf"])
def test_a_profile_file_with_a_host_cost_past_any_engine_is_one_line(tmp_path, monkeypatch,
                                                                     line):
    """h8: a request's 2e15 us (63 years) ran, and `report` then read every record as damage
    (completed 5 -> 0); 1e300 and 1e308 ran with numpy's overflow warnings and t=1.7e296 s.
    r3: one table of limits, one message whichever side of the range (was two formats)."""
    from batchsim.server.perf import engines

    key = line.split(":")[0]
    base = "".join(f"{k}: 1\n" for k in ("host_step_us", "host_token_us") if k != key)
    (tmp_path / "mine.yaml").write_text(f"{base}{line}\n")  # each key once (fbf1ed4)
    monkeypatch.setattr(engines, "ENGINES_DIR", tmp_path)
    load_engine.cache_clear()
    try:
        says = f"mine.yaml: {key} must be >= 0 and at most {engines.ENGINE_LIMITS[key]:g} ("
        with pytest.raises(ConfigError, match=re.escape(says)):
            load_engine("mine")
    finally:
        load_engine.cache_clear()


def test_a_profiles_own_check_says_the_bound_it_enforces():
    """r5: EngineProfile rejects only a negative or infinite cost (its copy scaled by a host_scale
    may pass the file's bound), but its message gave only the file's bound."""

    assert EngineProfile("e", 2e7, 1.0).host_step_us == 2e7  # past a file's 1e7: scaled
    with pytest.raises(ValueError, match=r"at most 1e\+07 \(finite once scaled by a device's "
                       r"host_scale\), got inf"):
        EngineProfile("e", float("inf"), 1.0)


@pytest.mark.parametrize("profile,dtype,quant", [(PROFILE, "float32", None),
                                                 (bare_mac(), "float16", 4)])
def test_new_terms_default_to_nothing(profile, dtype, quant):
    """Unset, the new parts are zero: a calibrated profile's prices are what they were."""
    t = StepCost(zoo_spec("smollm2-135m"), profile, dtype, quant).step_time(
        decode_rows=4, width=100, prefills=(PrefillChunk(9, 0, 64, True),))
    assert t.attention_rows_s == t.token_ops_s == t.sampling_s == 0
    assert t.host_step_s == t.host_token_s == 0


def test_engine_profile_refuses_negative_costs(tmp_path):
    with pytest.raises(ValueError, match="host_token_us"):
        host_engine(host_token_us=-1)


def test_size_and_sweep_price_the_engine_named_and_say_so(tmp_path, capsys):
    """`--engine` reaches both commands' one step cost: `size` at batch 1 predicts what the
    simulated sweep measures at the same context, and a serving engine's per-token host cost
    slows both; every row names its engine."""
    import argparse

    from batchsim.scripts import size
    from batchsim.scripts.cli import main

    def sweep(engine: str) -> dict:
        assert main(["sweep", "--executor", "sim", "--device-profile", "M4 Max 40c", "--model",
                     "llama-3.2-1b", "--dtype", "float16", "--quantize", "4", "--engine", engine,
                     "--batches", "1", "--prompt-len", "192", "--output-len", "64",
                     "--no-progress", "--out", str(tmp_path), "--runs-dir", str(tmp_path)]) == 0
        stdout = capsys.readouterr().out
        # the table's title names the engine, the profile and the 4-bit weights
        assert f"(float16, 4-bit weights) on sim (M4 Max 40c, engine {engine})" in stdout
        return last_json(stdout)["rows"][0]

    def predict(engine: str) -> dict:
        parser = argparse.ArgumentParser()
        size.add_parser(parser)
        args = parser.parse_args(["--model", "llama-3.2-1b", "--quantize", "4", "--mac",
                                  "M4 Max 40c", "--memory-gb", "64", "--context", "224",
                                  "--engine", engine, "--out", str(tmp_path)])
        row = size.run(args)["rows"][0]
        assert f"engine {engine}, context 224" in capsys.readouterr().out  # the table's title
        return row

    served, plain = sweep("vllm-mlx-server"), sweep("batchsim")
    assert served["engine"] == "vllm-mlx-server" and plain["engine"] == "batchsim"
    row = predict("vllm-mlx-server")
    assert row["engine"] == "vllm-mlx-server"
    assert served["decode_tok_s"] == pytest.approx(row["decode_tok_s_b1"], rel=0.02)
    prior = load_engine("vllm-mlx-server")  # no rows of its own: its kind's pooled host costs
    host_s = 1 / served["decode_tok_s"] - 1 / plain["decode_tok_s"]  # a batch-1 step's
    assert host_s == pytest.approx((prior.host_step_us + prior.host_token_us) * 1e-6, rel=0.05)

def test_run_config_takes_an_engine_and_a_simulated_run_names_it(tmp_path, capsys):

    from batchsim.scripts.cli import main
    from batchsim.server.engine.run_config import RunConfig

    with pytest.raises(ConfigError, match="unknown engine 'nope'; known: "):
        RunConfig(engine="nope")
    rates = {}
    for engine in ("batchsim", "mlx-lm-generate"):
        assert main(["run", "--executor", "sim", "--device-profile", "M4 Max", "--model",
                     "llama-3.2-1b", "--dtype", "float16", "--engine", engine,
                     "--num-prompts", "8", "--request-rate", "inf", "--input-len", "64",
                     "--output-len", "32", "--no-progress", "--out", str(tmp_path)]) == 0
        captured = capsys.readouterr()
        summary = last_json(captured.out)
        assert summary["engine"] == engine
        assert f"on sim (M4 Max, engine {engine}), workload" in captured.err  # the header line
        rates[engine] = summary["output_throughput"]
    assert rates["mlx-lm-generate"] < rates["batchsim"] / 2  # 8 rows at once, priced one by one


@pytest.mark.parametrize("input_len", ["64", "1"])  # 1: joins the decode pool, no prefill
def test_a_simulated_run_puts_an_engines_request_cost_in_ttft(tmp_path, capsys, monkeypatch,
                                                              input_len):
    """`run --executor sim --engine NAME` with a profile of one's own server carrying a cost per
    request: each request's TTFT grows by it, and nothing else does (before 11e4777 a one-token
    prompt, whose first token its decode row samples, paid none)."""
    import json

    import yaml
    from batchsim.scripts.cli import main
    from batchsim.server.perf import engines

    mine = tmp_path / "engines"
    mine.mkdir()
    base = yaml.safe_load((ENGINES_DIR / "batchsim.yaml").read_text())
    (mine / "batchsim.yaml").write_text(yaml.safe_dump(base))
    (mine / "my-server.yaml").write_text(yaml.safe_dump({**base, "host_request_us": 200_000}))
    monkeypatch.setattr(engines, "ENGINES_DIR", mine)
    load_engine.cache_clear()
    got = {}
    try:
        for engine in ("batchsim", "my-server"):
            out = tmp_path / engine
            assert main(["run", "--executor", "sim", "--device-profile", "M4 Max", "--model",
                         "llama-3.2-1b", "--dtype", "float16", "--engine", engine, "--num-prompts",
                         "1", "--input-len", input_len, "--output-len", "16", "--no-progress",
                         "--out", str(out)]) == 0
            capsys.readouterr()
            runs = list(out.rglob("requests.jsonl"))
            got[engine] = json.loads(runs[0].read_text().splitlines()[0])
    finally:  # no profile read from tmp_path stays cached, whatever failed
        load_engine.cache_clear()
    slow, fast = got["my-server"], got["batchsim"]
    assert slow["ttft_ms"] == pytest.approx(fast["ttft_ms"] + 200.0, rel=1e-6)
    assert slow["e2el_ms"] - slow["ttft_ms"] == pytest.approx(fast["e2el_ms"] - fast["ttft_ms"])


def test_compare_names_the_engine_it_simulated(tmp_path, capsys):

    from batchsim.scripts.cli import main

    assert main(["compare", "--executor", "sim", "--device-profile", "M4 Max", "--model",
                 "llama-3.2-1b", "--dtype", "float16", "--quantize", "4", "--engine",
                 "mlx-lm-generate", "--batch", "4", "--num-prompts", "4", "--input-len", "64",
                 "--output-len", "8", "--out", str(tmp_path), "--runs-dir", str(tmp_path),
                 "--no-timeline"]) == 0
    captured = capsys.readouterr()
    # the table's heading names the 4-bit weights too (it said "(float16)" alone)
    assert ("(float16, 4-bit weights) on sim (M4 Max, engine mlx-lm-generate), workload"
            in captured.out)
    assert "on sim (M4 Max, engine mlx-lm-generate), workload" in captured.err  # the opening line
    result = last_json(captured.out)
    assert result["batch1"]["engine"] == result["batched"]["engine"] == "mlx-lm-generate"


def test_the_mac_fit_carries_the_new_terms_to_every_mac():
    """GpuFit (configs/reference/mlx-fit.yaml) is where a fit sets them: each reaches a catalog
    Mac's profile and its step; an out-of-range fraction is refused."""
    mac, _ = macs.load_catalog().variant("M4 Max 40c")
    fit = dataclasses.replace(load_fit(), attention_row_us=1.5, token_layer_us=0.25,
                              sampling_row_us=40.0, kv_bandwidth_efficiency=0.5,
                              quantized_gemm_efficiency={4: 0.25})
    profile = mac_profile(mac, fit, 4)
    assert profile.quantized_gemm_gflops == {4: pytest.approx(0.25 * mac.fp16_tflops * 1e3)}
    assert profile.kv_bytes_per_s == pytest.approx(0.5 * mac.bw_gbs * 1e9)
    spec = zoo_spec("llama-3.2-1b")
    t = StepCost(spec, profile, "float16", 4, engine=host_engine(sampler="per_row")).step_time(
        decode_rows=8, width=128)
    assert t.attention_rows_s == pytest.approx(7 * spec.num_layers * 1.5e-6)
    assert t.token_ops_s == pytest.approx(8 * spec.num_layers * 0.25e-6)
    assert t.sampling_s == pytest.approx(8 * 40e-6)
    assert "attention 1.50 us/row/layer" in fit.summary() and "q4 GEMM 0.25" in fit.summary()
    with pytest.raises(ValueError, match="kv_bandwidth_efficiency"):
        dataclasses.replace(fit, kv_bandwidth_efficiency=1.5)


def test_the_explain_line_says_what_the_engine_batches():
    """size --explain's engine line: mlxcel-server evaluates one-row graphs together (not one row
    at a time), an engine without that runs them one by one, mlx-lm's generate one request."""
    note = load_engine("mlxcel-server").batching_note()
    assert "qwen2, qwen3_moe as one-row graphs evaluated together" in note
    assert "one row at a time" not in note
    assert "attention one sequence at a time" in note
    assert host_engine(serial_model_types=("qwen2",)).batching_note() == \
        "; qwen2 one row at a time"
    assert load_engine("mlx-lm-generate").batching_note() == "; runs one request at a time"


def test_an_engine_kind_is_server_library_or_none():
    assert host_engine(kind="server").kind == "server" and host_engine().kind == ""
    with pytest.raises(ValueError, match="kind must be one of"):
        host_engine(kind="daemon")
    kinds = {n: load_engine(n).kind for n in engine_names()}
    assert kinds["mlx-lm-server"] == "server" and kinds["mlx-lm-batch"] == "library"
    assert kinds["batchsim"] == "" and kinds["mlx-lm-generate"] == ""


def test_a_real_run_refuses_another_engines_name(tmp_path, capsys):
    """A real in-process run measures batchsim's own engine: naming another one recorded that
    name in the summary; now it is a one-line error before anything loads (the simulator, or a
    --target server, may carry it)."""
    from batchsim.server.engine.run_config import ConfigError, RunConfig

    with pytest.raises(ConfigError, match="--executor sim"):
        RunConfig(model="smollm2-135m", engine="mlx-lm-server")
    RunConfig(model="smollm2-135m", engine="mlx-lm-server", executor="sim")
    RunConfig(model="smollm2-135m", engine="mlx-lm-server", target="http://127.0.0.1:9/v1")


def test_host_work_scales_with_the_macs_cpu_generation():
    """GpuFit.cpu_exponent: the fixed costs per layer and per forward, per-row sampling and the
    engine's host costs take (1 / cpu_speed) ** exponent as long on a catalog Mac, cpu_speed its
    CPU generation's Geekbench 6 single-core score over the M4's (configs/macs.yaml)."""
    catalog = macs.load_catalog()
    scores = catalog.cpu_single_core.scores
    m1, _ = catalog.variant("M1 Ultra 64c")
    m4, _ = catalog.variant("M4 Max 40c")
    assert m1.cpu_speed == pytest.approx(scores["M1"] / scores["M4"]) and m4.cpu_speed == 1.0
    fit = dataclasses.replace(load_fit(), cpu_exponent=2.0, sampling_row_us=50.0,
                              ultra_layer_us=0.0)
    flat = dataclasses.replace(fit, cpu_exponent=0.0)
    slow = (scores["M4"] / scores["M1"]) ** 2
    p1, p0 = mac_profile(m1, fit, 4), mac_profile(m1, flat, 4)
    assert p1.layer_overhead_s == pytest.approx(slow * p0.layer_overhead_s)
    assert p1.sampling_row_s == pytest.approx(slow * p0.sampling_row_s)
    assert mac_profile(m4, fit, 4).layer_overhead_s == mac_profile(m4, flat, 4).layer_overhead_s
    engine = load_engine("mlx-lm-server")
    on_m1 = StepCost(zoo_spec("qwen3-0.6b"), p1, "float16", 4, engine=engine)
    assert on_m1.engine.host_token_us == pytest.approx(slow * engine.host_token_us)
    assert on_m1.step_overhead_s == pytest.approx(slow * engine.host_step_s)
    # A draft model priced beside the target runs on the same CPU: scaled once, not twice.
    from batchsim.server.perf.spec_price import model_drafter
    draft = model_drafter(on_m1, zoo_spec("qwen3-0.6b"), "float16").cost
    assert draft.engine.host_token_us == pytest.approx(on_m1.engine.host_token_us)


def test_a_preempted_request_pays_its_request_cost_once():
    """host_request_us is paid where a request samples its first token, not again when it was
    preempted and its recompute's last chunk samples (the scheduler marks that chunk not fresh),
    in step_time and the simulator's fast path alike."""
    from batchsim.scheduler.pool_geometry import KV_STEP
    from batchsim.scheduler.scheduler import Scheduler
    from batchsim.server.executors.fake_executor import FakeExecutor

    from tests.drivers import config, drive, make_request

    s = Scheduler(config(kv_budget_bytes=512 * 3 * KV_STEP, max_num_seqs=2, row_step=1))
    old, new = make_request(1, 200, 100), make_request(2, 200, 100)
    trace = drive(s, FakeExecutor(), [(0, old), (0, new)])
    assert new.num_preemptions >= 1
    sampling = [c for p in trace.plans for c in p.prefills if c.sample]
    fresh = [c.fresh for c in sampling if c.request_id == 2]
    assert fresh[0] and len(fresh) >= 2 and not any(fresh[1:])  # first, then recomputes
    spec = zoo_spec("llama-3.2-1b")
    cost = StepCost(spec, bare_mac(), "float16", 4, engine=host_engine(host_request_us=150_000))
    plain = StepCost(spec, bare_mac(), "float16", 4)
    paid = sum(cost.step_time(len(p.decode_ids), 256, p.prefills).host_request_s
               for p in trace.plans)
    assert paid == pytest.approx(2 * 0.15)  # two requests, one recompute not charged
    assert cost.prefill_forward_s(64, 0, True, 1, 0) == pytest.approx(
        plain.prefill_forward_s(64, 0, True), rel=1e-12)
    assert cost.prefill_time(64, 0, True, 3, 1).host_request_s == pytest.approx(0.15)
    from batchsim.server.perf.step_time import StepTime
    from batchsim.server.published.sim import _add_prefills, _steps_of

    zero = StepTime(0.0, 0.0, 0.0, 0.0, 0.0, 0.0)
    fit = sum((_add_prefills(zero, cost, _steps_of(p, 1)) for p in trace.plans), zero)
    assert fit.host_request_s == pytest.approx(2 * 0.15)  # the fit's closed loops: as the run
    assert cost.prefill_forward_s(64, 0, True, 3, 1) == pytest.approx(
        plain.prefill_forward_s(64, 0, True, 3) + 0.15, rel=1e-12)


def test_a_one_token_prompt_pays_its_request_cost_once():
    """A one-token prompt joins the decode pool with no prefill chunk: its decode row samples its
    first token and pays host_request_us there, once, in the simulator and the fit alike."""
    from batchsim.scheduler.scheduler import Scheduler
    from batchsim.server.executors.fake_executor import FakeExecutor
    from batchsim.server.executors.sim_executor import SimExecutor
    from batchsim.server.perf.step_time import StepTime
    from batchsim.server.published.sim import _add_prefills, _steps_of

    from tests.drivers import config, drive, make_request

    trace = drive(Scheduler(config()), FakeExecutor(),
                  [(0, make_request(1, 64, 8)), (1, make_request(2, 1, 8))])
    assert not any(c.request_id == 2 for p in trace.plans for c in p.prefills)
    assert sum(p.num_joined_directly for p in trace.plans) == 1
    spec = zoo_spec("llama-3.2-1b")
    cost = StepCost(spec, bare_mac(), "float16", 4, engine=host_engine(host_request_us=150_000))
    plain = StepCost(spec, bare_mac(), "float16", 4)
    slow, fast = SimExecutor(cost), SimExecutor(plain)
    extra_s = sum(slow.execute(p).elapsed_s - fast.execute(p).elapsed_s for p in trace.plans)
    assert extra_s == pytest.approx(2 * 0.15)  # two requests, each once
    zero = StepTime(0.0, 0.0, 0.0, 0.0, 0.0, 0.0)
    fit = sum((_add_prefills(zero, cost, _steps_of(p, 1)) for p in trace.plans), zero)
    assert fit.host_request_s == pytest.approx(2 * 0.15)
