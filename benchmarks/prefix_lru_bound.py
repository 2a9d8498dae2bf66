"""The prefix hit rate an ideal LRU block cache of a given size would reach on a workload's
requests in arrival order: each request reuses its leading blocks already cached, then caches all
of its blocks (no running requests competing for the bytes, no queueing). Cached tokens / prompt
tokens, as a run's prefix_cache_hit_rate: an upper bound to compare it with.

    python benchmarks/prefix_lru_bound.py --workload mooncake --num-prompts 2000
    python benchmarks/prefix_lru_bound.py --workload chat-sessions --num-prompts 512 --turns 8 \
        --sessions 16
    python benchmarks/prefix_lru_bound.py --trace mooncake_conversation_slice.jsonl \
        --num-prompts 2000 --max-input-len 32768 --cache-tokens 1000000,4000000,0

The last stdout line is one JSON document.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
from collections import OrderedDict

from batchsim.scheduler.pool_geometry import PAGE_TOKENS
from batchsim.workloads.prefixes import sharing_with
from batchsim.workloads.requests import RequestSpec, build_requests, request_block_hashes
from batchsim.workloads.spec import TraceSpec, WorkloadSpec, resolve_workload, with_overrides


def lru_hit_rate(requests: list[RequestSpec], cache_blocks: int | None) -> float:
    """Cached prompt tokens / prompt tokens, for an LRU cache of cache_blocks (None: unbounded)."""
    cache: OrderedDict[int, None] = OrderedDict()
    hit_blocks = 0
    for rs in requests:
        hashes = request_block_hashes(rs) or ()
        k = 0
        while k < len(hashes) and hashes[k] in cache:
            k += 1
        hit_blocks += k
        for h in hashes:
            cache[h] = None
            cache.move_to_end(h)
        while cache_blocks is not None and len(cache) > cache_blocks:
            cache.popitem(last=False)
    return hit_blocks * PAGE_TOKENS / sum(rs.prompt_len for rs in requests)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--workload", default="chat-sessions")
    p.add_argument("--trace", help="replay this trace instead (configs/traces or a path)")
    p.add_argument("--num-prompts", type=int)
    p.add_argument("--max-input-len", type=int)
    p.add_argument("--shared-prefix-tokens", type=int)
    p.add_argument("--turns", type=int)
    p.add_argument("--sessions", type=int)
    p.add_argument("--cache-tokens", default="1000000,0",
                   help="cache sizes in tokens, comma-separated (0: unbounded)")
    args = p.parse_args()
    if args.trace:
        spec = WorkloadSpec(name="trace", arrival="trace",
                            trace=TraceSpec(args.trace, max_input_len=args.max_input_len))
    else:
        spec = resolve_workload(args.workload)
        if args.max_input_len:
            trace = dataclasses.replace(spec.trace, max_input_len=args.max_input_len)
            spec = with_overrides(spec, trace=trace)
        sharing = sharing_with(spec.sharing, system_tokens=args.shared_prefix_tokens,
                               turns=args.turns, sessions=args.sessions)
        spec = dataclasses.replace(spec, sharing=sharing)
    requests = build_requests(with_overrides(spec, num_prompts=args.num_prompts))
    rows = {}
    for tokens in (int(t) for t in args.cache_tokens.split(",")):
        rate = lru_hit_rate(requests, tokens // PAGE_TOKENS if tokens else None)
        rows[str(tokens) if tokens else "unbounded"] = round(rate, 4)
        print(f"cache {tokens or 'unbounded'} tokens: hit rate {rate:.3f}")
    print(json.dumps({"workload": spec.name, "num_prompts": len(requests),
                      "trace": spec.trace.path if spec.trace else None,
                      "max_input_len": spec.trace.max_input_len if spec.trace else None,
                      "hit_rate_by_cache_tokens": rows}))


if __name__ == "__main__":
    main()
