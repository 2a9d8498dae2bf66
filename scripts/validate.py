"""`batchsim validate`: run a matrix of workloads for real and simulated on this machine, with a model
that calibration did not see, and report how far the simulator's predictions are off."""

from __future__ import annotations

import argparse
import dataclasses
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from configs import CONFIG_DIR, ConfigError, load_yaml
from scripts.common import append_jsonl, err, out, pyplot, save_figure, table, timestamp

MATRIX = CONFIG_DIR / "validation" / "matrix.yaml"
METRICS = ("output_throughput", "mean_ttft_ms", "mean_tpot_ms", "p99_ttft_ms", "p99_tpot_ms")
EXTRA = ("max_batch_size",)


def add_parser(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default="qwen2.5-0.5b", help="validation model (not a calibration one)")
    p.add_argument("--dtype", default="auto", choices=["auto", "float32", "float16", "bfloat16"])
    p.add_argument("--device-profile", default="local", help="calibrated profile to validate")
    p.add_argument("--matrix", default=str(MATRIX), help="cases YAML")
    p.add_argument("--cases", help="comma-separated case names to run (default: all)")
    p.add_argument("--repeats", type=int, default=3,
                   help="real runs per case, taken round-robin over the matrix so a shared machine's "
                        "slow minutes spread over every case; the simulator is compared with their "
                        "median, and their spread is reported as the noise floor (default: 3)")
    p.add_argument("--out", default="results", help="directory for validate.jsonl, PNG, run dirs")


def run(args: argparse.Namespace) -> dict:
    from server.calibration import format_speed, mean_by_key
    from server.devices import resolve_profile
    from server.run_config import RunConfig
    from server.session import open_session

    if args.repeats < 1:
        raise ConfigError(f"--repeats must be at least 1, got {args.repeats}")
    profile = resolve_profile(args.device_profile)
    if profile.calibration and args.model in profile.calibration.calibrated_on:
        raise ConfigError(f"--model {args.model} was used to calibrate {args.device_profile}; "
                          "validate on a model the profile has not seen")
    cases = _load_cases(Path(args.matrix), args.cases)
    real = open_session(RunConfig(model=args.model, dtype=args.dtype))
    sim = open_session(RunConfig(model=args.model, dtype=real.dtype, executor="sim",
                                 device_profile=args.device_profile))
    out_dir = Path(args.out) / f"validate-{timestamp()}"
    probe = _speed_probe(profile, real.dtype)
    predicted, configs = {}, {}
    for case in cases:  # deterministic: one simulated run per case
        cfg = configs[case["name"]] = _case_config(real.config, case, real.weight_bytes)
        cfg_sim = dataclasses.replace(cfg, executor="sim", device_profile=args.device_profile,
                                      dtype=real.dtype)
        predicted[case["name"]] = _run(sim.with_config(cfg_sim), out_dir, case["name"] + "-sim")
    runs: dict[str, list[dict]] = {c["name"]: [] for c in cases}
    speeds: dict[str, list[dict]] = {c["name"]: [] for c in cases}
    total = len(cases) * args.repeats
    for rep in range(args.repeats):
        for i, case in enumerate(cases):
            name = case["name"]
            err.print(f"[{rep * len(cases) + i + 1}/{total}] {name}: real run {rep + 1}/{args.repeats}")
            before = probe()
            measured = _run(real.with_config(configs[name]), out_dir, f"{name}-real{rep + 1}")
            speeds[name].append(mean_by_key(before, probe()))
            runs[name].append(measured)
            this = _compare(name, measured, predicted[name])["error"]
            err.print("   " + "  ".join(f"{m} {100 * this[m]:+.1f}%" for m in METRICS)
                      + "  device speed " + format_speed(speeds[name][-1]))
    rows = [_compare(c["name"], _median_run(runs[c["name"]]), predicted[c["name"]])
            | _repeat_stats(runs[c["name"]], speeds[c["name"]]) for c in cases]
    summary = _summarize(rows)
    summary.update({"model": args.model, "device_profile": args.device_profile, "repeats": args.repeats,
                    "profile_source": profile.source, "env": real.environment(),
                    "png": str(_plot(rows, out_dir)), "run_dir": str(out_dir)})
    _print(rows, summary)
    append_jsonl(Path(args.out) / "validate.jsonl", [summary])
    return summary


