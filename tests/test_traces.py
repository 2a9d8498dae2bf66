"""Trace parsing: Azure CSV and Mooncake JSONL rows, the shipped slices, and bad files named for
what they are (moved from test_workloads.py)."""

from __future__ import annotations

import dataclasses
import itertools

import numpy as np
import pytest
from batchsim.configs import CONFIG_DIR, ConfigError
from batchsim.workloads.lengths import parse_length, trace_lengths
from batchsim.workloads.requests import trace_requests
from batchsim.workloads.spec import TraceSpec
from batchsim.workloads.traces import parse_azure_time, read_trace

TRACES = CONFIG_DIR / "traces"


# --- traces --------------------------------------------------------------------------------------

AZURE_CSV = """TIMESTAMP,ContextTokens,GeneratedTokens
2023-11-16 18:15:46.6805900,374,44
2023-11-16 18:15:50.9951690,396,109
2023-11-16 18:15:51.2224675,2000,5
2023-11-16 18:15:59.0000000,10,0
"""
MOONCAKE_JSONL = """{"timestamp": 1000, "input_length": 6758, "output_length": 500, "hash_ids": [0]}
{"timestamp": 1000, "input_length": 100, "output_length": 3}

{"timestamp": 4500, "input_length": 2290, "output_length": 316, "hash_ids": [2]}
"""


def test_azure_time_handles_seven_digit_fraction():
    a = parse_azure_time("2023-11-16 18:15:46.6805900")
    b = parse_azure_time("2023-11-16 18:15:50.9951699")
    assert b - a == pytest.approx(4.314579, abs=2e-6)


def test_read_azure_relative_times_start_limit(tmp_path):
    path = tmp_path / "t.csv"
    path.write_text(AZURE_CSV.replace("\n", "\r\n"))  # the real file has CRLF line ends
    rows = read_trace(path)
    assert [r.t_s for r in rows] == pytest.approx([0.0, 4.314579, 4.5418775, 12.31941], abs=1e-6)
    lengths = [(r.input_len, r.output_len) for r in rows]
    assert lengths == [(374, 44), (396, 109), (2000, 5), (10, 0)]
    part = read_trace(path, start=1, limit=2)
    assert [r.t_s for r in part] == pytest.approx([0.0, 0.2272985], abs=1e-6)
    assert [r.input_len for r in part] == [396, 2000]


def test_read_mooncake_ms_and_blank_lines(tmp_path):
    path = tmp_path / "t.jsonl"
    path.write_text(MOONCAKE_JSONL)
    rows = read_trace(path)
    assert [(r.t_s, r.input_len, r.output_len) for r in rows] == [
        (0.0, 6758, 500), (0.0, 100, 3), (3.5, 2290, 316)]


def test_trace_requests_scale_and_cap(tmp_path):
    path = tmp_path / "t.csv"
    path.write_text(AZURE_CSV)
    trace = TraceSpec(str(path), time_scale=0.5, input_scale=0.1, output_scale=2.0,
                      max_input_len=100, max_output_len=150)
    reqs = trace_requests(trace, 4)
    expected_s = [0.0, 2.1572895, 2.27093875, 6.159705]
    assert [r.arrival_s for r in reqs] == pytest.approx(expected_s, abs=1e-6)
    assert [r.prompt_len for r in reqs] == [37, 40, 100, 1]  # 2000*0.1 capped; 10*0.1 -> 1 (>= 1)
    assert [r.output_len for r in reqs] == [88, 150, 10, 1]  # 109*2 capped; 0 -> 1
    with pytest.raises(ConfigError, match="only 3 rows"):
        trace_requests(dataclasses.replace(trace, start=1), 4)


def test_trace_errors_name_the_file(tmp_path):
    bad = tmp_path / "bad.csv"
    bad.write_text("TIMESTAMP,Tokens\n2023-11-16 18:15:46.68,3\n")
    with pytest.raises(ConfigError, match="ContextTokens"):
        read_trace(bad)
    with pytest.raises(ConfigError, match="no such file.*shipped"):
        read_trace("missing.csv")
    for there, kind in (("/dev/null", "a character device"), (str(tmp_path), "a directory")):
        with pytest.raises(ConfigError, match=f"is {kind}, not a regular file"):
            read_trace(there)  # it exists: "no such file" said the wrong thing


