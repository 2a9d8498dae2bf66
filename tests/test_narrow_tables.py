"""At 80 columns a table leaves columns out whole (named under it): the ones it leaves are never
the answer the command was asked for."""

from __future__ import annotations

import argparse
import dataclasses

import pytest
from batchsim.scripts import common, fit_macs, size
from batchsim.server.perf.reference import load_published


@pytest.fixture
def narrow(monkeypatch):
    monkeypatch.setattr(common.out, "width", 80)


def _run(module, *argv: str) -> None:
    parser = argparse.ArgumentParser()
    module.add_parser(parser)
    module.run(parser.parse_args(argv))


def _header(printed: str, title: str) -> str:
    """The header rows of the table under `title` (its column names, not its title)."""
    after = printed[printed.index(title):]
    return after[after.index("┏"):after.index("┡")]


def test_size_keeps_the_columns_its_flags_asked_for(tmp_path, capsys, narrow):
    _run(size, "--out", str(tmp_path), "--model", "llama-3.1-8b", "--context", "8192",
         "--shared-prefix", "4096", "--mac", "M2 Ultra", "--explain")
    printed = capsys.readouterr().out
    limits = _header(printed, "Batch limits per Mac")
    assert "shared" in limits and "dflt/raised" in limits  # --shared-prefix's answer
    parts = _header(printed, "Predicted decode step by part")
    assert "total" in parts and "tok/s" in parts  # the step before its parts
    assert all(len(line) <= 80 for line in printed.splitlines()[:-1])  # the JSON line aside


def test_fit_macs_keeps_the_measured_and_predicted_figures(capsys, narrow, monkeypatch):
    published = load_published()  # two sources' rows: the fit's folds take seconds, not minutes
    few = [r for r in published.rows if r.src in {"vllm_mlx_llm", "mlx_examples_1029"}]
    monkeypatch.setattr(fit_macs, "load_published",
                        lambda: dataclasses.replace(published, rows=tuple(few)))
    _run(fit_macs)
    header = _header(capsys.readouterr().out, "Published tok/s vs predicted")
    assert "measured" in header and "after" in header


@pytest.mark.parametrize("columns, widest", [(80, 78), (200, 100)])
def test_batchsim_help_wraps_to_the_terminal(monkeypatch, columns, widest):
    """`batchsim --help` was wrapped at 100 columns whatever the terminal (99-column lines at 80);
    each command's --help follows the terminal through argparse."""
    from batchsim.scripts import cli

    monkeypatch.setenv("COLUMNS", str(columns))
    text = cli.build_parser().format_help()
    assert max(map(len, text.splitlines())) <= widest, text
    assert "size          per Mac in the catalog" in text and "exit codes: 0 done" in text


def test_models_table_counts_small_models_in_millions():
    """`batchsim models` printed SmolLM2-135M as 0.13B and the test models as 0.00B."""
    from batchsim.scripts.models_cmd import _count

    assert [_count(n) for n in (8_030_261_248, 134_515_008, 9_194_240, 106_816)] == [
        "8.03B", "135M", "9M", "107K"]


def test_integers_and_floats_share_thousands_separators():
    """The serving summary printed 'Total input tokens 2626' beside 'duration (s) 4,658'."""
    from batchsim.scripts.common import fmt

    assert (fmt(2626), fmt(4658.2), fmt(999), fmt(36_209)) == ("2,626", "4,658", "999", "36,209")
