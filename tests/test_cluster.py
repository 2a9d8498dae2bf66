"""The cluster cost (server/perf/cluster.py): link arithmetic by hand, tensor parallel splitting
what mlx-lm's shard() splits, nothing changed on one rank, and `size --macs`."""

from __future__ import annotations

import dataclasses

import pytest
from batchsim.configs import ConfigError
from batchsim.server.models.spec import zoo_spec
from batchsim.server.perf import macs
from batchsim.server.perf.cluster import Cluster, Link, load_links, replicated_bytes
from batchsim.server.perf.stepcost import StepCost

from tests.cli_calls import run_size

RING = Link("r", "test ring", "tcp", "ring", bandwidth_gbs=1.0, latency_us=100.0, source="-")
FREE = Link("f", "free link", "rdma", "mesh", bandwidth_gbs=1e12, latency_us=0.0, source="-")


def _cost(name: str, cluster: Cluster | None = None) -> StepCost:
    catalog = macs.load_catalog()
    (mac,) = [m for m in catalog.chips if m.label == "M3 Ultra 80c"]
    profile = mac.profile(macs.bandwidth_efficiency(catalog, "Q4_0")[0],
                          macs.compute_efficiency(catalog)[0])
    return StepCost(zoo_spec(name), profile, "float16", 4, cluster=cluster)


def test_link_arithmetic_by_hand():
    # Ring of 4: 2 x 3 messages of 1/4 of 8 MB at 1 GB/s plus 100 us each.
    assert RING.all_reduce_s(8e6, 4) == pytest.approx(6 * (100e-6 + 2e6 / 1e9))
    mesh = dataclasses.replace(RING, topology="mesh")
    assert mesh.all_reduce_s(8e6, 4) == pytest.approx(100e-6 + 8e6 / 1e9)
    assert RING.all_reduce_s(8e6, 1) == 0.0


def test_one_rank_prices_exactly_what_one_mac_does():
    one, single = _cost("llama-3.1-70b"), _cost("llama-3.1-70b", Cluster(1, RING))
    for kwargs in ({"decode_rows": 8, "width": 1000}, {"decode_rows": 1, "width": 10}):
        assert single.step_time(**kwargs) == one.step_time(**kwargs)
        assert one.step_time(**kwargs).comm_s == 0.0


def test_tensor_parallel_splits_all_but_the_lm_head_and_adds_two_all_reduces_per_layer():
    spec = zoo_spec("llama-3.1-70b")
    one = _cost("llama-3.1-70b").step_time(decode_rows=4, width=512)
    head_w, _head_m = _cost("llama-3.1-70b").linear_split(4, spec.hidden_size, spec.vocab_size)
    two = _cost("llama-3.1-70b", Cluster(2, RING)).step_time(decode_rows=4, width=512)
    assert two.weights_s == pytest.approx((one.weights_s - head_w) / 2 + head_w)
    assert two.attention_s == pytest.approx(one.attention_s / 2)
    assert (two.elementwise_s, two.fixed_s) == (one.elementwise_s, one.fixed_s)
    message = 4 * spec.hidden_size * 2  # rows x hidden x float16
    assert two.comm_s == pytest.approx(spec.num_layers * 2 * RING.all_reduce_s(message, 2))
    # A free link: two Macs decode a dense model almost twice as fast; a slow one, slower.
    free = _cost("llama-3.1-70b", Cluster(2, FREE)).step_time(decode_rows=1, width=512)
    one_b1 = _cost("llama-3.1-70b").step_time(decode_rows=1, width=512)
    assert 1.8 < one_b1.total_s / free.total_s < 2.0
    slow = _cost("llama-3.1-70b",
                 Cluster(2, load_links()["10gbe"])).step_time(decode_rows=1, width=512)
    assert slow.total_s > one_b1.total_s


def test_mla_keeps_its_latent_cache_whole_and_pipeline_splits_memory_not_time():
    spec = zoo_spec("deepseek-v3")
    one = _cost("deepseek-v3").step_time(decode_rows=2, width=4096)
    tp = _cost("deepseek-v3", Cluster(4, FREE)).step_time(decode_rows=2, width=4096)
    assert tp.attention_s == pytest.approx(one.attention_s)
    assert tp.experts_s == pytest.approx(one.experts_s / 4)
    pp_cluster = Cluster(4, RING, "pipeline")
    pp = _cost("deepseek-v3", pp_cluster).step_time(decode_rows=2, width=4096)
    assert pp.total_s - pp.comm_s == pytest.approx(one.total_s)
    assert pp.comm_s == pytest.approx(3 * RING.send_s(2 * spec.hidden_size * 2))
    assert pp_cluster.kv_share(spec) == 0.25 and Cluster(4, RING).kv_share(spec) == 1.0


def test_size_macs_splits_the_weights_and_keeps_the_row_keys(tmp_path):
    args = ("--model", "llama-3.1-405b", "--quantize", "4", "--mac", "M3 Ultra 80c",
            "--memory-gb", "256")
    one = run_size(tmp_path, *args)["rows"][0]
    out = run_size(tmp_path, *args, "--macs", "4", "--link", "tb5-rdma")
    four = out["rows"][0]
    assert set(four) == set(one) and out["macs"] == 4 and out["link"] == "tb5-rdma"
    spec = zoo_spec("llama-3.1-405b")
    whole = replicated_bytes(spec, "float16", 4)
    assert four["weight_bytes"] == whole + -(-(one["weight_bytes"] - whole) // 4)
    assert four["kv_bytes_per_token"] == one["kv_bytes_per_token"] // 4
    assert not one["fits"] and four["fits"] and four["max_batch"] > 0
    assert one["decode_tok_s_b1"] is None and four["decode_tok_s_b1"] > 0


def test_a_bad_link_is_a_one_line_error(tmp_path):
    with pytest.raises(ConfigError, match="unknown link 'tb9'"):
        run_size(tmp_path, "--macs", "2", "--link", "tb9")
    bad = tmp_path / "links.yaml"
    bad.write_text("links:\n  x: {name: a, transport: tcp, topology: ring, bandwidth_gbs: 1, "
                   "latency_us: 1, source: s, speed: 3}\n")
    with pytest.raises(ConfigError, match=r"links.x: unknown key 'speed'"):
        load_links(bad)
