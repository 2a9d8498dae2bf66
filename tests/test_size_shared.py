"""`batchsim size --shared-prefix`: how many users fit when they share a prompt prefix stored once
in whole blocks, against hand-computed values, and the flag's contract."""

from __future__ import annotations

import numpy as np
import pytest
from batchsim.scheduler.pool_geometry import PAGE_TOKENS, paged_bytes
from batchsim.server.perf import macs, size_limits
from batchsim.server.perf.gpu_fit import load_fit

GIB = 1 << 30
KV_8B_FP16 = 2 * 32 * 8 * 128 * 2  # llama-3.1-8b: K and V x layers x kv_heads x head_dim x fp16


def test_shared_prefix_stored_once_in_whole_blocks():
    # 300 tokens each, the first 100 shared: 96 tokens (6 whole blocks) once, then each sequence's
    # other 204 tokens in 13 blocks (208 tokens). A GiB holds 8192 tokens of this model's KV.
    ctx = size_limits.context_fit("300", 131072, shared_prefix_tokens=100)
    assert ctx.paged_shared_tokens[1:4].tolist() == [96 + 208, 96 + 2 * 208, 96 + 3 * 208]
    shared = size_limits.max_batch(ctx.paged_shared_tokens, GIB, KV_8B_FP16)
    assert shared == (8192 - 96) // 208 == 38
    assert size_limits.max_batch(ctx.paged_tokens, GIB, KV_8B_FP16) == 26  # nothing shared
    # Stored once, the prefix's blocks plus every sequence's own: paged_bytes of the pieces.
    pieces = [96] + [204] * shared
    assert paged_bytes(pieces, KV_8B_FP16) <= GIB < paged_bytes([*pieces, 204], KV_8B_FP16)


def test_no_prefix_is_the_paged_curve():
    dist, small = "lognormal:2000:1500:8192", {"cap": 256, "trials": 32, "seed": 3}
    plain = size_limits.context_fit(dist, 131072, **small)
    zero = size_limits.context_fit(dist, 131072, shared_prefix_tokens=0, **small)
    assert zero.shared_tokens is None and np.array_equal(zero.paged_shared_tokens,
                                                         plain.paged_tokens)
    # Under PAGE_TOKENS nothing whole is shared: the same curve too.
    tiny = size_limits.context_fit(dist, 131072, shared_prefix_tokens=PAGE_TOKENS - 1, **small)
    assert np.array_equal(tiny.paged_shared_tokens, plain.paged_tokens)


def test_distribution_with_sequences_shorter_than_the_prefix():
    lengths = np.array([[40, 500, 20]])
    # Prefix 100 (96 whole): the 40-token sequence shares its 2 whole blocks, the 20-token one 1.
    curve = size_limits.shared_paged_tokens(lengths, 100)
    assert curve.tolist() == [[32 + 16, 96 + 16 + 416, 96 + 16 + 416 + 16]]
    ctx = size_limits.context_fit("uniform:50:4000", 131072, shared_prefix_tokens=1000, cap=256,
                                  trials=32)
    assert np.all(np.diff(ctx.paged_shared_tokens) >= 0)  # one searchsorted stays right
    assert np.all(ctx.paged_shared_tokens <= ctx.paged_tokens)


def _size(tmp_path, *argv: str) -> dict:
    import argparse

    from batchsim.scripts import size

    parser = argparse.ArgumentParser()
    size.add_parser(parser)
    return size.run(parser.parse_args([*argv, "--out", str(tmp_path)]))


def test_size_rows_carry_max_batch_shared(tmp_path, capsys):
    summary = _size(tmp_path, "--model", "llama-3.1-8b", "--mac", "M2 Ultra 76c", "--context",
                    "8192", "--shared-prefix", "4096")
    assert summary["shared_prefix_tokens"] == 4096
    for row in summary["rows"]:
        assert row["max_batch_shared"] > row["max_batch_paged"]
        budget = row["usable_bytes"] - row["weight_bytes"]  # 4096 shared + 4096 own per user
        assert row["max_batch_shared"] == (budget // KV_8B_FP16 - 4096) // 4096
        assert row["max_batch_shared_raised"] >= row["max_batch_shared"]
    printed = capsys.readouterr().out
    assert "shared" in printed and "Shared: paged, every sequence's first 4096 tokens" in printed


@pytest.mark.parametrize("model", ["llama-3.1-8b", "gemma-3-4b"])
def test_rows_share_only_with_a_prefix(model):
    """max_batch_shared equals the paged max batch without a prefix, and exceeds it with one (a
    model with sliding-window layers shares its full-attention blocks only)."""
    from batchsim.server.models.spec import zoo_spec

    catalog = macs.load_catalog()
    (mac,) = [m for m in catalog.chips if m.label == "M2 Ultra 76c"]
    s = size_limits.Settings("float16", None, None, None, 8.0, fit=load_fit())
    spec = zoo_spec(model)
    rows = [size_limits.mac_row(spec, mac, 192, size_limits.context_fit(
        "8192", spec.max_context, shared_prefix_tokens=prefix), s, catalog.metal_working_set)
        for prefix in (0, 4096)]
    assert rows[0]["max_batch_shared"] == rows[0]["max_batch_paged"] == rows[1]["max_batch_paged"]
    assert rows[1]["max_batch_shared"] > rows[1]["max_batch_paged"]


@pytest.mark.parametrize("argv, says", [
    (["--shared-prefix", "-1"], "--shared-prefix: expected an integer >= 0"),
    (["--shared-prefix", "5000", "--context", "4096"], "--shared-prefix 5000 exceeds the context"),
])
def test_bad_shared_prefix_is_a_one_line_error(argv, says, capsys, tmp_path):
    from batchsim.scripts.cli import main

    try:
        rc = main(["size", *argv, "--out", str(tmp_path)])
    except SystemExit as exc:
        rc = int(exc.code)
    err = capsys.readouterr().err
    assert rc == 2 and says in err.strip().splitlines()[-1] and "Traceback" not in err
