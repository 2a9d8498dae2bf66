"""What `batchsim validate` shows: the table of the simulator's errors per case with its notes,
and validate.png, predicted against measured per metric (scripts/validate.py runs the cases)."""

from __future__ import annotations

from pathlib import Path

from batchsim.scripts.common import err, out, pyplot, save_figure, table
from batchsim.server.perf.validation_errors import METRICS, PARTS, STEP


def print_validation(rows: list[dict], summary: dict) -> None:
    cols = (["case"] + [f"{m} err %" for m in METRICS] + ["step time err %"]
            + ["peak batch real/sim", "device speed (probe)", "tok/s err % at probed speed",
               "predicted step: largest parts"])
    body = [[r["case"]] + [100 * r["error"][m] for m in METRICS] + [_pct(r[STEP])]
            + [f"{r['measured']['max_batch_size']:g}/{r['predicted']['max_batch_size']}",
               f"x{r['device_speed']:.2f}" if "device_speed" in r else "n/a",
               100 * r["at_probed_speed"]["output_throughput"] if "at_probed_speed" in r else "",
               _largest_parts(r.get(PARTS))]
            for r in rows]
    step, blank = summary[STEP] or {}, ["", "", "", ""]
    body.append(["median |err|"] + [100 * summary["median_abs_err"][m] for m in METRICS]
                + [_pct(step.get("median_abs"))] + blank)
    body.append(["max |err|"] + [100 * summary["max_abs_err"][m] for m in METRICS]
                + [_pct(step.get("max_abs"))] + blank)
    if summary.get("repeats", 1) > 1:
        body.append(["one real run vs median"] + [100 * summary["noise_floor"][m] for m in METRICS]
                    + [""] + blank)
    adj = summary.get("at_probed_speed")
    if adj:
        astep = adj.get(STEP) or {}
        body.append(["at probed speed: median"] + [100 * adj["median_abs_err"][m] for m in METRICS]
                    + [_pct(astep.get("median_abs"))] + blank)
        body.append(["at probed speed: max"] + [100 * adj["max_abs_err"][m] for m in METRICS]
                    + [_pct(astep.get("max_abs"))] + blank)
    out.print(table("Simulator vs real runs (error = predicted / measured - 1)", cols, body))
    if summary.get("repeats", 1) > 1:
        err.print(f"measured = median of {summary['repeats']} real runs per case. 'one real run vs "
                  "median': how far a single real run falls from that median, the machine's own "
                  "noise.")
    err.print("'step time': the simulator's time for each step a real run executed (its own plans, "
              "executor time only) against the measured time; the rest of an error is what "
              "queueing makes of it. 'largest parts': what that predicted time was made of "
              "(step_parts_share in the JSON).")
    if adj:
        err.print("'at probed speed': the same simulation with the device scaled to the speed the "
                  "probe (real steps of a calibration model) measured around each case's runs.")
    lo_hi = summary.get("device_speed_range")
    if lo_hi and (lo_hi[0] < 0.9 or lo_hi[1] > 1.1):
        err.print(f"the device ran at x{lo_hi[0]:.2f}-x{lo_hi[1]:.2f} of its calibrated "
                  "speed: errors that large are the machine drifting, not the model. Recalibrate "
                  "right before validating, on a quiet machine.", style="yellow")


def _largest_parts(shares: dict[str, float] | None, count: int = 2) -> str:
    """"weights 61%, attention 22%": the parts of the predicted step time that matter most."""
    if not shares:
        return ""
    top = sorted(shares.items(), key=lambda kv: -kv[1])[:count]
    return ", ".join(f"{k.removesuffix('_s')} {100 * v:.0f}%" for k, v in top)


def _pct(x: float | None) -> float | str:
    return "" if x is None else 100 * x


_UNITS = {"output_throughput": "output tok/s", "mean_ttft_ms": "mean TTFT, ms",
          "mean_tpot_ms": "mean TPOT, ms", "p99_ttft_ms": "P99 TTFT, ms",
          "p99_tpot_ms": "P99 TPOT, ms"}


def plot(rows: list[dict], out_dir: Path, what: str) -> Path:
    plt = pyplot()

    fig, axes = plt.subplots(1, len(METRICS), figsize=(4 * len(METRICS), 4.4))
    for ax, m in zip(axes, METRICS):
        xs = [r["measured"][m] or 0 for r in rows]
        ys = [r["predicted"][m] or 0 for r in rows]
        lo = [x - min(run[m] or 0 for run in r["real_runs"]) for x, r in zip(xs, rows)]
        hi = [max(run[m] or 0 for run in r["real_runs"]) - x for x, r in zip(xs, rows)]
        ax.errorbar(xs, ys, xerr=[lo, hi], fmt="o", ms=4, elinewidth=0.8)  # bars: real runs' range
        top = max(xs + ys + [1e-9]) * 1.1
        ax.plot([0, top], [0, top], "k--", lw=0.8, label="predicted = measured")
        for x, y, r in zip(xs, ys, rows):
            ax.annotate(r["case"], (x, y), textcoords="offset points", xytext=(4, 4), fontsize=7)
        ax.set(title=_UNITS[m], xlabel=f"measured ({_UNITS[m]})", ylabel="predicted")
        ax.legend(loc="upper left", fontsize=7)
    fig.suptitle(f"batchsim validate, {what}: predicted vs measured per case (median of the real "
                 "runs; bars: their range)")
    return save_figure(fig, out_dir / "validate.png")
