"""The draft model's account has one source (spec_price.draft_account): its weights are priced in
the form really loaded (a stored draft in another format is refused before the target loads),
a renewed session recomputes the target's and the draft's weights and layout, sweep's analytic
limit reads the same numbers, and a speculative sweep point that overran never sets the
break-even batch."""

from __future__ import annotations

import argparse
import json

import pytest
from batchsim.configs import ConfigError
from batchsim.scheduler.config import SchedulerSettings
from batchsim.scripts import sweep, sweep_spec
from batchsim.server.engine import session as session_mod
from batchsim.server.engine.run_config import RunConfig
from batchsim.server.engine.session import open_session
from batchsim.server.models import loader
from batchsim.server.models.spec import zoo_spec
from batchsim.server.perf import sweep_limits

SIM = {"executor": "sim", "device_profile": "M2 Max"}


def _draft(model: str, draft: str | None, **kw) -> RunConfig:
    if draft is None:
        return RunConfig(model=model, **kw)
    if kw.get("executor") == "sim":
        kw["spec_acceptance"] = (0.7,)
    return RunConfig(model=model, spec_method="draft", draft_model=draft,
                     scheduler=SchedulerSettings(spec_tokens=2), **kw)


def _no_load(ref):
    raise AssertionError(f"{ref.name} loaded before the draft model was checked")


@pytest.mark.parametrize("executor", ["sim", "mlx"])
def test_a_stored_draft_in_another_format_is_refused_before_loading(tiny, executor, monkeypatch):
    # tiny --quantize 4 with a float32 tiny directory as draft: mlx-lm loads it as stored
    # (427,264 B), not the 4-bit 60,544 B every account priced; refused in one line.
    monkeypatch.setattr(loader, "load", _no_load)
    kw = SIM if executor == "sim" else {"executor": "mlx"}
    cfg = _draft("tiny", str(tiny[0].path), dtype="float32", quantize=4, memory_gb=1, **kw)
    with pytest.raises(ConfigError) as info:
        open_session(cfg)
    message = str(info.value)
    assert "\n" not in message and "stored as float32 weights" in message
    assert "4-bit (float32 scales)" in message


def test_a_stored_draft_in_the_targets_format_is_priced_as_a_zoo_draft(tiny_q4):
    kw = {"dtype": "float16", "quantize": 4, "memory_gb": 1, **SIM}
    stored = open_session(_draft("tiny", str(tiny_q4[0].path), **kw))
    zoo = open_session(_draft("tiny", "tiny", **kw))
    assert stored.weight_bytes == zoo.weight_bytes
    assert stored.cache_layout == zoo.cache_layout


def test_the_draft_models_kv_bits_are_checked_before_the_target_loads(tiny, tmp_path,
                                                                       monkeypatch):
    # llama-3.2-1b takes --kv-bits 4 (head_dim 64); a draft of its vocabulary with head_dim 16
    # cannot: refused in one line before the target loads.
    config = json.loads((tiny[0].path / "config.json").read_text())
    config["vocab_size"] = zoo_spec("llama-3.2-1b").vocab_size
    (tmp_path / "config.json").write_text(json.dumps(config))
    monkeypatch.setattr(loader, "load", _no_load)
    cfg = _draft("llama-3.2-1b", str(tmp_path), dtype="float32", kv_bits=4, memory_gb=64)
    with pytest.raises(ConfigError, match="kv_bits needs head_dim to be a multiple of 64"):
        open_session(cfg)


@pytest.mark.parametrize(("first", "then"), [("llama-3.2-1b", None), (None, "llama-3.2-1b"),
                                             ("llama-3.2-1b", "llama-3.2-3b")])
def test_a_renewed_session_holds_what_a_fresh_one_holds(first, then):
    # Renewed with a plain config or another draft, the old draft's weights and rows are gone.
    base = open_session(_draft("llama-3.1-8b", first, **SIM))
    renewed = base.renewed(_draft("llama-3.1-8b", then, **SIM), base.memory_budget_bytes,
                           base.budget_source)
    fresh = open_session(_draft("llama-3.1-8b", then, **SIM))
    assert renewed.weight_bytes == fresh.weight_bytes
    assert renewed.cache_layout == fresh.cache_layout
    assert renewed.kv_budget_bytes == fresh.kv_budget_bytes


