"""matplotlib for every PNG batchsim writes (size, sweep, compare, validate, a run's timeline):
the file-only Agg backend, imported on first use."""

from __future__ import annotations

import io
import os
import sys
from pathlib import Path

from batchsim.server.results.png import figure_png
from batchsim.server.results.run_files import replace_atomically


def _agg_only() -> None:
    """Before matplotlib's import: the Agg backend, whatever MPLBACKEND names (matplotlib's
    import fails on one it cannot load: a notebook terminal's module://matplotlib_inline...)."""
    if "matplotlib" not in sys.modules:
        os.environ["MPLBACKEND"] = "agg"


def pyplot():
    """matplotlib.pyplot on the file-only Agg backend (no display needed), imported on first use."""
    _agg_only()
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def figure(**kwargs):
    """A matplotlib Figure outside pyplot (less to import, nothing to close): for PNGs written
    at the end of every run."""
    _agg_only()
    from matplotlib.figure import Figure

    return Figure(**kwargs)


def save_figure(fig, path: Path, dpi: int = 110, tight: bool = True, fast: bool = False,
                make_dir: bool = True) -> Path:
    """`tight`: fit the margins to the labels (costs a draw); else the figure's own margins.
    `fast`: a PNG unfiltered and lightly compressed (png.py: line plots still compress well).
    `make_dir`: make the directory if missing (else its absence is an OSError: a run directory
    removed mid-run). Written whole or not at all: a full disk or a kill left a torn PNG."""
    if tight:
        fig.tight_layout()
    if make_dir:
        path.parent.mkdir(parents=True, exist_ok=True)
    if fast and path.suffix == ".png":
        replace_atomically(path, figure_png(fig, dpi))
    else:
        image = io.BytesIO()
        fig.savefig(image, format=path.suffix[1:] or None, dpi=dpi)
        replace_atomically(path, image.getvalue())
    if "matplotlib.pyplot" in sys.modules:  # pyplot keeps its figures until closed
        sys.modules["matplotlib.pyplot"].close(fig)
    return path