def _speed_probe(profile, dtype: str) -> Callable[[], dict[str, float]]:
    """Reruns calibration's speed probe: the device's speed now relative to when the profile was
    measured, per probe (1.0 = same; {} when the profile has no probe)."""
    import mlx.core as mx

    from server.calibration import probe_speed, speed_probe_ms
    from server.microbench import cache_limit

    calibrated = profile.calibration.speed_probe_ms if profile.calibration else {}

    def probe() -> dict[str, float]:
        if not calibrated:
            return {}
        with cache_limit():
            return probe_speed(speed_probe_ms(getattr(mx, dtype)), calibrated)

    return probe


def _load_cases(path: Path, names: str | None) -> list[dict[str, Any]]:
    cases = load_yaml(path).get("cases") or []
    if names:
        wanted = [n.strip() for n in names.split(",")]
        known = {c["name"] for c in cases}
        missing = [n for n in wanted if n not in known]
        if missing:
            raise ConfigError(f"{path}: no case {missing[0]!r}; cases: {', '.join(sorted(known))}")
        cases = [c for c in cases if c["name"] in wanted]
    return cases


def _case_config(base, case: dict[str, Any], weight_bytes: int):
    from server.run_config import SchedulerSettings
    from workloads.spec import workload_from_dict

    allowed = {"name", "max_num_seqs", "memory_gb", "policy", "workload"}
    unknown = set(case) - allowed
    if unknown:
        raise ConfigError(f"validation case {case.get('name')}: unknown key {sorted(unknown)[0]!r}; "
                          f"allowed: {', '.join(sorted(allowed))}")
    memory = case.get("memory_gb")
    if isinstance(memory, str) and memory.startswith("weights+"):
        memory = weight_bytes / (1 << 30) + float(memory.split("+", 1)[1])
    workload = workload_from_dict({"name": case["name"], **case["workload"]},
                                  f"validation case {case['name']}: workload")
    sched = SchedulerSettings(max_num_seqs=case["max_num_seqs"],
                              policy=case.get("policy", "decode-first"))
    return dataclasses.replace(base, scheduler=sched, memory_gb=memory, workload=workload)


def _run(session, out_dir: Path, label: str) -> dict:
    from server.runner import run_workload

    return run_workload(session, session.config.workload, out_dir=out_dir, label=label).summary


def _median_run(runs: list[dict]) -> dict:
    """Per metric, the median over a case's real runs (each metric on its own)."""
    keys = set(METRICS + EXTRA + ("num_preemptions",))
    med = {k: float(np.median([r.get(k) or 0.0 for r in runs])) for k in keys}
    return med | {"run_dir": [r.get("run_dir") for r in runs]}


def _repeat_stats(runs: list[dict], speeds: list[dict[str, float]]) -> dict:
    """How far one real run falls from the median of its repeats (mean |x / median - 1|): the
    machine's own noise, a floor under any simulator's error. Plus each run's values and speed."""
    med = _median_run(runs)
    spread = {}
    for m in METRICS:
        devs = [abs((r.get(m) or 0.0) / med[m] - 1) if med[m] else 0.0 for r in runs]
        spread[m] = float(np.mean(devs))
    keys = list(speeds[0]) if speeds else []
    return {"repeat_abs_dev": spread,
            "real_runs": [{m: r.get(m) for m in METRICS + EXTRA} for r in runs],
            "device_speed": {k: float(np.mean([s[k] for s in speeds if k in s])) for k in keys},
            "device_speed_runs": speeds}


def _compare(name: str, measured: dict, predicted: dict) -> dict:
    error = {}
    for m in METRICS + EXTRA:
        real, sim = measured.get(m) or 0.0, predicted.get(m) or 0.0
        error[m] = (sim - real) / real if real else (0.0 if sim == real else float("inf"))
    return {"case": name, "measured": {m: measured.get(m) for m in METRICS + EXTRA + ("num_preemptions",)},
            "predicted": {m: predicted.get(m) for m in METRICS + EXTRA + ("num_preemptions",)},
            "error": error, "sim_speedup": predicted.get("sim_speedup"),
            "real_run_dir": measured.get("run_dir"), "sim_run_dir": predicted.get("run_dir")}


