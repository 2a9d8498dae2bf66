"""`report` on corrupted and damaged run directories: warnings, never a traceback, and a finished
run's summary given back exactly (moved from test_inputs.py)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.cli_calls import _main, last_json
from tests.sim_records import copy_run, finished_sim_run


# -- report on corrupted run directories -----------------------------------------------------
@pytest.fixture(scope="module")
def finished_run(tmp_path_factory) -> Path:
    return finished_sim_run(tmp_path_factory.mktemp("runs"))


_STEP_FIELD = {"int past a float": ("kv_bytes", "9" * 400), "int past int64": ("kv_bytes", 10**20),
               "count a float": ("batch_size", 96.7)}  # 96.7 was cut to 96, unnoted


def _corrupt(run_dir: Path, how: str) -> None:
    requests = run_dir / "requests.jsonl"
    lines = requests.read_bytes().splitlines(keepends=True)
    if how == "nan arrival":
        row = json.loads(lines[3])
        lines[3] = json.dumps({**row, "arrival_s": float("nan")}).encode() + b"\n"
    elif how == "nested line":
        lines.insert(2, b"[" * 100_000 + b"]" * 100_000 + b"\n")
    elif how == "truncated lines":
        lines[4] = lines[4][:30] + b"\n"
        lines[-1] = lines[-1][:25]
    elif how in ("arrival at -1e308", "token before arrival"):  # numpy overflowed, said on stderr
        row = json.loads(lines[3])
        arrival = -1e308 if how == "arrival at -1e308" else row["token_times_s"][0] + 1
        lines[3] = json.dumps({**row, "arrival_s": arrival}).encode() + b"\n"
    elif how == "finished at 1e308":  # the fuzz test's input 132: np.std's square overflowed
        row = json.loads(lines[3])
        lines[3] = json.dumps({**row, "finished_s": 1e308}).encode() + b"\n"
    elif how.startswith("summary"):
        text = "[1, 2]" if how == "summary a list" else (run_dir / "summary.json").read_text()[:50]
        (run_dir / "summary.json").write_text(text)
    elif how == "duplicates":
        lines += lines[:3]
    elif how == "binary config":
        (run_dir / "config.yaml").write_bytes(bytes(range(256)) * 4)
    elif how == "invalid config":
        (run_dir / "config.yaml").write_text("config: [unclosed\n  resolved: {")
    elif how in _STEP_FIELD:  # past a float: was an OverflowError in the finite-number check
        key, value = _STEP_FIELD[how]  # past int64: the summary's arrays overflowed (traceback)
        steps = (run_dir / "steps.jsonl").read_text().splitlines(keepends=True)
        steps[0] = steps[0].replace(f'"{key}":', f'"{key}":{value},"was":')
        (run_dir / "steps.jsonl").write_text("".join(steps))
    requests.write_bytes(b"".join(lines))


@pytest.mark.parametrize("how, completed, says", [
    ("nan arrival", 11, "requests.jsonl: skipped 1 line(s) that are not JSON records (line 4)"),
    ("nested line", 12, "requests.jsonl: skipped 1 line(s) that are not JSON records (line 3)"),
    ("truncated lines", 10, "skipped a torn last line"),
    ("duplicates", 12, "requests.jsonl: 3 duplicated request record(s) counted once"),
    ("summary a list", 12, "summary.json: not a JSON object; marked interrupted"),  # said "no
    ("summary cut short", 12, "summary.json: not a JSON object; marked interrupted"),  # summary"
    ("binary config", 12, "config.yaml: not a run's config"),
    ("invalid config", 12, "config.yaml: not a run's config"),
    ("int past a float", 12, "steps.jsonl: skipped 1 record(s) with missing or impossible"),
    ("int past int64", 12, "steps.jsonl: skipped 1 record(s) with missing or impossible"),
    ("count a float", 12, "steps.jsonl: skipped 1 record(s) with missing or impossible"),
    ("arrival at -1e308", 11, "requests.jsonl: skipped 1 record(s) with missing or impossible"),
    ("finished at 1e308", 11, "requests.jsonl: skipped 1 record(s) with missing or impossible"),
    ("token before arrival", 11, "requests.jsonl: skipped 1 record(s) with missing or imposs"),
])
def test_report_reads_a_corrupted_run_directory_with_warnings(finished_run, tmp_path, capsys,
                                                              how, completed, says):
    run_dir = copy_run(finished_run, tmp_path)
    _corrupt(run_dir, how)
    rc, out, err = _main(["report", str(run_dir), "--json"], capsys)
    assert rc == 0 and "Traceback" not in err and "Warning" not in err, err
    assert says in err, err
    assert last_json(out)["completed"] == completed


def _damage(run_dir: Path, rng) -> None:
    """One random corruption: bytes flipped, a file cut short, or a field given an odd value."""
    f = run_dir / rng.choice(["requests.jsonl", "steps.jsonl", "config.yaml", "summary.json"])
    data, how = f.read_bytes(), rng.randrange(3)
    if how == 0:
        flipped = bytearray(data)
        for _ in range(rng.randrange(1, 5)):
            flipped[rng.randrange(len(flipped))] = rng.randrange(256)
        data = bytes(flipped)
    elif how == 1:
        data = data[: rng.randrange(len(data) + 1)]
    elif f.suffix in (".jsonl", ".json"):
        lines = data.splitlines() if f.suffix == ".jsonl" else [data]
        k = rng.randrange(len(lines))
        row = json.loads(lines[k])
        row[rng.choice(list(row))] = rng.choice([None, "x", -1, 1e308, [], {}, [[[]]], True, 2**70])
        lines[k] = json.dumps(row).encode()
        data = b"\n".join(lines) + b"\n"
    f.write_bytes(data)


@pytest.mark.filterwarnings("error::RuntimeWarning")  # numpy's overflow: an input not handled
def test_report_never_raises_on_randomly_damaged_run_directories(finished_run, tmp_path):
    import random
    import shutil

    from batchsim.configs import ConfigError
    from batchsim.server.results.rebuild import rebuild_summary

    rng, raised = random.Random(37), []
    for i in range(300):
        run_dir = Path(shutil.copytree(finished_run, tmp_path / str(i)))
        _damage(run_dir, rng)
        try:
            rebuild_summary(run_dir, timeline=i % 10 == 0)  # drawing: ~0.6 s, every tenth
        except ConfigError:
            pass  # a one-line error (e.g. both record files unreadable) is an answer too
        except Exception as exc:  # noqa: BLE001 - what the test is for
            raised.append(f"{i}: {type(exc).__name__}: {exc}")
        shutil.rmtree(run_dir)
    assert not raised, raised[:5]


def test_report_on_a_finished_run_gives_its_summary_back_exactly(finished_run, tmp_path, capsys):
    run_dir = copy_run(finished_run, tmp_path)
    summary = json.loads((run_dir / "summary.json").read_text())
    summary["peak_rss_bytes"] = 123_456_789  # as a real run records it (the records cannot)
    (run_dir / "summary.json").write_text(json.dumps(summary, indent=1))
    rc, out, _ = _main(["report", str(run_dir), "--json"], capsys)
    assert rc == 0 and last_json(out) == summary
    assert json.loads((run_dir / "summary.json").read_text()) == summary



@pytest.mark.parametrize("damaged", ["x", [1], {"a": 1}, 10**20, float("nan"), -5])
def test_report_prints_a_summary_whose_peak_memory_bytes_is_damaged(finished_run, tmp_path,
                                                                    capsys, damaged):
    # 'x', a list, a dict and 10**20 were TypeError/OverflowError tracebacks in report's table;
    # NaN and -5 were carried into the rebuilt summary beside the run's peak_memory (GB).
    run_dir = copy_run(finished_run, tmp_path)
    summary = json.loads((run_dir / "summary.json").read_text())
    (run_dir / "summary.json").write_text(json.dumps({**summary, "peak_memory_bytes": damaged}))
    rc, out, err = _main(["report", str(run_dir), "--json"], capsys)
    assert rc == 0 and "Traceback" not in err, err
    rebuilt = last_json(out)
    assert rebuilt["peak_memory_bytes"] == summary["peak_memory_bytes"]  # from its GB


def test_report_redraws_a_timeline_whose_names_were_damaged(finished_run, tmp_path):
    """A summary's dtype or a config's names that are not strings (a bad edit, a flipped byte)
    give a timeline with those names left out, not a TypeError (seed 37's case 190)."""
    import yaml
    from batchsim.server.results.rebuild import rebuild_summary

    run_dir = copy_run(finished_run, tmp_path)
    summary = json.loads((run_dir / "summary.json").read_text())
    summary["dtype"] = -1
    (run_dir / "summary.json").write_text(json.dumps(summary))
    config = yaml.safe_load((run_dir / "config.yaml").read_text())
    config["config"].update(quantize=[[[]]], executor=1, device_profile=2**70, model=True)
    (run_dir / "config.yaml").write_text(yaml.safe_dump(config))
    rebuilt, _ = rebuild_summary(run_dir, timeline=True)
    assert rebuilt["timeline_png"] and (run_dir / "timeline.png").stat().st_size > 0
