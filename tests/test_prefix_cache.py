"""Prefix caching: chained block hashes, the scheduler's cache account, and reuse."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
from batchsim.scheduler.pool_geometry import PAGE_TOKENS
from batchsim.scheduler.prefix_cache import (
    chain_block_hashes,
    prompt_block_hashes,
    token_block_hashes,
)
from batchsim.scheduler.request import Request, SamplingParams


def test_block_hashes_are_chained_and_cover_full_blocks_only():
    a = list(range(3 * PAGE_TOKENS + 5))
    b = a[:PAGE_TOKENS] + [999] + a[PAGE_TOKENS + 1:]  # differs in block 1
    ha, hb = token_block_hashes(a), token_block_hashes(b)
    assert len(ha) == 3
    assert ha[0] == hb[0] and ha[1] != hb[1] and ha[2] != hb[2]  # a change reaches every child
    assert token_block_hashes(a[:PAGE_TOKENS - 1]) == ()
    # the same block after a different parent hashes differently
    assert chain_block_hashes([1, 2])[1] != chain_block_hashes([3, 2])[1]


def test_block_hashes_do_not_depend_on_the_process_hash_seed():
    code = ("from batchsim.scheduler.prefix_cache import chain_block_hashes as c; "
            "print(c([('system', 0), ('system', 1), (7, 8)]))")
    outs = {subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                           env={**os.environ, "PYTHONHASHSEED": seed}, check=True).stdout
            for seed in ("1", "2")}
    assert len(outs) == 1


def test_request_block_hashes_come_from_the_workload_or_the_tokens():
    greedy = SamplingParams(max_tokens=4)
    ids = list(range(2 * PAGE_TOKENS))
    assert prompt_block_hashes(Request(0, len(ids), greedy, 0.0, ids)) == token_block_hashes(ids)
    given = chain_block_hashes([("sys", 0)])
    assert prompt_block_hashes(Request(1, 40, greedy, 0.0, block_hashes=given)) == given
    assert prompt_block_hashes(Request(2, 40, greedy, 0.0)) == ()
    with pytest.raises(ValueError, match="block hashes cover more"):
        Request(3, PAGE_TOKENS, greedy, 0.0, block_hashes=chain_block_hashes([1, 2]))
