"""`batchsim size`'s best batch: the batch up to the max batch whose predicted decode makes the
most tok/s (on some Macs the max batch is slower than a smaller one), the same answer as trying
every batch, in the rows, the table, its note and the plot."""

from __future__ import annotations

import argparse

import pytest
from batchsim.scripts import common, size
from batchsim.server.models.spec import zoo_spec
from batchsim.server.perf import macs, size_limits
from batchsim.server.perf.engines import DEFAULT_ENGINE, load_engine
from batchsim.server.perf.gpu_fit import load_fit


def _every_batch(cost, max_batch: int, width: int) -> tuple[int, float]:
    rate, batch = max((size_limits.tok_s(size_limits.decode_step(cost, b, width), b), -b)
                      for b in range(1, max_batch + 1))
    return -batch, rate


@pytest.mark.parametrize("model,quantize,context", [
    ("llama-3.1-8b", 4, 4096),  # max batches 2..759, the best below the max on many Macs
    ("qwen3-30b-a3b", 4, 512),  # MoE: its step's time drops at 129 rows (a kernel switch)
])
def test_best_batch_is_what_trying_every_batch_finds(model, quantize, context):
    spec, catalog = zoo_spec(model), macs.load_catalog()
    s = size_limits.Settings("float16", quantize, None, None, 8.0, fit=load_fit(),
                             engine=load_engine(DEFAULT_ENGINE))
    ctx = size_limits.context_fit(str(context), spec.max_context)
    beyond_exhaustive = below_max = 0
    for mac in catalog.chips:
        for gb in mac.mem_gb:
            row = size_limits.mac_row(spec, mac, gb, ctx, s, catalog.metal_working_set)
            if row["max_batch"] < 1:
                assert row["best_batch"] is row["decode_tok_s_best"] is None
                continue
            cost = size_limits.mac_cost(spec, mac, s)
            assert (row["best_batch"], row["decode_tok_s_best"]) == _every_batch(
                cost, row["max_batch"], context), (mac.label, gb)
            beyond_exhaustive += row["max_batch"] > size_limits.BEST_EVERY_BATCH_TO
            below_max += row["best_batch"] < row["max_batch"]
    assert beyond_exhaustive and below_max  # the tile-stride part of the search was exercised


def test_rows_table_and_note_show_the_best_batch(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(common.out, "width", 200)
    parser = argparse.ArgumentParser()
    size.add_parser(parser)
    result = size.run(parser.parse_args(["--quantize", "4", "--mac", "M4", "--out",
                                         str(tmp_path)]))
    rows = {(r["label"], r["memory_gb"]): r for r in result["rows"]}
    r32, r16 = rows[("M4 10c", 32)], rows[("M4 10c", 16)]
    # More memory, more rows, fewer tok/s at the max: the best batch says where the peak is.
    assert r32["max_batch"] > r16["max_batch"] and r32["max_batch"] > r32["best_batch"]
    assert r32["decode_tok_s_best"] > r32["decode_tok_s_max_batch"]
    assert r32["engine"] == "batchsim"  # the contract: rows carry their engine
    for r in result["rows"]:  # at the max, the best is the max's own figure
        if r["best_batch"] == r["max_batch"]:
            assert r["decode_tok_s_best"] == r["decode_tok_s_max_batch"]
        assert r["decode_tok_s_best"] >= r["decode_tok_s_max_batch"]
    printed = capsys.readouterr().out
    header = printed[printed.index("┏"):printed.index("┡")]
    assert "best batch" in header and "@best" in header
    assert "Best batch: the batch up to the max with the most predicted tok/s" in printed