@pytest.mark.parametrize("row, says", [
    ('{"timestamp": 0, "input_length": 1000000000000, "output_length": 8}',
     "token count must be an integer in \\[0, 2147483647\\]"),  # ran out of memory
    ('{"timestamp": 0, "input_length": -5, "output_length": 8}', "token count"),  # read as 1
    ('{"timestamp": 0, "input_length": true, "output_length": 8}', "token count"),
    ('{"timestamp": 1' + "0" * 400 + ', "input_length": 5, "output_length": 8}',
     "int too large"),  # an OverflowError traceback
    ("[" * 5000 + "]" * 5000, "nested too deeply"),  # a RecursionError traceback
    ('{"timestamp": 0, "input_length": 10.5, "output_length": 8}', "token count"),  # read as 10
    ('{"timestamp": "x", "input_length": 5, "output_length": 8}', "timestamp is a number"),
    ("[1, 2]", "a Mooncake row is a JSON object"),  # 'list indices must be integers ...'
])
def test_a_bad_mooncake_row_is_a_config_error_naming_its_line(tmp_path, row, says):
    path = tmp_path / "t.jsonl"
    path.write_text('{"timestamp": 0, "input_length": 5, "output_length": 8}\n' + row + "\n")
    with pytest.raises(ConfigError, match=f"t.jsonl:2: .*{says}"):
        read_trace(path)


@pytest.mark.parametrize("cells, got", [
    ("10", "None"),  # int(None) said "int() argument must be a string, ... NoneType"
    ("10.5,8", "'10.5'"),  # CSV cells are strings: "invalid literal for int() with base 10"
    ("10,", "''"),
    ("abc,8", "'abc'"),
])
def test_a_bad_azure_token_count_names_its_row(tmp_path, cells, got):
    path = tmp_path / "t.csv"
    path.write_text(f"TIMESTAMP,ContextTokens,GeneratedTokens\n2023-11-16 18:15:46,{cells}\n")
    with pytest.raises(ConfigError, match=f"t.csv:2: a token count .* got {got}$"):
        read_trace(path)


def test_shipped_slices_parse_with_documented_rows():
    azure = read_trace("azure_conv_2023_slice.csv")
    moon = read_trace("mooncake_conversation_slice.jsonl")
    assert len(azure) == 2000 and len(moon) == 2000
    for rows, span_s in ((azure, 424.3), (moon, 669.0)):
        assert rows[0].t_s == 0.0 and rows[-1].t_s == pytest.approx(span_s, abs=0.5)
        assert all(b.t_s >= a.t_s for a, b in itertools.pairwise(rows))
    assert 900 < float(np.median([r.input_len for r in azure])) < 1200
    assert 6000 < float(np.median([r.input_len for r in moon])) < 10000
    total_bytes = sum(p.stat().st_size for p in TRACES.iterdir())
    assert total_bytes < 1_000_000
    assert (TRACES / "SOURCES.md").exists() and (TRACES / "LICENSE.AzurePublicDataset.txt").exists()


def test_trace_lengths_empirical_and_parse_length():
    spec = trace_lengths("azure_conv_2023_slice.csv", "output", limit=100, max_len=200)
    assert spec.dist == "empirical" and len(spec.values) == 100 and spec.upper <= 200
    draws = spec.sample(500, np.random.default_rng(0))
    assert set(draws.tolist()) <= set(spec.values)
    via_cli = parse_length("trace:mooncake_conversation_slice.jsonl:input:1024")
    assert via_cli.upper == 1024 and len(via_cli.values) == 2000


@pytest.mark.parametrize("name", ["t.jsonl", "t"])  # read as Mooncake, or sniffed
def test_a_binary_trace_names_its_file(tmp_path, name):
    path = tmp_path / name  # was "'utf-8' codec can't decode byte 0xff ...", no file named
    path.write_bytes(b"\xff\xfe\x00garbage\n")
    with pytest.raises(ConfigError, match=f"{name}: not UTF-8 text"):
        read_trace(path)


@pytest.mark.parametrize("encoding, says", [
    ("utf-16", "not UTF-8 text (byte 0: invalid start byte; it is UTF-16: save it as UTF-8)"),
    ("utf-16-le", r"(found: 'T\x00I\x00M"),  # said "found: TIMESTAMP" (the NULs unseen)
    ("utf-32", "; it is UTF-32: save it as UTF-8)"),  # r3: FF FE 00 00 was named UTF-16
])
def test_a_utf16_trace_is_named_for_what_it_is(tmp_path, encoding, says):
    """h8: Excel's 'Unicode Text' and PowerShell write UTF-16; the trace without a byte order
    mark was refused as 'missing column TIMESTAMP (found: TIMESTAMP, ...)'."""
    path = tmp_path / "t.csv"
    path.write_bytes("TIMESTAMP,ContextTokens,GeneratedTokens\n2023-11-16 18:15:46.68,30,3\n"
                     .encode(encoding))
    with pytest.raises(ConfigError) as exc:
        read_trace(path)
    assert says in str(exc.value)
