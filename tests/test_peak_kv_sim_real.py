"""Simulated and real runs report the same peak KV with the prefix cache on (the default): the
real executor caches every prompt's blocks, the simulator only a workload's shared segments, so
`peak_kv_bytes` counts the KV the running requests hold (what a new request cannot take), and
`peak_kv_held_bytes` / `peak_prefix_cache_bytes` every byte held / the cache's own."""

from __future__ import annotations

from pathlib import Path

import pytest

LOCAL = str(Path(__file__).resolve().parents[1] / "configs/devices"
            / "linux-x86_64-openblas-2core.yaml")


def _summary(executor: str, *flags: str, out_dir: Path | None = None) -> dict:
    from batchsim.scripts.cli import build_parser
    from batchsim.scripts.run_args import config_from_args
    from batchsim.server.engine.runner import run_workload
    from batchsim.server.engine.session import open_session

    args = build_parser().parse_args([
        "run", "--model", "tiny", "--dtype", "float32", "--executor", executor,
        "--device-profile", LOCAL, "--num-prompts", "12", "--request-rate", "inf",
        "--input-len", "128", "--output-len", "4", "--max-num-seqs", "4", *flags])
    cfg = config_from_args(args)
    return run_workload(open_session(cfg), cfg.workload, out_dir=out_dir, label=executor,
                        timeline=False).summary


@pytest.mark.parametrize("layout", ["padded", "paged"])
def test_sim_and_real_agree_on_peak_kv_with_the_prefix_cache(batchsim_home, layout):
    real, sim = _summary("mlx", "--kv-layout", layout), _summary("sim", "--kv-layout", layout)
    assert real["prefix_cache"] and sim["prefix_cache"]
    # the real run keeps every random prompt's 8 blocks (none is ever hit); the sim none
    assert real["prefix_cache_hit_rate"] == sim["prefix_cache_hit_rate"] == 0.0
    assert real["peak_prefix_cache_bytes"] > sim["peak_prefix_cache_bytes"] == 0
    assert real["peak_kv_held_bytes"] == real["peak_kv_bytes_measured"] > real["peak_kv_bytes"]
    assert real["peak_kv_bytes"] == sim["peak_kv_bytes"] > 0
    if layout == "padded":  # paged: the sim predicts the prompt blocks a real run holds
        assert sim["peak_kv_bytes"] == sim["peak_kv_held_bytes"]  # as its prefill ends
    else:  # which its pool does not model: every byte held still counts them
        assert sim["peak_kv_held_bytes"] == sim["peak_kv_bytes"] > sim["peak_kv_bytes_measured"]
    # the simulator's peak memory: its estimate, weights and every KV byte held
    assert sim["peak_memory_source"] == "weights+kv"
    assert sim["peak_memory_bytes"] == sim["weight_bytes"] + sim["peak_kv_held_bytes"]
    assert sim["peak_memory"] == sim["peak_memory_bytes"] / 1e9


def test_a_rebuilt_paged_sim_summary_keeps_held_at_least_running(batchsim_home, tmp_path):
    from batchsim.server.results.rebuild import rebuild_summary

    ran = _summary("sim", "--kv-layout", "paged", out_dir=tmp_path)
    rebuilt, _ = rebuild_summary(Path(ran["run_dir"]), timeline=False)
    assert rebuilt["peak_kv_held_bytes"] == ran["peak_kv_held_bytes"] >= rebuilt["peak_kv_bytes"]


@pytest.mark.parametrize("flags", [("--prefix-cache", "off"), ("--kv-layout", "paged",
                                                                "--prefix-cache", "off")])
def test_without_the_cache_running_kv_is_every_byte_held_or_the_rows_blocks(batchsim_home, flags):
    real, sim = _summary("mlx", *flags), _summary("sim", *flags)
    assert real["peak_kv_bytes"] == sim["peak_kv_bytes"] > 0
    assert real["peak_kv_held_bytes"] == sim["peak_kv_held_bytes"] >= sim["peak_kv_bytes"]
