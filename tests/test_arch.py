"""The per-layer description (server/models/arch*.py) against mlx-lm itself: the tiny family models'
parameter counts and prompt-cache bytes (prefill, decode, 256-token steps, sliding windows, fixed
linear-attention state), and the big zoo models' totals against their published counts."""

from __future__ import annotations

import pytest
from batchsim.configs import ConfigError
from batchsim.server.models.arch_cache import Attention, _kv_rows, _rotating_rows, generate_calls
from batchsim.server.models.spec import ModelSpec, zoo_spec

TINY = ["tiny-moe", "tiny-sliding", "tiny-hybrid", "tiny-mla"]
# Call patterns (tokens per model call), checked after every phase:
# A: one prefill, decode across the 256-token step (sliding: the ring shrinks to its window);
# B: short prefill, decode growing then rotating the window, two prefill chunks (the second
#    cutting the KV buffer back to its filled rows), then decode.
SCENARIOS = {"A": [[250], [1] * 10], "B": [[50], [1] * 20, [100], [120], [1] * 2]}


@pytest.fixture(scope="module")
def tiny_models(tmp_path_factory):
    from batchsim.server.models.build import build_model
    from batchsim.server.models.loader import ModelRef, load

    root = tmp_path_factory.mktemp("arch-models")
    out = {}
    for name in TINY:
        spec = zoo_spec(name)
        path = build_model(spec, "float32", out_dir=root / name)
        out[name] = (spec, load(ModelRef(name, path, spec, "float32", None))[0])
    return out


@pytest.mark.parametrize("name", TINY)
def test_params_match_the_mlx_lm_model(tiny_models, name):
    from mlx.utils import tree_flatten

    spec, model = tiny_models[name]
    assert spec.num_params == sum(v.size for _, v in tree_flatten(model.parameters()))
    assert spec.weight_bytes("float32") == 4 * spec.num_params


@pytest.mark.parametrize("scenario", sorted(SCENARIOS))
@pytest.mark.parametrize("name", TINY)
def test_cache_bytes_match_mlx_lm_prompt_cache(tiny_models, name, scenario):
    import mlx.core as mx
    from mlx_lm.models.cache import make_prompt_cache

    spec, model = tiny_models[name]
    cache = make_prompt_cache(model)
    calls: list[int] = []
    for phase in SCENARIOS[scenario]:
        for n in phase:
            model(mx.array([[(7 * len(calls) + i) % 500 + 3 for i in range(n)]]), cache=cache)
            calls.append(n)
        mx.eval([c.state for c in cache])
        measured = sum(c.nbytes for c in cache)
        assert spec.arch.cache_bytes(calls, 4) == measured, (name, calls)


def test_cache_kinds_per_family():
    kinds = {n: [lay.attention.kind for lay in zoo_spec(n).arch.layers] for n in TINY}
    assert kinds == {"tiny-moe": ["full"] * 2, "tiny-sliding": ["sliding", "full"] * 2,
                     "tiny-hybrid": ["linear"] * 3 + ["full"], "tiny-mla": ["mla"] * 3}
    ffn = [lay.ffn.kind for lay in zoo_spec("tiny-mla").arch.layers]
    assert ffn == ["dense", "moe", "moe"]  # first_k_dense_replace: 1


def test_cache_replay_by_hand():
    assert _kv_rows([250, 1, 1, 1, 1, 1, 1, 1]) == 512  # 257 tokens: a second step
    assert _kv_rows([200, 100]) == 456  # cut back to 200 filled rows, then one more step
    assert _rotating_rows([300], 64, 0) == 300  # a prefill chunk is kept whole ...
    assert _rotating_rows([300, 1], 64, 0) == 64  # ... until the next single token
    assert _rotating_rows([300, 1, 50], 64, 0) == 63 + 50  # window - 1, then the chunk
    assert _rotating_rows([10, 1], 64, 0) == 10 + 54  # grows by min(256, window - offset)
    assert generate_calls(4096) == [2048, 2047, 1] and generate_calls(1) == [1]


# Published totals (model cards) and the tolerance each is checked to. Active params exclude the
# embedding table here (the cards' convention; our `active_params` counts it, Qwen's convention).
PUBLISHED = {
    # name: (total params, active params without embedding, relative tolerance)
    "qwen3-30b-a3b": (30.5e9, 3.3e9 - 151936 * 2048, 0.02),  # card: 30.5B total, 3.3B activated
    "gpt-oss-20b": (20.91e9, 3.61e9, 0.01),  # model card table: 20.91B / 3.61B
    "gpt-oss-120b": (116.83e9, 5.13e9, 0.01),  # model card table: 116.83B / 5.13B
    "deepseek-v3": (671e9, 37e9, 0.02),  # 671B / 37B (without the 14B MTP module)
    "qwen3-next-80b-a3b": (80e9, 3.3e9, 0.1),  # card: 80B total, "3B" activated (rounded)
    "gemma-3-27b": (27.0e9, 25.6e9, 0.02),  # 27.4B with the 0.4B vision tower; dense
}


