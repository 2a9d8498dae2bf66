"""A draft model's weights are held beside the target's: the memory budget counts them (a run
whose two models do not fit is refused in one line), real and simulated; and a draft model
whose tokenizer gives tokens other ids than the target's is refused, whatever its size."""

from __future__ import annotations

from pathlib import Path

import pytest
from batchsim.configs import ConfigError
from batchsim.scheduler.config import SchedulerSettings
from batchsim.server.engine.run_config import RunConfig
from batchsim.server.engine.session import GIB, open_session
from batchsim.server.models.loader import zoo_spec


def _draft_config(model: str, draft: str, **kw) -> RunConfig:
    return RunConfig(model=model, spec_method="draft", draft_model=draft,
                     scheduler=SchedulerSettings(spec_tokens=2), **kw)


def test_a_simulated_draft_model_larger_than_the_mac_is_refused_in_one_line():
    cfg = _draft_config("llama-3.2-1b", "llama-3.1-405b", executor="sim", device_profile="M2",
                        spec_acceptance=(0.7,))
    with pytest.raises(ConfigError) as info:
        open_session(cfg)
    message = str(info.value)
    assert "\n" not in message and "with draft model llama-3.1-405b" in message


def test_a_simulated_draft_models_weights_leave_less_for_the_kv_cache():
    kw = {"executor": "sim", "device_profile": "M2 Max", "spec_acceptance": (0.7,)}
    plain = open_session(RunConfig(model="llama-3.1-8b", executor="sim", device_profile="M2 Max"))
    drafted = open_session(_draft_config("llama-3.1-8b", "llama-3.2-1b", **kw))
    draft = zoo_spec("llama-3.2-1b").weight_bytes(plain.dtype)
    assert drafted.weight_bytes == plain.weight_bytes + draft
    assert drafted.kv_budget_bytes == plain.kv_budget_bytes - draft


def test_a_real_draft_models_loaded_weights_count_against_the_budget(batchsim_home):
    both = zoo_spec("tiny").weight_bytes("float32") + zoo_spec("tiny-moe").weight_bytes("float32")
    session = open_session(_draft_config("tiny", "tiny-moe", dtype="float32", memory_gb=1))
    params = [session.model, session.executor.drafter.model]
    assert session.weight_bytes == sum(p.nbytes for m in params for p in _leaves(m)) == both
    too_small = (both - 1024) / GIB  # the target alone fits; with its draft model it does not
    with pytest.raises(ConfigError, match="with draft model tiny-moe"):
        open_session(_draft_config("tiny", "tiny-moe", dtype="float32", memory_gb=too_small))


def test_a_draft_model_with_another_tokenizer_of_the_same_size_is_refused(tiny, tmp_path):
    import json
    import shutil

    target, draft = (Path(shutil.copytree(tiny[0].path, tmp_path / n)) for n in ("t", "d"))
    data = json.loads((draft / "tokenizer.json").read_text())
    vocab = data["model"]["vocab"]
    a, b = list(vocab)[100:102]
    vocab[a], vocab[b] = vocab[b], vocab[a]  # two tokens swap ids: the same 512 tokens
    (draft / "tokenizer.json").write_text(json.dumps(data))
    kw = {"dtype": "float32", "memory_gb": 1}
    assert open_session(_draft_config(str(target), str(target), **kw)).executor.drafter
    with pytest.raises(ConfigError) as info:
        open_session(_draft_config(str(target), str(draft), **kw))
    message = str(info.value)
    assert "\n" not in message and "gives 2 of" in message and "share the tokenizer" in message


def _leaves(model):
    from mlx.utils import tree_flatten

    return [v for _, v in tree_flatten(model.parameters())]


def test_with_quantize_the_real_draft_model_is_loaded_as_the_account_prices_it(batchsim_home):
    # --quantize 4: the draft model is quantized like the target (mlx-lm, group 64), so its
    # loaded bytes are what the simulator, the session's pre-load check and `size` count.
    from batchsim.server.perf.spec_price import draft_weight_bytes

    session = open_session(_draft_config("tiny", "tiny", dtype="float16", quantize=4,
                                         memory_gb=1))
    target, draft = (sum(p.nbytes for p in _leaves(m))
                     for m in (session.model, session.executor.drafter.model))
    assert draft == target == draft_weight_bytes(zoo_spec("tiny"), "float16", 4)
    assert session.weight_bytes == 2 * target
