"""server.results.metrics against values worked out by hand on the small fixed schedule in
tests/metrics_schedule.py (its docstring draws it)."""

from __future__ import annotations

import json
import math
import warnings

import pytest
from batchsim.configs import ConfigError
from batchsim.scripts.report import summary_table
from batchsim.server.results import request_arrays
from batchsim.server.results.metrics import parse_goodput, percentile_label, summarize
from batchsim.server.results.records import RequestRecord, StepRecord
from rich.console import Console

from tests.metrics_schedule import REQUESTS, STEPS, req, step

approx = pytest.approx


@pytest.fixture(scope="module")
def summary() -> dict:
    return summarize(REQUESTS, STEPS, duration_s=3.0, weight_bytes=10**9)


def test_per_request_derivations():
    r0, r1, r2 = REQUESTS[:3]
    assert r0.ttft_s == 0.5 and r0.e2el_s == 1.75 and r0.queue_s == 0.25
    # TPOT uses E2EL, not the last token: (1.75 - 0.5) / 3, while R0's mean ITL is 1.0 / 3.
    assert r0.tpot_s == approx(1.25 / 3)
    assert r0.itls_s == (0.25, 0.25, 0.5)
    assert r1.tpot_s is None and r1.itls_s == ()  # 1 output token: TTFT and E2EL only
    assert r1.ttft_s == 0.75 and r1.e2el_s == 0.75
    assert r2.tpot_s == approx((2.5 - 0.5) / 4)
    assert r2.itls_s == approx((0.5, 1.0, 0.25, 0.25))  # the 1.0 s gap is the preemption
    assert REQUESTS[3].ttft_s is None and REQUESTS[3].queue_s is None


def test_counts_and_throughputs(summary):
    s = summary
    assert (s["completed"], s["failed"], s["num_rejected"], s["num_aborted"], s["num_unfinished"]) \
        == (3, 2, 1, 1, 0)
    assert s["total_input_tokens"] == 8 + 4 + 6  # R3 and R4 left out
    assert s["total_output_tokens"] == 4 + 1 + 5  # R4's token left out
    assert s["request_throughput"] == approx(3 / 3.0)
    assert s["output_throughput"] == approx(10 / 3.0)
    assert s["total_token_throughput"] == approx(28 / 3.0)
    assert s["request_goodput"] is None and s["duration"] == 3.0


def test_ttft(summary):
    # [0.5, 0.75, 0.5] -> sorted [0.5, 0.5, 0.75]; mean 7/12; population std sqrt(2)/12.
    # np.percentile (linear): rank p/100 * (n-1); p99 -> 1.98 -> 0.5 + 0.98 * 0.25 = 0.745.
    s = summary
    assert s["mean_ttft_ms"] == approx(1000 * 7 / 12)
    assert s["median_ttft_ms"] == approx(500)
    assert s["std_ttft_ms"] == approx(1000 * math.sqrt(2) / 12)
    assert s["p50_ttft_ms"] == approx(500)
    assert s["p90_ttft_ms"] == approx(700)  # rank 1.8 -> 0.5 + 0.8 * 0.25
    assert s["p99_ttft_ms"] == approx(745)


def test_tpot_skips_one_token_requests(summary):
    # [1.25/3, 0.5] (R1 has none): mean 0.458333; std = half the spread 0.041667;
    # p99: rank 0.99 -> 1.25/3 + 0.99 * (0.5 - 1.25/3) = 0.499167.
    s = summary
    assert s["mean_tpot_ms"] == approx(1000 * (1.25 / 3 + 0.5) / 2)
    assert s["median_tpot_ms"] == approx(1000 * (1.25 / 3 + 0.5) / 2)
    assert s["std_tpot_ms"] == approx(1000 * (0.5 - 1.25 / 3) / 2)
    assert s["p99_tpot_ms"] == approx(1000 * (1.25 / 3 + 0.99 * (0.5 - 1.25 / 3)))


