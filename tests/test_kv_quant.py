"""Quantized KV (`kv_bits`): the bytes mlx-lm's QuantizedKVCache really holds, the scheduler's
budget and the simulator's account on them, `size` at 4 and 8 bits, the pricing of quantized
attention, and the refusals (the MLX executor, bad bit widths, head sizes MLX cannot quantize)."""

from __future__ import annotations

import argparse

import pytest
import yaml
from batchsim.configs import ConfigError
from batchsim.scheduler.config import SchedulerSettings
from batchsim.scheduler.pool_geometry import KV_STEP, private_cache_tokens, round_up
from batchsim.scripts import run_cmd, size
from batchsim.server.engine.run_config import RunConfig, load_run_config
from batchsim.server.engine.runner import run_workload
from batchsim.server.engine.session import open_session
from batchsim.server.models.arch_cache import KV_GROUP_SIZE
from batchsim.server.models.spec import zoo_names, zoo_spec
from batchsim.server.perf import macs
from batchsim.server.perf.profile import KV_DEQUANT_OPS_PER_ELEMENT
from batchsim.server.perf.stepcost import StepCost
from batchsim.workloads.lengths import LengthSpec, parse_length
from batchsim.workloads.spec import WorkloadSpec

GIB = 1 << 30


@pytest.mark.parametrize("model", ["smollm2-135m", "qwen3-0.6b"])  # 1 and 2 groups per head
@pytest.mark.parametrize("dtype", ["float16", "float32"])
@pytest.mark.parametrize("bits", [4, 8])
def test_kv_bytes_are_what_quantized_kv_cache_holds(model, dtype, bits):
    """One layer's cache after N tokens holds round_up(N, KV_STEP) tokens of the per-token bytes:
    a 256-token chunk, 1-token steps across 256 and 512, and a fresh cache given 300 at once."""
    import mlx.core as mx
    from mlx_lm.models.cache import QuantizedKVCache

    spec = zoo_spec(model)
    per_layer = spec.kv_bytes_per_token(dtype, bits) // spec.num_layers
    assert per_layer * spec.num_layers == spec.kv_bytes_per_token(dtype, bits)

    def kv(n: int):
        x = mx.ones((1, spec.num_kv_heads, n, spec.head_dim), dtype=getattr(mx, dtype))
        return x, x

    cache = QuantizedKVCache(group_size=KV_GROUP_SIZE, bits=bits)
    assert cache.step == KV_STEP
    cache.update_and_fetch(*kv(KV_STEP))
    seen = {}
    for n in range(KV_STEP + 1, 2 * KV_STEP + 3):
        cache.update_and_fetch(*kv(1))
        seen[n] = cache.nbytes
    for n in (KV_STEP + 1, 2 * KV_STEP, 2 * KV_STEP + 1, 2 * KV_STEP + 2):
        assert seen[n] == round_up(n, KV_STEP) * per_layer, n
    fresh = QuantizedKVCache(group_size=KV_GROUP_SIZE, bits=bits)
    fresh.update_and_fetch(*kv(300))
    assert fresh.nbytes == private_cache_tokens(300) * per_layer == 2 * KV_STEP * per_layer


def test_kv_bytes_by_hand_and_unquantizable_head_sizes():
    spec = zoo_spec("llama-3.1-8b")  # 32 layers, 8 KV heads, head_dim 128
    assert spec.kv_bytes_per_token("float16") == 2 * 32 * 8 * 128 * 2 == 131072
    assert spec.kv_bytes_per_token("float16", 8) == 2 * 32 * 8 * (128 + 2 * 2 * 2) == 69632
    assert spec.kv_bytes_per_token("float16", 4) == 2 * 32 * 8 * (64 + 2 * 2 * 2) == 36864
    with pytest.raises(ConfigError, match="kv_bits: 3 is not allowed"):
        spec.kv_bytes_per_token("float16", 3)
    for name in zoo_names():
        s = zoo_spec(name)
        if _unquantizable_kind(s):  # mlx-lm quantizes full-attention caches only
            with pytest.raises(ConfigError, match="mlx-lm cannot run a"):
                s.kv_bytes_per_token("float16", 4)
        elif s.head_dim % KV_GROUP_SIZE:  # MLX quantizes groups of 32, 64 or 128 along head_dim
            with pytest.raises(ConfigError, match=f"head_dim .* multiple of {KV_GROUP_SIZE}"):
                s.kv_bytes_per_token("float16", 4)
        else:
            assert s.kv_bytes_per_token("float16", 4) < s.kv_bytes_per_token("float16", 8) \
                < s.kv_bytes_per_token("float16")