@pytest.mark.parametrize("name", sorted(PUBLISHED))
def test_params_against_published(name):
    spec = zoo_spec(name)
    total, active, tol = PUBLISHED[name]
    assert spec.num_params == pytest.approx(total, rel=tol)
    assert spec.active_params - spec.arch.embedding_params == pytest.approx(active, rel=tol)


def test_big_zoo_kv_per_sequence():
    gpt = zoo_spec("gpt-oss-120b")
    full, window = 18 * 8 * 64 * 2 * 2, 18 * 128 * 8 * 64 * 2 * 2
    assert gpt.kv_bytes_per_seq(4096) == 4096 * full + window
    ds = zoo_spec("deepseek-v3")
    assert ds.kv_bytes_per_seq(32768) == 32768 * 61 * (512 + 64) * 2
    nxt = zoo_spec("qwen3-next-80b-a3b")  # 12 full layers + 36 fixed states
    state = 36 * (3 * (2 * 16 * 128 + 32 * 128) * 2 + 32 * 128 * 128 * 4)
    assert nxt.kv_bytes_per_seq(4096) == 4096 * 12 * 2 * 256 * 2 * 2 + state


def test_unknown_model_type_is_one_line():
    with pytest.raises(ConfigError) as err:
        ModelSpec("x", {"model_type": "mamba2", "hidden_size": 8, "num_hidden_layers": 1,
                        "num_attention_heads": 1, "vocab_size": 8, "intermediate_size": 8})
    msg = str(err.value)
    assert "\n" not in msg and "'mamba2'" in msg and "gpt_oss" in msg and "hybrid" in msg


def test_malformed_family_config_is_one_line():
    with pytest.raises(ConfigError, match="config for qwen3_moe is incomplete"):
        ModelSpec("x", {"model_type": "qwen3_moe", "hidden_size": 8, "num_hidden_layers": 1,
                        "num_attention_heads": 1, "vocab_size": 8, "intermediate_size": 8})


def test_attention_token_bytes():
    assert Attention("full", heads=8, k_dim=128, v_dim=128).token_bytes(2) == 4096


def test_models_json_contract():
    import argparse

    from batchsim.scripts.models_cmd import run

    rows = {r["name"]: r for r in run(argparse.Namespace(action="list", json=True))["models"]}
    assert rows["qwen3-30b-a3b"]["family"] == ["moe"] and rows["tiny"]["family"] == ["dense"]
    assert rows["deepseek-v3"]["family"] == ["moe", "mla"]
    assert rows["qwen3-next-80b-a3b"]["family"] == ["moe", "hybrid"]
    expected = zoo_spec("gemma-3-27b").kv_bytes_per_seq(32768)
    assert rows["gemma-3-27b"]["kv_bytes_per_seq"]["32768"] == expected
    assert rows["llama-3.1-8b"]["kv_bytes_per_seq"] == {"4096": 4096 * 131072,
                                                        "32768": 32768 * 131072}


@pytest.mark.parametrize("name", ["deepseek-v3", "gpt-oss-20b", "qwen3-next-80b-a3b"])
def test_real_runs_of_models_too_big_refuse_in_one_line_before_building(name,
                                                                        tmp_path, monkeypatch):
    # Every family runs on the real executor (tests/test_family_executor.py); weights that cannot
    # fit are refused before a build or a download starts.
    from batchsim.server.engine.run_config import RunConfig
    from batchsim.server.engine.session import open_session

    monkeypatch.setenv("BATCHSIM_HOME", str(tmp_path))
    with pytest.raises(ConfigError) as err:
        open_session(RunConfig(model=name, executor="mlx", dtype="float32", memory_gb=16))
    assert "\n" not in str(err.value) and "do not fit the memory budget" in str(err.value)
    assert not list(tmp_path.rglob("*.safetensors"))


def test_full_attention_covers_dense_and_moe_only():
    full = {n: zoo_spec(n).is_full_attention for n in ("tiny", "tiny-moe", "qwen3-30b-a3b",
                                                       "tiny-sliding", "tiny-hybrid", "tiny-mla")}
    assert full == {"tiny": True, "tiny-moe": True, "qwen3-30b-a3b": True,
                    "tiny-sliding": False, "tiny-hybrid": False, "tiny-mla": False}


def test_real_moe_runs_refuse_float16_on_the_cpu_backend_in_one_line(monkeypatch):
    from batchsim.server.engine.run_config import RunConfig
    from batchsim.server.engine.session import open_session
    from batchsim.server.platform import env

    monkeypatch.setattr(env, "backend", lambda: "cpu")
    with pytest.raises(ConfigError) as err:
        open_session(RunConfig(model="tiny-moe", executor="mlx", dtype="float16"))
    assert "\n" not in str(err.value) and "GatherMM is float32-only" in str(err.value)