def test_itl_is_pooled_over_requests(summary):
    # R0 [0.25, 0.25, 0.5] + R2 [0.5, 1.0, 0.25, 0.25] -> sorted [.25 .25 .25 .25 .5 .5 1.0]:
    # mean 3/7; median 0.25; E[x^2] = 1.75/7 = 0.25 so std = sqrt(0.25 - 9/49);
    # p90: rank 5.4 -> 0.5 + 0.4 * 0.5 = 0.7; p99: rank 5.94 -> 0.5 + 0.94 * 0.5 = 0.97.
    # (A mean of per-request mean ITLs would give (1/3 + 0.5) / 2 = 0.4167 instead.)
    s = summary
    assert s["mean_itl_ms"] == approx(1000 * 3 / 7)
    assert s["median_itl_ms"] == approx(250)
    assert s["std_itl_ms"] == approx(1000 * math.sqrt(0.25 - 9 / 49))
    assert s["p90_itl_ms"] == approx(700)
    assert s["p99_itl_ms"] == approx(970)


def test_e2el_and_queue(summary):
    # E2EL [1.75, 0.75, 2.5]: mean 5/3, median 1.75, p99 rank 1.98 -> 1.75 + 0.98 * 0.75 = 2.485.
    # Queue [0.25, 0.5, 0.0]: mean 0.25, p99 rank 1.98 -> 0.25 + 0.98 * 0.25 = 0.495.
    s = summary
    assert s["mean_e2el_ms"] == approx(1000 * 5 / 3)
    assert s["median_e2el_ms"] == approx(1750)
    assert s["p99_e2el_ms"] == approx(2485)
    assert s["mean_queue_ms"] == approx(250)
    assert s["p99_queue_ms"] == approx(495)


@pytest.mark.parametrize("slo, num_good", [
    ({"ttft": 600}, 2),  # R1 (750 ms) misses
    ({"ttft": 500}, 2),  # R0 and R2 sit exactly on the SLO: met (vLLM: value <= SLO)
    ({"tpot": 450}, 2),  # R2 (500 ms) misses; R1 has TPOT 0 for goodput
    ({"ttft": 600, "tpot": 450}, 1),  # every SLO must hold: only R0
    ({"e2el": 2000}, 2),  # R2 (2500 ms) misses
    ({"e2el": 100}, 0),
])
def test_goodput(slo, num_good):
    s = summarize(REQUESTS, STEPS, duration_s=3.0, goodput_slo_ms=slo)
    assert s["request_goodput"] == approx(num_good / 3.0)
    assert s["goodput_slo_ms"] == {k: float(v) for k, v in slo.items()}


def test_peaks_over_one_second_buckets(summary):
    # Buckets from t0 = 0 (R0's arrival), ceil(3.0) + 1 = 4 of them. Completed tokens per bucket:
    # [0,1): 0.5 0.75 | [1,2): R0 1.0 1.5, R1 1.0, R2 1.0 1.5 | [2,3): 2.5 2.75 | [3,4): 3.0
    # -> [2, 5, 2, 1]. Active: R0 buckets 0-1, R1 0-1, R2 0-3 -> [3, 3, 1, 1].
    # The aborted R4 (token 1.5, active 0-1) would make these 6 and 4.
    assert summary["max_output_tokens_per_s"] == 5.0
    assert summary["max_concurrent_requests"] == 3


def test_batch_view(summary):
    s = summary
    # Decode records S1 (1), S2 (1), S3 (2), S6 (1 x 2 steps): 6 sequences / 5 passes.
    assert s["mean_batch_size"] == approx(6 / 5)
    assert s["max_batch_size"] == 2
    assert s["num_engine_steps"] == 8
    assert s["peak_kv_bytes"] == 2600 and s["peak_kv_bytes_measured"] == 2700
    assert s["num_preemptions"] == 1 == sum(r.num_preemptions for r in REQUESTS)
    # Prefill 8+4+6+5+4+4 = 31 tokens (R2's 8 recomputed included) over S0-S5 = 2.25 s.
    assert s["prompt_tokens"] == 31
    assert s["prompt_tps"] == approx(31 / 2.25)
    # 11 tokens emitted (R4's included); S4 neither decodes nor samples (its span (1.5, 2.25]
    # excludes 1.5), so generation time is 2.75 - 0.75 = 2.0 s.
    assert s["generation_tokens"] == 11
    assert s["generation_tps"] == approx(11 / 2.0)
    assert s["peak_memory"] == approx((10**9 + 2600) / 1e9)
    assert s["peak_memory_source"] == "weights+kv"