def _unquantizable_kind(spec) -> bool:
    return bool({lay.attention.kind for lay in spec.arch.layers} & {"sliding", "mla"})


def run_size(tmp_path, *argv: str) -> dict:
    parser = argparse.ArgumentParser()
    size.add_parser(parser)
    return size.run(parser.parse_args([*argv, "--out", str(tmp_path)]))


def test_size_at_4_bits_fits_the_byte_ratio_more_sequences(tmp_path, capsys):
    """KV-bound (a 192 GB Mac, 32K context): max batch = KV budget // (32768 x bytes per token),
    so 4-bit KV fits 131072 / 36864 = 3.56x the sequences of float16."""
    argv = ["--model", "llama-3.1-8b", "--quantize", "4", "--mac", "M2 Ultra 76c",
            "--memory-gb", "192", "--context", "32768"]
    rows = {kv: run_size(tmp_path, *argv, *(["--kv-bits", str(kv)] if kv else []))
            for kv in (None, 8, 4)}
    printed = capsys.readouterr().out
    assert "llama-3.1-8b 4-bit, KV 4-bit, engine batchsim, context 32768" in printed
    assert "assumed dequantization" in printed
    budget = rows[None]["rows"][0]["usable_bytes"] - rows[None]["rows"][0]["weight_bytes"]
    spec = zoo_spec("llama-3.1-8b")
    for kv, summary in rows.items():
        (row,) = summary["rows"]
        assert summary["kv_bits"] == kv and row["kv_bytes_per_token"] == spec.kv_bytes_per_token(
            "float16", kv)
        assert row["max_batch_padded"] == budget // (32768 * row["kv_bytes_per_token"])
    b16, b4 = rows[None]["rows"][0]["max_batch"], rows[4]["rows"][0]["max_batch"]
    assert b16 > 20 and b4 / b16 == pytest.approx(131072 / 36864, rel=0.05)
    assert rows[8]["rows"][0]["max_batch"] < b4
    assert next(tmp_path.glob("size-llama-3.1-8b-q4-kv4-*.png"))


def test_size_with_kv_bits_for_every_zoo_model(tmp_path):
    for name in zoo_names():
        spec = zoo_spec(name)
        argv = ["--model", name, "--mac", "M4 Max 40c", "--memory-gb", "128", "--context", "1024",
                "--kv-bits", "4"]
        if _unquantizable_kind(spec):
            with pytest.raises(ConfigError, match="mlx-lm cannot run a"):
                run_size(tmp_path, *argv)
            continue
        if spec.head_dim % KV_GROUP_SIZE:
            with pytest.raises(ConfigError, match="head_dim"):
                run_size(tmp_path, *argv)
            continue
        (row,) = run_size(tmp_path, *argv)["rows"]
        assert row["kv_bytes_per_token"] == spec.kv_bytes_per_token("float16", 4), name


def test_quantized_decode_attention_reads_fewer_bytes_and_pays_dequantization():
    catalog = macs.load_catalog()
    (mac,) = [m for m in catalog.chips if m.label == "M2 Max 38c"]
    profile = mac.profile(0.7, 0.6)
    spec = zoo_spec("llama-3.1-8b")
    plain = StepCost(spec, profile, "float16", 4)
    q4 = StepCost(spec, profile, "float16", 4, kv_bits=4)
    batch, width = 8, 4096
    elements = 2 * 32 * 8 * 128 * batch * width
    expected = (batch * width * 36864 / profile.bytes_per_s
                + elements * KV_DEQUANT_OPS_PER_ELEMENT / profile.flops_per_s("float16"))
    assert q4.decode_time(batch, width).attention_s == pytest.approx(expected, rel=1e-12)
    assert plain.decode_time(batch, width).attention_s == pytest.approx(
        batch * width * 131072 / profile.bytes_per_s, rel=1e-12)
    assert q4.decode_time(batch, width).attention_s < plain.decode_time(batch, width).attention_s
    # Everything but attention is the same step.
    p, q = plain.decode_time(batch, width), q4.decode_time(batch, width)
    assert (p.weights_s, p.matmul_s, p.elementwise_s) == (q.weights_s, q.matmul_s, q.elementwise_s)


