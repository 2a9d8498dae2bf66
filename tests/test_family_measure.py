"""validate and calibrate on models whose caches are not dense (sliding windows, linear-attention
states, MLA latents): the shadow timer's simulated pool holds what the real pool holds, and
calibration times their decode steps from private caches of every layer kind."""

from __future__ import annotations

import dataclasses

import pytest
from batchsim.scheduler.kv_bytes import CacheLayout
from batchsim.server.engine.run_config import RunConfig, SchedulerSettings
from batchsim.server.engine.runner import run_workload
from batchsim.server.engine.session import open_session
from batchsim.server.executors.mlx_executor import MLXExecutor
from batchsim.server.executors.shadow import ShadowTimer
from batchsim.server.measure import calibration as cal
from batchsim.server.measure.prefilled import prefilled
from batchsim.server.perf.devices import SHIPPED_DIR, load_profile
from batchsim.server.perf.stepcost import StepCost
from batchsim.workloads.lengths import parse_length
from batchsim.workloads.spec import WorkloadSpec

from tests.cli_calls import last_json

PROFILE = load_profile(SHIPPED_DIR / "linux-x86_64-openblas-2core.yaml")
FAMILIES = ["tiny-sliding", "tiny-hybrid", "tiny-mla"]


def _session(name: str):
    spec = WorkloadSpec(name="t", num_prompts=10, arrival="poisson", request_rate=float("inf"),
                        input_len=parse_length("uniform:40:150"),
                        output_len=parse_length("uniform:4:12"),
                        seed=3)  # prompts on both sides of tiny-sliding's 64-token window
    return open_session(RunConfig(model=name, dtype="float32", workload=spec,
                                  scheduler=SchedulerSettings(max_num_seqs=4)))


def _shadowed_bytes(session, cache: CacheLayout | None) -> tuple[ShadowTimer,
                                                                 list[tuple[int, int]]]:
    """A real run shadowed on a simulated pool of `cache`: (simulated, real) bytes after each
    step."""
    shadow = ShadowTimer(StepCost(session.spec, PROFILE, "float32", None), cache)
    held: list[tuple[int, int]] = []

    def hook(engine, plan, result) -> None:
        shadow(engine, plan, result)
        held.append((shadow.sim.kv_bytes(), result.kv_bytes))

    run_workload(session, session.config.workload, out_dir=None, label="t", on_step=hook)
    return shadow, held


@pytest.mark.parametrize("name", ["tiny-sliding", "tiny-hybrid"])
def test_the_shadow_pool_holds_the_bytes_the_real_executor_measured(batchsim_home, name):
    """validate's shadow timer is given the real session's cache layout: its simulated pool (and
    so its joins, leaves and regrowth) holds, step by step, what the real executor measured. A
    dense shadow of the same run does not (the case before: windows and states priced per token)."""
    session = _session(name)
    assert session.cache_layout == session.executor.cache_layout
    assert not session.cache_layout.is_dense
    shadow, held = _shadowed_bytes(session, session.cache_layout)
    assert len(held) > 5 and any(real > 0 for _, real in held)
    assert [sim for sim, _ in held] == [real for _, real in held]
    assert shadow.sim.layout.row_ids == session.executor.pool.row_ids
    _, dense = _shadowed_bytes(session, None)
    assert [sim for sim, _ in dense] != [real for _, real in dense]


@pytest.mark.parametrize("name", FAMILIES)
def test_calibration_decodes_family_models_from_prefilled_caches(batchsim_home, name):
    """calibrate's decode grid on a family model: requests prefilled by layer kind (no kv_heads),
    joined into the pool it prices: what the executor holds is the layout's pool, every token of
    the prompt past a sliding window included."""
    session = _session(name)
    layout = cal.session_layout(session)
    assert layout == session.executor.cache_layout
    ex = MLXExecutor(session.model)
    width, batch = 100, 3  # past tiny-sliding's 64-token window
    prefilled(session.model, ex, session.spec, batch, width)
    geom = cal.decode_geometry(batch, width, 2)
    plan = cal.StepPlan(0, (), (), (), tuple(range(batch)), (width,) * batch, geom,
                        layout.pool_bytes(geom))
    result = ex.execute(plan)
    assert result.kv_bytes == layout.pool_bytes(geom) == ex.pool.nbytes
    assert len(result.token_ids[0]) == batch
    assert cal.decode_kv_bytes(layout, batch, width, 2) == 2 * layout.pool_bytes(geom)
    samples = cal.grid_samples({name: (session.model, session.spec, layout)}, [1, 2], [width],
                               [16], [0], rounds=1, log=lambda _: None)
    assert {(s.kind, s.rows) for s in samples} == {("decode", 1), ("decode", 2), ("prefill", 16)}
    assert all(s.seconds > 0 for s in samples)


def test_a_dense_model_calibrates_as_before():
    """An int is a dense model's bytes per token, priced exactly as the scalar arithmetic."""
    geom = cal.decode_geometry(4, 128, 5)
    assert cal.decode_kv_bytes(1024, 4, 128) == 2 * geom.nbytes(1024)
    assert cal.as_layout(1024) == CacheLayout.dense(1024)
    assert dataclasses.asdict(cal._scheduler(1024, 2, 256).config)["cache_layout"] is None


@pytest.mark.parametrize("message, skipped", [
    ("model tiny-mla: MLA caches are not yet batched", True),
    ("model tiny-mla: something else is wrong", False),
])
def test_validate_skips_a_model_the_session_refuses_as_not_yet_runnable(
        monkeypatch, capsys, tmp_path, batchsim_home, message, skipped):
    """A session that refuses the model as 'not yet' supported: validate skips its cases with one
    line and a `skipped` document; any other refusal stays a one-line error."""

    from batchsim.configs import ConfigError
    from batchsim.scripts.cli import main
    from batchsim.server.engine import session

    def refuse(cfg, *args, **kwargs):
        raise ConfigError(message)

    monkeypatch.setattr(session, "open_session", refuse)
    rc = main(["validate", "--matrix", "sliding", "--device-profile", "linux-x86_64-openblas-2core",
               "--out", str(tmp_path)])
    captured = capsys.readouterr()
    if not skipped:
        assert rc != 0
        assert "something else is wrong" in captured.err
        assert "Traceback" not in captured.err
        return
    assert rc == 0 and "tiny-sliding is not runnable yet" in captured.err
    assert "3 cases are skipped" in captured.err
    doc = last_json(captured.out)
    assert doc == {"model": "tiny-sliding", "skipped": f"not runnable yet: {message}", "cases": []}