def test_peak_memory_sources():
    measured = summarize(REQUESTS, STEPS, duration_s=3.0, weight_bytes=10**9,
                         peak_memory_bytes=2_500_000_000, kv_budget_bytes=4096)
    assert measured["peak_memory"] == 2.5 and measured["peak_memory_source"] == "measured"
    assert measured["peak_memory_bytes"] == 2_500_000_000  # bytes, as every other *_bytes
    assert measured["kv_budget_bytes"] == 4096 and measured["weight_bytes"] == 10**9
    unknown = summarize(REQUESTS, STEPS, duration_s=3.0)
    assert unknown["peak_memory"] is None and unknown["peak_memory_source"] is None


def test_running_peak_kv_sets_held_and_estimated_peak():
    # The steps' KV peaks at 2600 bytes; a scheduler's running peak above it is every byte held
    # and the estimate's KV, one below it (a paged pool's view) leaves the steps' held bytes.
    above = summarize(REQUESTS, STEPS, duration_s=3.0, weight_bytes=10**9,
                      running_peak_kv_bytes=4000)
    assert above["peak_kv_bytes"] == above["peak_kv_held_bytes"] == 4000
    assert above["peak_memory_bytes"] == 10**9 + 4000 and above["peak_memory"] == approx(1.000004)
    below = summarize(REQUESTS, STEPS, duration_s=3.0, weight_bytes=10**9,
                      running_peak_kv_bytes=1000)
    assert (below["peak_kv_bytes"], below["peak_kv_held_bytes"]) == (1000, 2600)
    assert below["peak_memory_bytes"] == 10**9 + 2600


def test_percentile_key_naming():
    s = summarize(REQUESTS, STEPS, duration_s=3.0, percentiles=(25, 99.9, 99.0))
    assert percentile_label(99.9) == "99.9" and percentile_label(99.0) == "99"
    # p99.9: rank 1.998 -> 0.5 + 0.998 * 0.25 = 0.7495
    assert s["p99.9_ttft_ms"] == approx(749.5)
    assert s["p25_itl_ms"] == approx(250)
    assert "p50_ttft_ms" not in s and "p99.0_ttft_ms" not in s
    assert s["p99_e2el_ms"] == approx(2485)


def test_p99_queue_always_present():
    s = summarize(REQUESTS, STEPS, duration_s=3.0, percentiles=(50,))
    assert s["p99_queue_ms"] == approx(495) and "p99_ttft_ms" not in s


def test_empty_and_zero_duration():
    s = summarize([], [], duration_s=0.0)
    assert s["completed"] == 0 and s["request_throughput"] == 0.0
    assert s["mean_ttft_ms"] == 0.0 and s["p99_itl_ms"] == 0.0 and s["std_e2el_ms"] == 0.0
    assert s["max_output_tokens_per_s"] == 0.0 and s["max_concurrent_requests"] == 0
    assert s["mean_batch_size"] == 0.0 and s["prompt_tps"] == 0.0 and s["generation_tps"] == 0.0
    only_failed = summarize(REQUESTS[3:], [], duration_s=2.0, goodput_slo_ms={"ttft": 1})
    assert only_failed["completed"] == 0 and only_failed["failed"] == 2
    assert only_failed["request_goodput"] == 0.0 and only_failed["mean_tpot_ms"] == 0.0
    assert only_failed["num_preemptions"] == 0 and only_failed["generation_tokens"] == 1
    no_time = summarize(REQUESTS, STEPS, duration_s=0.0)
    assert no_time["output_throughput"] == 0.0 and no_time["mean_ttft_ms"] == approx(1000 * 7 / 12)