def _sim_config(kv_bits, memory_gb):
    spec = WorkloadSpec(name="kvq", num_prompts=24, request_rate=float("inf"),
                        input_len=LengthSpec("uniform", min=200, max=900),
                        output_len=parse_length("uniform:50:200"), seed=5)
    return RunConfig(model="smollm2-135m", dtype="float16", executor="sim",
                     device_profile="M2 Max 38c", kv_bits=kv_bits, memory_gb=memory_gb,
                     scheduler=SchedulerSettings(max_num_seqs=16), workload=spec)


def test_sim_run_with_kv_bits_keeps_an_exact_account_and_admits_more():
    weights = zoo_spec("smollm2-135m").weight_bytes("float16")
    memory_gb = (weights + 3 * 1024 * zoo_spec("smollm2-135m").kv_bytes_per_token()) / GIB
    summaries = {}
    for kv in (None, 4):
        session = open_session(_sim_config(kv, memory_gb))
        kvt = zoo_spec("smollm2-135m").kv_bytes_per_token("float16", kv)
        assert session.kv_bytes_per_token == session.executor.kvt == kvt
        assert session.scheduler_config().kv_bytes_per_token == kvt
        outcome = run_workload(session, session.config.workload, out_dir=None, label="kvq")
        assert all(st.kv_bytes_measured == st.kv_bytes for st in outcome.steps)
        summaries[kv] = outcome.summary
    assert summaries[4]["kv_account_mismatches"] == 0 and summaries[4]["completed"] == 24
    assert summaries[None]["max_batch_size"] < summaries[4]["max_batch_size"]


def test_mlx_executor_refuses_kv_bits_it_cannot_quantize_in_one_line():
    # tiny's 16-wide heads are below mlx-lm's 64-element KV group (quantized KV in the real
    # executor: tests/test_family_executor.py).
    cfg = run_cmd.config_from_args(_run_parser().parse_args(["--model", "tiny", "--kv-bits", "4"]))
    assert cfg.kv_bits == 4 and cfg.executor == "mlx"
    with pytest.raises(ConfigError) as info:
        open_session(cfg)
    message = str(info.value)
    assert "\n" not in message and "multiple of 64" in message


def _run_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser()
    run_cmd.add_parser(parser)
    return parser


def test_kv_bits_config_is_strict(tmp_path):
    with pytest.raises(ConfigError, match="kv_bits: 3 is not allowed; allowed: 4, 8"):
        RunConfig(kv_bits=3)
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump({"model": "smollm2-135m", "executor": "sim", "kv_bits": 3}))
    with pytest.raises(ConfigError, match="kv_bits: 3"):
        load_run_config(path)
    path.write_text(yaml.safe_dump({"model": "smollm2-135m", "executor": "sim", "kv_bits": 8}))
    assert load_run_config(path).kv_bits == 8
    with pytest.raises(SystemExit):
        _run_parser().parse_args(["--kv-bits", "3"])
    assert _run_parser().parse_args([]).kv_bits is None  # unset: the YAML's value stands


def test_kv_bits_by_layer_kind():
    """Quantized KV follows mlx-lm: full-attention layers' K/V are quantized (MoE and hybrid
    models too, whose linear-attention states stay as they are); sliding and MLA caches cannot
    be."""
    moe, hybrid = zoo_spec("qwen3-30b-a3b"), zoo_spec("qwen3-next-80b-a3b")
    head = moe.head_dim * 4 // 8 + 2 * (moe.head_dim // KV_GROUP_SIZE) * 2  # fp16 scales, biases
    assert moe.kv_bytes_per_token("float16", 4) == 2 * moe.num_layers * moe.num_kv_heads * head
    full = hybrid.kv_bytes_per_token("float16")
    layout, q4 = hybrid.cache_layout("float16"), hybrid.cache_layout("float16", 4)
    assert q4.state_bytes == layout.state_bytes > 0  # the linear layers' state is untouched
    hd = hybrid.head_dim  # per head and token: 2 bytes x hd, or hd/2 packed + 2 fp16 per 64
    assert q4.full_token_bytes * (2 * hd) == full * (hd // 2 + 4 * (hd // KV_GROUP_SIZE))
    assert hybrid.kv_bytes_per_seq(4096, "float16", 4) < hybrid.kv_bytes_per_seq(4096, "float16")
    for name, kind in (("gpt-oss-20b", "sliding"), ("gemma-3-27b", "sliding"),
                       ("deepseek-v3", "mla")):
        with pytest.raises(ConfigError, match=f"{name}: kv_bits: mlx-lm cannot run a {kind} layer"):
            zoo_spec(name).cache_layout("float16", 4)
