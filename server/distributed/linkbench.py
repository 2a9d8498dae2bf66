"""Measure the link between ranks: all_sum latency and bandwidth vs message size, median of reps.
Run under mlx.launch, e.g. `mlx.launch --backend ring -n 2 -- python -m
batchsim.server.distributed.linkbench`; rank 0 prints one JSON line. On one machine this is
loopback TCP, not Thunderbolt: it measures the ring backend's per-message cost here."""

from __future__ import annotations

import json
import statistics
import sys
import time

import mlx.core as mx

SIZES_BYTES = (4, 256, 4 << 10, 64 << 10, 1 << 20, 16 << 20)


def measure(group, sizes_bytes=SIZES_BYTES, reps: int = 20) -> list[dict]:
    rows = []
    for size in sizes_bytes:
        x = mx.ones((max(1, size // 4),), dtype=mx.float32)
        mx.eval(x)
        times = []
        for _ in range(reps + 2):
            t0 = time.perf_counter()
            mx.eval(mx.distributed.all_sum(x, group=group))
            times.append(time.perf_counter() - t0)
        median_s = statistics.median(times[2:])
        # A ring all-reduce moves 2 (N-1)/N of the message over each link.
        moved = 2 * (group.size() - 1) / group.size() * x.nbytes
        rows.append({"message_bytes": x.nbytes, "all_sum_median_us": 1e6 * median_s,
                     "bus_gb_s": moved / median_s / 1e9})
    return rows


def main() -> int:
    group = mx.distributed.init(strict=True)
    reps = int(sys.argv[1]) if len(sys.argv) > 1 else 20
    rows = measure(group, reps=reps)
    if group.rank() == 0:
        print(json.dumps({"ranks": group.size(), "link": "loopback TCP (ring backend)",
                          "rows": rows}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
