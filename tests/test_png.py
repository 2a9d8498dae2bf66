"""The quick PNG (server/results/png.py) a run's timeline is written as: the file PIL reads back
holds exactly the pixels, size and dpi matplotlib's own savefig writes for the same figure."""

from __future__ import annotations

import io

import numpy as np
import pytest
from batchsim.server.results import plots
from batchsim.server.results.png import figure_png, rgba_png
from PIL import Image


def _figure():
    fig = plots.figure(figsize=(3, 2))
    ax = fig.subplots()
    ax.plot([0, 1, 2], [0, 2, 1], label="a line")
    ax.fill_between([0, 1, 2], [0, 1, 0], [1, 2, 1], alpha=0.2)
    ax.legend()
    ax.set_title("title")
    return fig


def test_the_quick_png_holds_what_savefig_writes():
    saved = io.BytesIO()
    _figure().savefig(saved, format="png", dpi=90)
    theirs = Image.open(io.BytesIO(saved.getvalue()))
    written = figure_png(_figure(), 90)
    Image.open(io.BytesIO(written)).verify()  # every chunk's CRC (a torn or miscounted file fails)
    ours = Image.open(io.BytesIO(written))
    assert ours.format == "PNG" and ours.mode == theirs.mode == "RGBA"
    assert ours.size == theirs.size == (270, 180)
    assert np.array_equal(np.asarray(ours), np.asarray(theirs))
    assert ours.info["dpi"] == pytest.approx(theirs.info["dpi"], abs=0.01)
    assert ours.info["Software"] == theirs.info["Software"]


def test_save_figure_fast_writes_the_quick_png(tmp_path):
    path = plots.save_figure(_figure(), tmp_path / "t.png", dpi=50, tight=False, fast=True)
    assert path.read_bytes() == figure_png(_figure(), 50)


@pytest.mark.parametrize("pixels", [np.zeros((2, 3, 3), np.uint8), np.zeros((2, 3, 4), np.int16)])
def test_rgba_png_takes_only_rgba_bytes(pixels):
    with pytest.raises(ValueError, match="height x width x 4 uint8"):
        rgba_png(pixels, 100, {})