def test_parse_goodput():
    assert parse_goodput(["ttft:500", "tpot:50"]) == {"ttft": 500.0, "tpot": 50.0}
    assert parse_goodput("e2el:1e3,ttft:0") == {"e2el": 1000.0, "ttft": 0.0}
    for bad in ("foo:1", "ttft", "ttft:abc", "ttft:-1", "tpot:nan"):
        with pytest.raises(ConfigError, match="ttft, tpot, e2el") as exc:
            parse_goodput([bad])
        assert repr(bad) in str(exc.value)
    with pytest.raises(ConfigError, match="twice"):
        parse_goodput(["ttft:1", "ttft:2"])
    with pytest.raises(ConfigError, match="ttft, tpot, e2el"):
        summarize(REQUESTS, STEPS, duration_s=1.0, goodput_slo_ms={"latency": 5})


def test_records_validate_and_round_trip():
    with pytest.raises(ValueError, match="status"):
        req(9, "done", 0.0, 0.0, [1.0], 1.0, 1)
    with pytest.raises(ValueError, match="token times"):
        RequestRecord(9, "finished", 0.0, 0.0, (1.0,), 1.0, 1, 2)
    with pytest.raises(ValueError, match="num_steps"):
        step(9, 0.0, 1.0, 0, 1, 0, 0, 0)
    row = json.loads(json.dumps(REQUESTS[0].to_json()))
    assert row["ttft_ms"] == 500 and row["tpot_ms"] == approx(1250 / 3)
    assert "itls_ms" not in row and row["token_times_s"] == [0.5, 0.75, 1.0, 1.5]
    assert RequestRecord.from_json(row) == REQUESTS[0]
    assert RequestRecord.from_json(REQUESTS[3].to_json()).tpot_s is None
    assert StepRecord.from_json(json.loads(json.dumps(STEPS[6].to_json()))) == STEPS[6]
    with pytest.raises(ValueError, match="kv_bytes"):
        StepRecord.from_json({k: v for k, v in STEPS[0].to_json().items() if k != "kv_bytes"})


def test_e2el_falls_back_to_last_token():
    r = req(9, "finished", 1.0, 1.0, [1.5, 2.0], None, 3)
    assert r.e2el_s == 1.0 and r.tpot_s == 0.5


def test_summary_table_shows_values(summary):
    console = Console(width=120, record=True)
    console.print(summary_table(summary))
    text = console.export_text()
    assert "Successful requests" in text and "(1 rejected, 1 aborted, 0 unfinished)" in text
    assert "P99 TTFT (ms)" in text and "745" in text and "583" in text  # p99 and mean TTFT
    assert "P99 ITL (ms)" in text and "970" in text
    assert "Peak memory (GiB, weights+kv)" in text


@pytest.mark.parametrize("summary", [
    {"peak_memory_bytes": 3 * 2**30, "peak_memory_source": "measured"},
    {"peak_memory": 3 * 2**30 / 1e9, "peak_memory_source": "measured"},  # before _bytes: in GB
])
def test_summary_table_shows_peak_memory_from_bytes_or_an_older_summarys_gb(summary):
    console = Console(width=120, record=True)
    console.print(summary_table(summary))
    (row,) = [x for x in console.export_text().splitlines() if "Peak memory" in x]
    assert "(GiB, measured)" in row and row.split()[-2] == "3.00", row


def test_peaks_count_a_request_past_int64_seconds():
    """A trace row 1e20 s after the first (past int64's 9.2e18): its bucket was an invalid cast
    (a RuntimeWarning, the bucket dropped) and its 3 tokens in one second went uncounted."""
    far = [req(0, "finished", 0.0, 0.0, [0.5], 0.5, 4),
           req(1, "finished", 1e20, 1e20, [1e20] * 3, 1e20, 4)]
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        s = summarize(far, [], duration_s=1e20)
    assert s["max_output_tokens_per_s"] == 3.0


def test_unfinished_requests_without_tokens_reuse_every_tokens_counts(monkeypatch):
    """A rejected request owns no tokens: the finished requests' tokens are every token, sorted
    and counted once (review r4 item 4: twice, with two masked copies), same summary."""
    calls = []
    counts = request_arrays.sorted_counts
    monkeypatch.setattr(request_arrays, "sorted_counts", lambda *a: calls.append(1) or counts(*a))
    kept = [r for r in REQUESTS if r.status != "aborted"]  # rejected: no tokens
    summary = summarize(kept, STEPS, duration_s=3.0)
    assert len(calls) == 1 and summary["num_rejected"] == 1 and summary["completed"] == 3
