"""Acceptance of drafted tokens, an input to pricing speculation (size, sweep, simulated runs).

Per-position rates as vLLM reports them: rate i is the share of drafts whose token i was
accepted (so tokens 0..i were). A single rate A stands for A, A^2, A^3 ... (each draft accepted
with chance A given the ones before it); a list shorter than K goes on with the ratio of its last
two rates. Acceptance may fall with the batch: a curve scales every rate by a factor of the batch
(1 at batch 1), interpolated in log2(batch) between the points a source measured and held past
them, which scales the accepted drafts per step by the same factor. `flat` (the default) keeps
them; the named curves are published measurements of (tokens per step - 1) relative to batch 1.
The draft share is the chance a row drafts at all in a step (an n-gram drafter finds no match in
most steps): rates are per draft, so a row emits 1 + share x sum(rates) tokens a step."""

from __future__ import annotations

import itertools
import json
import math
from pathlib import Path
from typing import NamedTuple

from batchsim.configs import ConfigError, file_kind
from batchsim.server.perf.profile import log_interp

# name -> ((batch, tokens per verify step per stream), ...) as the source measured, and where.
PUBLISHED: dict[str, tuple[tuple[tuple[int, float], ...], str]] = {
    "dflash-mlx-vlm": (((1, 4.10), (2, 2.69), (4, 1.78), (8, 1.22)),
                       "mlx-vlm PR #1029 (Blaizzy/mlx-vlm), Qwen3.5-4B + DFlash, temp 0"),
    "mtplx": (((1, 3.879), (2, 3.066), (4, 2.926), (8, 2.783), (16, 2.681), (24, 2.709),
               (32, 2.829)),
              "MTPLX PR #338 (youssofal/MTPLX), dense batched MTP depth 3, greedy"),
}
CURVES: tuple[str, ...] = ("flat", *PUBLISHED)


def curve_points(name: str) -> tuple[tuple[int, float], ...]:
    """(batch, factor on the accepted drafts) of a named curve."""
    if name == "flat":
        return ((1, 1.0),)
    if name not in PUBLISHED:
        raise ConfigError(f"acceptance curve {name!r} is not known; known: {', '.join(CURVES)}")
    points = PUBLISHED[name][0]
    base = points[0][1] - 1.0
    return tuple((b, (tau - 1.0) / base) for b, tau in points)


def batch_factor(points: tuple[tuple[int, float], ...], batch: int) -> float:
    """The curve's factor at `batch` (linear in log(batch), held past its ends)."""
    return log_interp(points, batch)


class Acceptance(NamedTuple):
    rates: tuple[float, ...]  # per-position acceptance at batch 1, non-increasing, in [0, 1]
    curve: str = "flat"  # how they fall with the batch (CURVES)
    draft_share: float = 1.0  # the chance a row drafts in a step, in (0, 1]

    def position_rates(self, spec_tokens: int, batch: int = 1) -> list[float]:
        """Rates of positions 0..K-1 at this batch."""
        if spec_tokens <= 0:
            return []
        rates = list(self.rates[:spec_tokens])
        last = rates[-1]
        ratio = last / self.rates[-2] if len(self.rates) > 1 and self.rates[-2] else last
        while len(rates) < spec_tokens:
            last *= ratio
            rates.append(last)
        f = batch_factor(curve_points(self.curve), batch) if self.curve != "flat" else 1.0
        return [min(1.0, r * f) for r in rates] if f != 1.0 else rates

    def expected_tokens(self, spec_tokens: int, batch: int = 1) -> float:
        """Tokens a row emits per verify step: accepted drafts and the model's own token."""
        return 1.0 + self.draft_share * sum(self.position_rates(spec_tokens, batch))


def parse_rates(text: str, what: str = "--acceptance") -> tuple[float, ...]:
    """'0.7' or '0.7,0.5,0.3': per-position rates, checked."""
    try:
        rates = tuple(float(x) for x in str(text).split(","))
    except ValueError:
        raise ConfigError(f"{what}: {text!r} is not a rate or a comma-separated list of rates "
                          "in 0..1") from None
    return checked(rates, what)


def checked(rates: tuple[float, ...], what: str) -> tuple[float, ...]:
    if not rates or not all(0.0 <= r <= 1.0 for r in rates):
        raise ConfigError(f"{what}: rates must be in 0..1, got {list(rates)}")
    if any(b > a for a, b in itertools.pairwise(rates)):
        raise ConfigError(f"{what}: per-position rates cannot rise (a token is accepted only "
                          f"after the ones before it), got {list(rates)}")
    return rates


def checked_share(share: float, what: str = "--draft-share") -> float:
    if not 0.0 < share <= 1.0:
        raise ConfigError(f"{what}: a share in (0, 1], got {share}")
    return share


def from_run(run_dir: str | Path) -> tuple[tuple[float, ...], float]:
    """The per-position acceptance rates a speculative run measured (its summary.json), and its
    draft share: drafts over decode steps of its rows (output tokens less the prefills' first
    tokens and the accepted drafts)."""
    path = Path(run_dir) / "summary.json"
    what = f"--acceptance-from {run_dir}"
    if path.exists() and not path.is_file():  # a pipe hung the read
        raise ConfigError(f"{what}: {path} is {file_kind(path)}, not a file")
    try:
        summary = json.loads(path.read_text())
    except (OSError, ValueError, RecursionError) as exc:  # RecursionError: a traceback
        raise ConfigError(f"{what}: cannot read {path}: {exc}") from None
    rates = summary.get("spec_decode_per_position_acceptance_rates") if isinstance(
        summary, dict) else None
    if not rates:
        raise ConfigError(f"{what}: {path} has no per-position acceptance "
                          "rates (a run with --spec-method ngram|draft writes them)")
    if not isinstance(rates, list) or not all(_is_number(r) for r in rates):
        raise ConfigError(f"{what}: {path}: spec_decode_per_position_acceptance_rates must be a "
                          f"list of numbers, got {str(rates)[:40]}")
    counts = {k: summary.get(k, 0) for k in ("total_output_tokens", "completed",
                                             "spec_decode_accepted_tokens",
                                             "spec_decode_num_drafts")}
    for key, value in counts.items():  # a string was "unsupported operand type(s) for -"
        if not (_is_number(value) and 0 <= value < math.inf):
            raise ConfigError(f"{what}: {path}: {key} must be a count, got {str(value)[:40]}")
    steps = (counts["total_output_tokens"] - counts["completed"]
             - counts["spec_decode_accepted_tokens"])
    drafts = counts["spec_decode_num_drafts"]
    share = min(1.0, drafts / steps) if steps > 0 and drafts > 0 else 1.0
    return checked(tuple(float(r) for r in rates), what), share


def _is_number(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)