def _summarize(rows: list[dict]) -> dict:
    med = {m: float(np.median([abs(r["error"][m]) for r in rows])) for m in METRICS + EXTRA}
    worst = {}
    for m in METRICS + EXTRA:
        r = max(rows, key=lambda r: abs(r["error"][m]))
        worst[m] = {"abs_err": abs(r["error"][m]), "case": r["case"]}
    speeds = [v for r in rows for s in r.get("device_speed_runs", []) for v in s.values()]
    noise = {m: float(np.median([r["repeat_abs_dev"][m] for r in rows])) for m in METRICS
             } if all("repeat_abs_dev" in r for r in rows) else {}
    return {"cases": rows, "median_abs_err": med, "noise_floor": noise,
            "device_speed_range": [min(speeds), max(speeds)] if speeds else None,
            "max_abs_err": {m: w["abs_err"] for m, w in worst.items()},
            "worst_case": {m: w["case"] for m, w in worst.items()}}


def _print(rows: list[dict], summary: dict) -> None:
    from server.calibration import format_speed

    cols = (["case"] + [f"{m} err %" for m in METRICS]
            + ["peak batch real/sim", "device speed vs calibration"])
    body = [[r["case"]] + [100 * r["error"][m] for m in METRICS]
            + [f"{r['measured']['max_batch_size']}/{r['predicted']['max_batch_size']}",
               format_speed(r.get("device_speed", {}))] for r in rows]
    body.append(["median |err|"] + [100 * summary["median_abs_err"][m] for m in METRICS] + ["", ""])
    body.append(["max |err|"] + [100 * summary["max_abs_err"][m] for m in METRICS] + ["", ""])
    if summary.get("noise_floor") and summary.get("repeats", 1) > 1:
        body.append(["real run vs its repeats"] + [100 * summary["noise_floor"][m] for m in METRICS]
                    + ["", ""])
    out.print(table("Simulator vs real runs (error = predicted / measured - 1)", cols, body))
    if summary.get("repeats", 1) > 1:
        err.print(f"measured = median of {summary['repeats']} real runs per case; the last row is "
                  "how far one real run falls from that median (the machine's own noise)")
    lo_hi = summary.get("device_speed_range")
    if lo_hi and (lo_hi[0] < 0.9 or lo_hi[1] > 1.1):
        err.print(f"[yellow]the device ran at x{lo_hi[0]:.2f}-x{lo_hi[1]:.2f} of its calibrated "
                  "speed (fixed GEMV/GEMM probe): errors that large are the machine drifting, "
                  "not the model. Recalibrate right before validating, on a quiet machine.[/yellow]")


def _plot(rows: list[dict], out_dir: Path) -> Path:
    plt = pyplot()

    fig, axes = plt.subplots(1, len(METRICS), figsize=(4 * len(METRICS), 4))
    for ax, m in zip(axes, METRICS):
        xs = [r["measured"][m] or 0 for r in rows]
        ys = [r["predicted"][m] or 0 for r in rows]
        lo = [x - min(run[m] or 0 for run in r.get("real_runs", [r["measured"]])) for x, r in zip(xs, rows)]
        hi = [max(run[m] or 0 for run in r.get("real_runs", [r["measured"]])) - x for x, r in zip(xs, rows)]
        ax.errorbar(xs, ys, xerr=[lo, hi], fmt="o", ms=4, elinewidth=0.8)  # bars: real runs' range
        top = max(xs + ys + [1e-9]) * 1.1
        ax.plot([0, top], [0, top], "k--", lw=0.8)
        ax.set_title(m)
        ax.set_xlabel("measured")
        ax.set_ylabel("predicted")
    fig.suptitle("batchsim validate: predicted vs measured (median of real runs, bars: their range)")
    return save_figure(fig, out_dir / "validate.png")
