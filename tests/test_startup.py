"""What `batchsim run --executor sim` loads around its loop: its own command's modules only, no
matplotlib (timeline.png is drawn by a child process while the run runs), and none of UNUSED."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tests.cli_calls import last_json

# Modules a simulated run does without (each costs its import on every run): the summary's versions
# come from dist-info names, its percentiles from request_arrays.order_stats (np.percentile's
# np.unique imports numpy.ma).
UNUSED = ("importlib.metadata", "email", "numpy.ma")

PROBE = """
import json, sys
from batchsim.scripts import cli
rc = cli.main(["run", "--executor", "sim", "--device-profile", "M2 Max", "--model", "llama-3.2-1b",
               "--num-prompts", "3", "--out", sys.argv[1], "--no-progress", "--json",
               *json.loads(sys.argv[2])])
print(json.dumps([rc, sorted(m for m in sys.modules if m.startswith("batchsim.scripts.")),
                  "matplotlib" in sys.modules, sorted(set(sys.argv[3:]) & set(sys.modules))]))
"""


# r4: percentiles without 99 took p99_queue_ms from np.percentile, which imported numpy.ma
@pytest.mark.parametrize("extra", [[], ["--percentiles", "50,90"]])
def test_a_simulated_run_imports_its_command_alone_and_no_matplotlib(tmp_path, extra):
    done = subprocess.run([sys.executable, "-c", PROBE, str(tmp_path), json.dumps(extra), *UNUSED],
                          capture_output=True, text=True, timeout=120, check=True)
    rc, commands, matplotlib, unused = last_json(done.stdout)
    summary = json.loads(done.stdout.splitlines()[-2])
    assert rc == 0 and summary["completed"] == 3
    assert summary["timeline_png"].endswith("timeline.png")  # drawn, by the child
    others = [f"batchsim.scripts.{m}" for m in ("size", "sweep", "compare", "serve_cmd",
                                                "validate", "calibrate", "report_cmd")]
    assert "batchsim.scripts.run_cmd" in commands and not set(others) & set(commands)
    assert not matplotlib
    assert unused == []
    assert summary["env"]["mlx"] and summary["env"]["mlx_lm"]  # found without them


def test_a_run_evaluates_each_config_class_annotations_once(tmp_path, monkeypatch):
    """The CLI's flags and every config file read (the Mac catalog: a Mac per row) take their
    types from configs.type_hints: typing.get_type_hints once per class (16 classes here), not
    once per use (91 calls; Mac's 34)."""
    import collections
    import typing

    from batchsim.scripts import cli

    calls: collections.Counter = collections.Counter()
    real = typing.get_type_hints

    def counted(obj, *args, **kwargs):
        calls[obj] += 1
        return real(obj, *args, **kwargs)

    monkeypatch.setattr(typing, "get_type_hints", counted)
    rc = cli.main(["run", "--executor", "sim", "--device-profile", "M2 Max", "--model",
                   "llama-3.2-1b", "--num-prompts", "3", "--out", str(tmp_path), "--no-progress",
                   "--no-timeline", "--json"])
    assert rc == 0 and max(calls.values(), default=0) <= 1, calls.most_common(3)


HUGEPAGES = """
import sys
sys.argv[0] = "batchsim"  # as the console script runs it
import batchsim.scripts.cli
import numpy._core.multiarray as multiarray
print(multiarray._get_madvise_hugepage())
"""


def test_the_program_asks_no_huge_pages_for_numpys_arrays_unless_the_user_does():
    """numpy's transparent huge pages cost a simulated hour's summary 0.2 s of page compaction
    (Linux, THP defrag `madvise`); the program turns them off, a user's NUMPY_MADVISE_HUGEPAGE
    still decides."""
    import os

    def asked(env: dict[str, str]) -> str:
        return subprocess.run([sys.executable, "-c", HUGEPAGES], capture_output=True, text=True,
                              timeout=60, check=True, env=env).stdout.strip()

    env = {k: v for k, v in os.environ.items() if k != "NUMPY_MADVISE_HUGEPAGE"}
    assert asked(env) == "False"
    if sys.platform == "linux":  # numpy's madvise: Linux only
        assert asked({**env, "NUMPY_MADVISE_HUGEPAGE": "1"}) == "True"


def test_installed_versions_are_importlib_metadatas():
    from importlib import metadata

    from batchsim.server.platform import env

    for pkg in ("mlx", "mlx-lm", "mlx_lm", "numpy", "PyYAML", "pyyaml", "batchsim", "pip",
                "not-installed-anywhere"):
        try:
            expected = metadata.version(pkg)
        except metadata.PackageNotFoundError:
            expected = None
        assert env._version(pkg) == expected, pkg


@pytest.mark.parametrize("earlier", ["egg-info", "zip"])
def test_a_version_found_earlier_on_the_path_is_importlib_metadatas(tmp_path, monkeypatch, earlier):
    """r4: a NAME.egg-info (setup.py develop) or a zip ahead on sys.path is what importlib reads
    first; _version returned a later entry's dist-info name (0.1, importlib 9.9)."""
    import zipfile
    from importlib import metadata

    from batchsim.server.platform import env

    later = tmp_path / "later"
    (later / "fakepkg_r4-0.1.dist-info").mkdir(parents=True)
    (later / "fakepkg_r4-0.1.dist-info" / "METADATA").write_text(
        "Metadata-Version: 2.1\nName: fakepkg-r4\nVersion: 0.1\n")
    info = "Metadata-Version: 1.0\nName: fakepkg-r4\nVersion: 9.9\n"
    if earlier == "zip":
        first = tmp_path / "first.zip"
        with zipfile.ZipFile(first, "w") as z:
            z.writestr("fakepkg_r4-9.9.dist-info/METADATA", info)
    else:
        first = tmp_path / "first"
        (first / "fakepkg_r4.egg-info").mkdir(parents=True)
        (first / "fakepkg_r4.egg-info" / "PKG-INFO").write_text(info)
    monkeypatch.setattr(sys, "path", [str(first), str(later), *sys.path])
    assert metadata.version("fakepkg-r4") == "9.9"
    assert env._version("fakepkg-r4") == "9.9"
