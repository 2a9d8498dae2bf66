"""The scheduler's accounting by layer kind (scheduler/kv_bytes.py): a dense layout gives the
scalar arithmetic exactly; pool and private bytes equal formulas written here from the configs and
mlx-lm's own cache arrays; the scheduler keeps every promise on random mixed layouts, and the
simulated executor agrees with it step by step on every tiny family model."""

from __future__ import annotations

import os

import pytest
from batchsim.scheduler.kv_bytes import CacheLayout
from batchsim.scheduler.pool_geometry import KV_STEP, PoolGeometry, round_up
from batchsim.scheduler.request import RequestStatus
from batchsim.scheduler.scheduler import Scheduler
from batchsim.server.executors.fake_executor import FakeExecutor
from batchsim.server.models.spec import zoo_spec
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.drivers import config, drive, make_request, random_arrivals, step_limits

EXAMPLES = int(os.environ.get("BATCHSIM_PROPERTY_EXAMPLES", "1500")) // 5
FAMILIES = ["tiny-moe", "tiny-sliding", "tiny-hybrid", "tiny-mla"]


def layout_of(name: str) -> CacheLayout:
    return zoo_spec(name).cache_layout("float32")


@given(st.integers(1, 4096), st.integers(0, 70), st.integers(1, 3000))
def test_dense_layout_is_the_scalar_arithmetic(kvt, rows, tokens):
    d = CacheLayout.dense(kvt)
    cap = round_up(tokens, KV_STEP)
    assert d.pool_bytes(PoolGeometry(rows, cap)) == rows * cap * kvt
    start = round_up(tokens // 2, KV_STEP) if tokens > KV_STEP else 0
    assert d.private_bytes(start, tokens) == round_up(tokens, KV_STEP) * kvt
    assert d.alone_bytes(tokens) == round_up(tokens, KV_STEP) * kvt


def test_pool_bytes_of_each_family_by_hand():
    """Per layer and token K+V (float32): kv_heads 2 x (16 + 16) x 4 bytes = 256; the MLA latent
    (32) + RoPE key (16) x 4 = 192; a linear layer: conv (kernel 4 - 1) x (2 x 2 x 16 + 4 x 16)
    plus the recurrent state 4 x 16 x 16, float32."""
    state = (3 * (2 * 2 * 16 + 4 * 16) + 4 * 16 * 16) * 4
    per_row = {  # capacity -> one row's bytes
        "tiny-moe": lambda cap: 2 * cap * 256,  # 2 full layers
        "tiny-sliding": lambda cap: 2 * cap * 256 + 2 * min(cap, 64) * 256,  # 2 full, 2 window-64
        "tiny-hybrid": lambda cap: cap * 256 + 3 * state,  # 1 full, 3 linear
        "tiny-mla": lambda cap: 3 * cap * 192,  # 3 latent layers
    }
    for name, row in per_row.items():
        cache = layout_of(name)
        for rows, cap in [(1, 256), (3, 512), (8, 1024), (5, 4096)]:
            assert cache.pool_bytes(PoolGeometry(rows, cap)) == rows * row(cap), (name, rows, cap)
        assert cache.pool_bytes(PoolGeometry(0, 0)) == 0
    sliding = layout_of("tiny-sliding")  # a private RotatingKVCache: the chunk + window - 1 held
    assert sliding.private_bytes(512, 1024) == 1024 * 2 * 256 + (512 + 63) * 2 * 256
    assert sliding.private_bytes(0, 40) == 256 * 2 * 256 + 40 * 2 * 256


@st.composite
def layouts(draw):
    full = draw(st.sampled_from([0, 0, 64, 512]))
    windows = draw(st.lists(st.sampled_from([8, 64, 200, 300, 1000]), max_size=2, unique=True))
    sliding = tuple(sorted((w, draw(st.sampled_from([64, 256, 1024]))) for w in windows))
    state = draw(st.sampled_from([0, 0, 3000, 40_000]))
    if not (full or sliding or state):
        full = 128
    return CacheLayout(full, sliding, state)


@st.composite
def workloads(draw):
    cache = draw(layouts())
    reqs = draw(random_arrivals(16))
    cfg = dict(kv_budget_bytes=cache.alone_bytes(draw(st.integers(256, 6000))),
               kv_bytes_per_token=cache.full_token_bytes, cache_layout=cache, max_model_len=2048,
               **draw(step_limits(10)))
    return reqs, cfg


@settings(max_examples=EXAMPLES, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(workloads())
def test_random_mixed_layouts_keep_every_promise(case):
    reqs, cfg = case
    s = Scheduler(config(**cfg))
    ex = FakeExecutor(step_s=1.0, max_lookahead_steps=cfg["max_lookahead_steps"])
    trace = drive(s, ex, [(step, make_request(i, p, o)) for i, (step, p, o) in enumerate(reqs)])
    cache = cfg["cache_layout"]
    for plan in trace.plans:  # drive checked integrity (private bytes included) every step
        assert cache.pool_bytes(plan.pool) <= plan.kv_bytes <= cfg["kv_budget_bytes"]
    for r in trace.requests.values():
        if r.status is RequestStatus.REJECTED:
            assert (r.max_total_tokens > cfg["max_model_len"]
                    or cache.alone_bytes(r.max_total_tokens) > cfg["kv_budget_bytes"])
        else:
            assert r.status is RequestStatus.FINISHED
            assert r.num_output_tokens == r.sampling.max_tokens
    assert s.kv.private == {} and not s.running and not s.waiting


@pytest.mark.parametrize("name", FAMILIES)
def test_sim_executor_agrees_with_the_scheduler_on_every_family(name):
    """A tight budget (joins, leaves, preemptions, sliding caches shrinking): the simulated
    executor's own account equals the scheduler's after every step (drive asserts it)."""
    from batchsim.server.executors.sim_executor import SimExecutor
    from batchsim.server.perf.devices import resolve_profile
    from batchsim.server.perf.stepcost import StepCost

    spec, cache = zoo_spec(name), layout_of(name)
    # a dense-equivalent price
    cost = StepCost(spec, resolve_profile("M2 Max", None), "float32", None)
    ex = SimExecutor(cost, max_lookahead_steps=16, cache=cache)
    s = Scheduler(config(kv_budget_bytes=cache.pool_bytes(PoolGeometry(3, 1024)),
                         kv_bytes_per_token=cache.full_token_bytes, cache_layout=cache,
                         max_num_seqs=6, prefill_step_size=256, max_num_batched_tokens=512,
                         row_step=2, max_lookahead_steps=16))
    arrivals = [(i * 2, make_request(i, 100 + 97 * i % 900, 30 + 13 * i % 80)) for i in range(14)]
    trace = drive(s, ex, arrivals)
    assert all(r.status is RequestStatus.FINISHED for r in trace.requests.values())
    assert s.num_preemptions > 0 and ex.kv_bytes() == 0


@pytest.fixture(scope="module")
def mlx_models(tmp_path_factory):
    from batchsim.server.models.build import build_model
    from batchsim.server.models.loader import ModelRef, load

    root = tmp_path_factory.mktemp("layout-models")
    out = {}
    for name in ("tiny-sliding", "tiny-hybrid"):
        path = build_model(zoo_spec(name), "float32", out_dir=root / name)
        out[name] = load(ModelRef(name, path, zoo_spec(name), "float32", None))[0]
    return out


@pytest.mark.parametrize("prefill", [256, 512])
@pytest.mark.parametrize("name", ["tiny-sliding", "tiny-hybrid"])
def test_scheduler_bytes_equal_mlx_lm_cache_through_prefill_and_decode(mlx_models, name, prefill):
    """One sequence, chunked as the scheduler plans it (a 1020-token prompt), then decoded across
    the 1024-token step: after every step the scheduler's bytes (private cache, then a one-row
    pool) equal mlx-lm's prompt cache arrays."""
    import mlx.core as mx
    from mlx_lm.models.cache import make_prompt_cache

    model, cache_layout = mlx_models[name], layout_of(name)
    s = Scheduler(config(kv_bytes_per_token=cache_layout.full_token_bytes,
                         cache_layout=cache_layout,
                         prefill_step_size=prefill, max_num_batched_tokens=prefill))
    s.add_request(make_request(0, 1020, 12))
    cache, calls, token, ex = make_prompt_cache(model), [], 3, FakeExecutor()
    while s.has_work():
        plan = s.schedule()
        sizes = [c.num_tokens for c in plan.prefills] + [1] * len(plan.decode_ids)
        for n in sizes:
            model(mx.array([[(token + i) % 500 + 3 for i in range(n)]]), cache=cache)
            calls.append(n)
        mx.eval([c.state for c in cache])
        if sizes:
            assert plan.kv_bytes == sum(c.nbytes for c in cache), (name, calls)
        s.update_from_output(plan, ex.execute(plan))
        s.check_integrity()
    assert len(calls) > 12 and any(n > 1 for n in calls) and sum(calls) == 1020 + 11


@pytest.mark.parametrize("name", ["tiny", "tiny-sliding", "tiny-hybrid"])
def test_session_prices_the_scheduler_by_the_models_layout(name):
    """open_session builds the layout from the model description and hands it to the scheduler
    (dense: one number per token, as before)."""
    from batchsim.server.engine.run_config import RunConfig
    from batchsim.server.engine.session import open_session

    s = open_session(RunConfig(model=name, executor="fake", memory_gb=1))
    cfg = s.scheduler_config()
    assert cfg.layout == zoo_spec(name).cache_layout(s.dtype) == s.cache_layout
    assert cfg.kv_bytes_per_token == cfg.layout.full_token_bytes == s.kv_bytes_per_token
    assert cfg.layout.is_dense == (name == "tiny")
