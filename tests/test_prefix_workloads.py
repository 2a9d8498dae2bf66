"""Workloads that share prefixes (workloads/prefixes.py): segments give the same tokens to the real
executor and the same blocks to the simulator; Mooncake's hash_ids survive a replay; bad sharing
settings are one-line errors."""

from __future__ import annotations

import dataclasses

import pytest
from batchsim.configs import ConfigError
from batchsim.scheduler.pool_geometry import PAGE_TOKENS
from batchsim.scheduler.prefix_cache import token_block_hashes
from batchsim.workloads.prefixes import (
    Segment,
    SharingSpec,
    block_keys,
    segment_block_hashes,
    segment_token_ids,
    session_turn,
    sharing_with,
    turn_index,
)
from batchsim.workloads.requests import (
    build_requests,
    request_block_hashes,
    request_token_ids,
    trace_requests,
)
from batchsim.workloads.spec import TraceSpec, WorkloadSpec, builtin_workload, workload_from_dict
from batchsim.workloads.traces import read_trace

from tests.cli_calls import cli_exit_code, last_json

VOCAB = 1000


def _shared_pattern(hash_lists) -> list[list[int]]:
    """Each hash renamed by first appearance: two hash lists that share the same blocks map to the
    same pattern whatever the hash values."""
    names: dict[int, int] = {}
    return [[names.setdefault(h, len(names)) for h in hashes] for hashes in hash_lists]


def test_same_segments_same_tokens_and_hashes():
    sys_seg, a, b = Segment((1, 0), 40), Segment((2, 0, 0, 0), 30), Segment((2, 0, 1, 0), 30)
    ids_a = segment_token_ids([sys_seg, a], VOCAB)
    ids_b = segment_token_ids([sys_seg, b], VOCAB)
    assert ids_a == segment_token_ids([sys_seg, a], VOCAB)  # deterministic
    assert ids_a[:40] == ids_b[:40] and ids_a[40:] != ids_b[40:]
    # A shorter segment of the same key is a prefix of the longer (Mooncake's partial blocks).
    assert segment_token_ids([Segment((1, 0), 7)], VOCAB) == ids_a[:7]
    ha, hb = segment_block_hashes([sys_seg, a]), segment_block_hashes([sys_seg, b])
    shared = 40 // PAGE_TOKENS  # blocks wholly inside the system prompt
    assert len(ha) == 70 // PAGE_TOKENS and ha[:shared] == hb[:shared]
    assert ha[shared] != hb[shared]  # the block straddling into the user text differs
    assert block_keys([Segment((9,), 20)], page_tokens=16) == [(((9,), 0, 16),)]


@pytest.mark.parametrize("workload, num_prompts", [("chat-sessions", 24), ("shared-prompt", 8),
                                                   ("mooncake", 60)])
def test_simulator_blocks_are_the_real_executors_blocks(workload, num_prompts):
    """The hashes the simulator gets from segments share exactly the blocks that hashing the real
    executor's token ids shares."""
    spec = dataclasses.replace(builtin_workload(workload), num_prompts=num_prompts)
    requests = build_requests(spec)
    by_tokens = [token_block_hashes(request_token_ids(spec.seed, rs, VOCAB)) for rs in requests]
    by_segments = [request_block_hashes(rs) for rs in requests]
    assert _shared_pattern(by_tokens) == _shared_pattern(by_segments)
    reused = sum(len(h) for h in by_segments) - len({x for h in by_segments for x in h})
    assert reused > 0  # these workloads do share blocks


def test_chat_turn_resends_the_earlier_turn_and_its_reply():
    sharing = SharingSpec(system_tokens=50, turns=3, sessions=2)
    spec = WorkloadSpec(num_prompts=12, sharing=sharing)
    requests = build_requests(spec)
    assert [session_turn(i, sharing) for i in range(6)] == [
        (0, 0), (1, 0), (0, 1), (1, 1), (0, 2), (1, 2)]
    assert all(turn_index(*session_turn(i, sharing), sharing) == i for i in range(12))
    first, second = requests[0], requests[2]  # session 0, turns 0 and 1
    ids1, ids2 = (request_token_ids(spec.seed, rs, VOCAB) for rs in (first, second))
    assert ids2[:first.prompt_len] == ids1
    reply = second.segments[2]
    assert reply.num_tokens == first.output_len  # the reply resent is as long as turn 0's output
    assert second.prompt_len == first.prompt_len + first.output_len + second.segments[3].num_tokens
    other = request_token_ids(spec.seed, requests[1], VOCAB)  # session 1 shares the system prompt
    assert other[:50] == ids1[:50] and other[50:60] != ids1[50:60]
    # Without sharing, the workload is exactly what it was (same lengths, no segments).
    plain = build_requests(dataclasses.replace(spec, sharing=None))
    assert all(not rs.segments for rs in plain)
    assert [rs.output_len for rs in plain] == [rs.output_len for rs in requests]


def test_mooncake_slice_keeps_hash_ids_through_a_replay():
    rows = read_trace("mooncake_conversation_slice.jsonl", limit=8)
    assert rows[0].hash_ids == tuple(range(14)) and rows[1].hash_ids[0] == 0
    trace = TraceSpec("mooncake_conversation_slice.jsonl")
    requests = trace_requests(trace, 8)
    assert [s.key[1] for s in requests[1].segments] == list(rows[1].hash_ids)
    assert sum(s.num_tokens for s in requests[1].segments) == requests[1].prompt_len == 7322
    h0, h1 = (request_block_hashes(rs) for rs in requests[:2])
    per_block = 512 // PAGE_TOKENS
    assert h0[:per_block] == h1[:per_block] and h0[per_block] != h1[per_block]
    # Scaled, the trace's blocks stay whole cache blocks: rows 0 and 1 still share block 0.
    scaled = trace_requests(dataclasses.replace(trace, input_scale=0.05), 2)
    assert scaled[0].segments[0].num_tokens == 2 * PAGE_TOKENS
    s0, s1 = (request_block_hashes(rs) for rs in scaled)
    assert s0[:2] == s1[:2] and s0[2] != s1[2]


