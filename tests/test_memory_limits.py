"""Memory beyond weights and KV on real runs: MLX's buffer cache follows the KV budget, prefill
chunks are kept short enough for their activations to fit a stated allowance (real executors
only), and the estimate behind that bounds what MLX really allocates."""

from __future__ import annotations

import dataclasses

import mlx.core as mx
import pytest
from batchsim.scheduler.pool_geometry import KV_STEP
from batchsim.server.engine import memory
from batchsim.server.engine.run_config import RunConfig
from batchsim.server.engine.session import open_session
from batchsim.server.models.loader import resolve
from batchsim.workloads.lengths import parse_length
from batchsim.workloads.spec import WorkloadSpec


def test_cache_limit_follows_the_kv_budget():
    limit = memory.mlx_cache_limit_bytes
    assert limit(0) == memory.MLX_CACHE_FLOOR_BYTES
    assert limit(50 << 20) < 64 << 20  # a 50 MB budget: far below the old fixed 4 GiB
    assert limit(1 << 30) < limit(8 << 30) < limit(1 << 40) == memory.MLX_CACHE_MAX_BYTES


def test_prefill_cap_only_where_activations_would_not_fit():
    long = resolve("llama-3.1-8b", "float16", build=False).spec  # 131,072 tokens, 32 heads
    capped = memory.prefill_step_cap(long, 2, 2048, scores=True)
    assert capped % KV_STEP == 0 and KV_STEP <= capped < 2048
    assert memory.prefill_step_cap(long, 2, 2048, scores=False) == 2048  # fused attention
    assert memory.prefill_step_cap(long, 2, 256, scores=True) == 256  # never above configured
    short = resolve("smollm2-135m", "float32", build=False).spec
    per_token = memory.prefill_token_bytes(short, 4, short.max_context, scores=True)
    cap = memory.prefill_step_cap(short, 4, 1 << 20, scores=True)
    assert cap * per_token <= memory.PREFILL_TRANSIENT_BYTES < (cap + KV_STEP) * per_token


def test_simulated_sessions_keep_their_chunks():
    cfg = RunConfig(model="llama-3.1-8b", executor="sim", device_profile="M2 Ultra",
                    memory_gb=64)
    cfg = dataclasses.replace(cfg, scheduler=dataclasses.replace(cfg.scheduler,
                                                                 prefill_step_size=2048,
                                                                 max_num_batched_tokens=4096))
    assert open_session(cfg).scheduler_config().prefill_step_size == 2048


def test_a_real_session_sets_the_cache_limit(batchsim_home):
    session = open_session(RunConfig(model="tiny", dtype="float32", memory_gb=0.05))
    expected = memory.mlx_cache_limit_bytes(session.kv_budget_bytes)
    assert mx.set_cache_limit(expected) == expected  # returns the limit it replaces
    smaller = session.with_config(dataclasses.replace(session.config, memory_gb=0.01))
    assert mx.set_cache_limit(expected) == memory.mlx_cache_limit_bytes(smaller.kv_budget_bytes)


def test_the_estimate_bounds_a_real_chunk(tiny):
    """One 512-token prefill chunk of the tiny model at context 1,024: MLX's peak above what was
    held before (KV growth included) stays under the estimate."""
    from mlx_lm.models.cache import make_prompt_cache

    ref, model, _ = tiny
    cache = make_prompt_cache(model)
    model.model(mx.arange(512)[None] % 100, cache=cache)
    mx.eval([c.state for c in cache])
    mx.clear_cache()
    mx.reset_peak_memory()
    before = mx.get_active_memory()
    model.model(mx.arange(512)[None] % 100, cache=cache)
    mx.eval([c.state for c in cache])
    transient = mx.get_peak_memory() - before
    estimate = 512 * memory.prefill_token_bytes(ref.spec, 4, 1024, scores=True)
    assert 0 < transient <= estimate, (transient, estimate)


def test_a_real_run_reports_peak_memory_against_the_budget(batchsim_home):
    from batchsim.server.engine.runner import run_workload

    spec = WorkloadSpec(name="m", num_prompts=4, request_rate=float("inf"),
                        input_len=parse_length("64"), output_len=parse_length("4"))
    session = open_session(RunConfig(model="tiny", dtype="float32", memory_gb=0.05,
                                     workload=spec))
    summary = run_workload(session, spec, out_dir=None, label="m").summary
    assert summary["peak_rss_bytes"] > summary["peak_memory"] * 2**30 > 0
    assert summary["memory_budget_bytes"] == int(0.05 * 2**30)


@pytest.mark.parametrize("n", [1, 4096])
def test_prefill_token_bytes_grow_with_context_only_with_scores(n):
    spec = resolve("tiny", "float32", build=False).spec
    assert (memory.prefill_token_bytes(spec, 4, n, scores=False)
            == memory.prefill_token_bytes(spec, 4, 1, scores=False))
    assert (memory.prefill_token_bytes(spec, 4, n, scores=True)
            >= memory.prefill_token_bytes(spec, 4, 1, scores=True))


def test_a_tiny_budget_that_does_not_fit_says_its_bytes():
    """The no-fit line shows a budget under 0.01 GiB in a unit that shows it, not "0.00 GiB"."""
    from batchsim.configs import ConfigError

    with pytest.raises(ConfigError) as err:
        open_session(RunConfig(model="llama-3.2-1b", executor="sim", device_profile="M2 Max",
                               memory_gb=2 / 1024))
    assert "0.00 GiB" not in str(err.value) and "(2.00 MiB, " in str(err.value), err.value


def test_bytes_read_in_the_largest_unit_of_which_they_are_at_least_one():
    from batchsim.server.platform.units import bytes_text

    # r3: 11 MB read "0.01 GiB", so two budgets 0.2 MB apart printed alike
    assert [bytes_text(b) for b in (11.0e6, 10.8e6, 3 << 30, 1536, 12)] == [
        "10.49 MiB", "10.30 MiB", "3.00 GiB", "1.50 KiB", "12 bytes"]


def test_sweep_reads_its_budget_as_bytes_text_does(capsys):
    """sweep kept a twin formatter of its own (a 300 KiB budget read "0.3 MiB", 11 MB
    "10.5 MiB"): it prints bytes_text's reading now, from its light home."""
    import subprocess
    import sys

    from batchsim.scripts import sweep_view

    meta = {"prompt_len": 16, "output_len": 8, "workload": None, "model": "tiny",
            "dtype": "float32", "executor": "fake", "budget_source": "--memory-gb",
            "weight_bytes": 1 << 20, "kv_bytes_per_seq": 1 << 10}
    for budget, text in ((300 << 10, "300.00 KiB"), (11_000_000, "10.49 MiB")):
        sweep_view.announce({**meta, "memory_budget_bytes": budget}, [1])
        assert f"budget {text} (--memory-gb)" in capsys.readouterr().out
    code = ("import sys; import batchsim.server.platform.units; "
            "print('batchsim.server.engine.session' in sys.modules)")
    light = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                           check=True).stdout
    assert light.strip() == "False"