def test_sweeps_draft_limit_builds_no_executor(monkeypatch):
    base = open_session(_draft("llama-3.1-8b", None, **SIM))
    cfg = _draft("llama-3.1-8b", "llama-3.2-1b", **SIM)
    drafted = open_session(cfg)
    monkeypatch.setattr(session_mod, "build_executor", _no_load)
    args = argparse.Namespace(prompt_len=512, output_len=128)
    budget = base.memory_budget_bytes
    draft = sweep._draft_account(base, {2: cfg})
    assert sweep._draft_limit(base, budget, draft, args) == sweep_limits.analytic_max_batch(
        budget, drafted.weight_bytes, 512, 128, base.kv_bytes_per_token,
        drafted.cache_layout.draft)


def _point(batch: int, decoded: int, tok_s: float) -> dict:
    return {"batch": batch, "decoded_batch": decoded, "queued": decoded < batch,
            "overrun": decoded < batch, "decode_tok_s": tok_s, "decode_tok_s_source": "steady",
            "step_ms": 1.0, "output_throughput": tok_s, "median_tpot_ms": 1.0, "run_dir": "r",
            **{key: 1.0 for key in sweep_spec.SPEC_KEYS}}


def test_an_overrun_speculative_point_is_marked_and_sets_no_break_even():
    # K=3 at batch 8 decodes at most 7 rows (its draft rows cap the batch): slower than plain
    # batch 8, but not batch 8; batch 4 still pays.
    rows = [_point(4, 4, 100.0), _point(8, 8, 200.0)]
    spec = {4: _point(4, 4, 150.0), 8: _point(8, 7, 150.0)}
    cfg = _draft("tiny", None)
    res = sweep_spec.spec_points(rows, {3: cfg}, "fixed", lambda b, c, tag: spec[b])
    assert res["spec_break_even_batch"]["3"] is None
    # r3: it won where it ran, but plain batch 8 ran and speculation could not
    assert res["spec_break_even"]["3"] == "capped_by_draft_memory_at_8"
    entry = rows[1]["spec"][0]
    assert (entry["decoded_batch"], entry["queued"], entry["overrun"]) == (7, True, True)
    assert sweep_spec.gain_cell(entry) == "0.75* (decoded 7)"
    assert sweep_spec.gain_cell(rows[0]["spec"][0]) == 1.5


def test_a_stored_draft_of_other_scales_of_the_same_bytes_is_accepted(tiny_q4):
    # r3: a float16-scaled 4-bit draft for a bfloat16 4-bit target holds the same bytes as the
    # account prices (most hub drafts store bfloat16): it was refused as another format.
    kw = {"dtype": "bfloat16", "quantize": 4, "memory_gb": 1, **SIM}
    stored = open_session(_draft("tiny", str(tiny_q4[0].path), **kw))
    zoo = open_session(_draft("tiny", "tiny", **kw))
    assert stored.weight_bytes == zoo.weight_bytes


def test_renewed_sessions_load_a_draft_model_once(tiny, monkeypatch):
    """A real sweep renews its session per speculative point: each loaded the draft model
    again (a 1B draft: seconds and its weights' allocation per point); the loaded one is
    shared now."""
    base = open_session(RunConfig(model="tiny", dtype="float32", executor="mlx", memory_gb=1))
    loaded: list[str] = []
    real_load = loader.load
    monkeypatch.setattr(loader, "load", lambda ref: loaded.append(ref.name) or real_load(ref))
    cfg = _draft("tiny", "tiny", dtype="float32", executor="mlx", memory_gb=1)
    first = base.renewed(cfg, base.memory_budget_bytes, base.budget_source)
    second = base.renewed(cfg, base.memory_budget_bytes, base.budget_source)
    assert loaded == ["tiny"]
    assert first.executor.drafter.model is second.executor.drafter.model
    assert first.weight_bytes == second.weight_bytes > base.weight_bytes


def test_the_draft_weights_before_loading_build_no_cache_layout(monkeypatch):
    """draft_weights (the weights checked against the budget before the target loads) took
    draft_account()[0], building the draft's cache layout it threw away: now the weights alone,
    the same bytes draft_account counts."""
    from batchsim.server.models.loader import resolve
    from batchsim.server.perf import spec_price

    cfg = _draft("qwen3-8b", "qwen3-0.6b", quantize=4, **SIM)
    ref = resolve(cfg.model, "float16", cfg.quantize, build=False)
    weights = spec_price.draft_account(cfg, ref)[0]
    assert weights > 0

    def no_layout(*args, **kwargs):
        raise AssertionError("the draft's cache layout built, and not used")

    monkeypatch.setattr(spec_price, "draft_cache", no_layout)
    assert spec_price.draft_weights(cfg, ref) == weights