def test_run_flags_build_the_sharing_and_the_trace_keeps_it(tmp_path):
    from batchsim.scripts import run_cmd
    from batchsim.scripts.cli import build_parser

    parser = build_parser()
    args = parser.parse_args(["run", "--shared-prefix-tokens", "300", "--turns", "3"])
    cfg = run_cmd.config_from_args(args)
    assert cfg.workload.sharing == SharingSpec(system_tokens=300, turns=3)
    off = run_cmd.config_from_args(parser.parse_args(
        ["run", "--workload", "shared-prompt", "--shared-prefix-tokens", "0"]))
    assert off.workload.sharing is None
    moon = run_cmd.config_from_args(parser.parse_args(
        ["run", "--trace", "mooncake_conversation_slice.jsonl", "--num-prompts", "3"]))
    assert all(rs.segments for rs in build_requests(moon.workload))
    assert sharing_with(None) is None


@pytest.mark.parametrize("argv, says", [
    (["run", "--turns", "0"], "--turns: expected a positive integer"),
    (["run", "--shared-prefix-tokens", "-1"], "--shared-prefix-tokens: expected an integer >= 0"),
    (["run", "--sessions", "x"], "--sessions: expected a positive integer"),
    (["run", "--trace", "mooncake_conversation_slice.jsonl", "--turns", "2"],
     "sharing: applies only to arrival"),
    (["run", "--workload", "chat", "--shared-prefix-tokens", "10"], "sharing: not with chat"),
    (["sweep", "--prompt-len", "64", "--shared-prefix-tokens", "64"],
     "--shared-prefix-tokens 64 must be under --prompt-len 64"),
])
def test_bad_sharing_flags_are_one_line_errors(argv, says, capsys, tmp_path):
    rc = cli_exit_code([*argv, "--executor", "fake", "--out", str(tmp_path)])
    err = capsys.readouterr().err
    assert rc == 2 and says in err.strip().splitlines()[-1] and "Traceback" not in err


@pytest.mark.parametrize("sharing, says", [
    ({"turns": 0}, "sharing.turns: must be an integer >= 1"),
    ({"system_tokens": 0}, "shares nothing"),
    ({"sessions": 2, "colour": 1}, "unknown key 'colour'"),
    ({"system_tokens": 1.5}, "system_tokens"),
])
def test_bad_sharing_yaml_names_the_file_and_key(sharing, says):
    with pytest.raises(ConfigError, match=says) as info:
        workload_from_dict({"sharing": sharing}, "w.yaml")
    assert str(info.value).startswith("w.yaml") and "\n" not in str(info.value)


def test_compare_prefix_cache_runs_the_workload_off_then_on(capsys, tmp_path):
    import json

    from batchsim.scripts.cli import main

    argv = ["compare", "--prefix-cache", "--executor", "sim", "--model", "llama-3.2-1b",
            "--device-profile", "M2 Ultra", "--num-prompts", "6", "--output-len", "4",
            "--out", str(tmp_path), "--runs-dir", str(tmp_path / "runs"), "--no-timeline",
            "--json"]
    assert main(argv) == 0
    res = last_json(capsys.readouterr().out)
    off, on = res["cache_off"], res["cache_on"]
    assert res["versus"] == "prefix-cache" and off["workload"] == "shared-prompt"
    assert off["max_num_seqs"] == on["max_num_seqs"] == res["batch"]
    assert off["total_input_tokens"] == on["total_input_tokens"]  # the same requests
    assert off["cached_prompt_tokens"] == 0 and off["prefix_cache_hit_rate"] == 0
    # The 1,024-token system prompt is prefilled once: the other 5 requests reuse its 64 blocks.
    assert on["cached_prompt_tokens"] == 5 * 1024
    assert on["prefilled_prompt_tokens"] == off["prefilled_prompt_tokens"] - 5 * 1024
    assert res["ratios"]["median_ttft_ms"] < 1
    (line,) = (tmp_path / "compare.jsonl").read_text().splitlines()
    assert json.loads(line)["cache_on"]["cached_prompt_tokens"] == 5 * 1024
    # --prefix-cache on|off keeps the batch-1 comparison, both runs with the cache as given.
    from batchsim.scripts import compare
    from batchsim.scripts.cli import build_parser

    sub = next(a for a in build_parser()._actions if a.dest == "command").choices["compare"]
    batch1, batched = compare.configs_from_args(sub.parse_args(["--prefix-cache", "off"]))
    assert (batch1.scheduler.max_num_seqs, batched.scheduler.prefix_cache) == (1, "off")
    assert batched.workload.name == "burst"
    off_cfg, on_cfg = compare.configs_from_args(sub.parse_args(["--prefix-cache", "--batch", "8"]))
    assert (off_cfg.scheduler.prefix_cache, on_cfg.scheduler.prefix_cache) == ("off", "on")
    assert off_cfg.scheduler.max_num_seqs == on_cfg.scheduler.max_num_seqs == 8
