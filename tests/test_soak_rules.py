"""benchmarks/soak_http.py's pass rules: the KV a server holds once every request is done."""

from __future__ import annotations

import importlib.util
from pathlib import Path

BENCH = Path(__file__).resolve().parents[1] / "benchmarks" / "soak_http.py"
BLOCK = 8192  # bytes of one of the tiny model's float32 blocks


def _soak():
    spec = importlib.util.spec_from_file_location("soak_http", BENCH)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    return bench


def test_a_paged_pool_may_keep_spare_blocks_beside_the_cache_a_padded_one_none():
    ok = _soak().kv_held_ok
    cache = 4092 * BLOCK
    # h6's paged soak (serve --kv-layout paged, 1,000 requests, 4117255): held 41,680,896 B at the
    # end, 996 spare blocks beside the cache's 4,092
    assert ok(cache + 996 * BLOCK, cache, 4092, "paged")
    assert not ok(cache + 996 * BLOCK, cache, 4092, "padded")
    assert ok(cache, cache, 4092, "padded") and ok(cache, cache, 4092, "paged")
    # more than twice block_slack (1,023 blocks) spare, or less than the cache: a leak or a loss
    assert not ok(cache + 2047 * BLOCK, cache, 4092, "paged")
    assert ok(cache + 2046 * BLOCK, cache, 4092, "paged")
    assert not ok(cache - BLOCK, cache, 4092, "paged")
    assert ok(0, 0, 0, "paged") and not ok(BLOCK, 0, 0, "paged")  # no cache: nothing held
