"""`batchsim validate`: run a matrix of workloads for real and simulated on this machine, with a
model that calibration did not see, and report how far the simulator's predictions are off."""

from __future__ import annotations

import argparse
import dataclasses
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
from batchsim.configs import ConfigError, load_yaml
from batchsim.scripts import validate_view
from batchsim.scripts.common import (
    DTYPE_HELP,
    add_field_argument,
    append_jsonl,
    err,
    positive_int,
    run_stoppable,
    stop_if_interrupted,
    timestamp,
)
from batchsim.server.engine.run_config import DTYPES, RunConfig
from batchsim.server.measure.validation_cases import MATRIX, case_config, load_cases, matrix_path
from batchsim.server.perf.devices import LOCAL_NAME, profile_for_this_machine
from batchsim.server.perf.validation_errors import (
    METRICS,
    PARTS,
    STEP,
    compare,
    median_run,
    repeat_stats,
    summarize,
)

DEFAULT_MODEL = "qwen2.5-0.5b"


def add_parser(p: argparse.ArgumentParser) -> None:
    # Measured 2026-12-05, this 2-core VM at load 2-5, `--device-profile linux-x86_64-openblas-
    # 2core --cases b1-poisson,b32-burst --repeats 1`: real runs 116 and 76 s, 245 s in all.
    p.description = (f"{p.description}. " if p.description else "") + (
        "The default runs each case of configs/validation/matrix.yaml for real --repeats times "
        "(3) on the validation model (qwen2.5-0.5b), and simulated: 1-2 minutes a real run on a "
        "2-core CPU, about an hour in all. Short: --cases NAME,... --repeats 1 (two cases: about "
        "4 minutes), or --measured-from an earlier validate.jsonl (seconds, nothing run for "
        "real). `batchsim calibrate` profiles this machine (23 minutes; --quick: a few).")
    p.add_argument("--model", default=None, help="validation model (not a calibration one; "
                   f"default: the matrix's `model`, else {DEFAULT_MODEL})")
    add_field_argument(p, RunConfig, "dtype", DTYPE_HELP, choices=list(DTYPES), unset=False)
    p.add_argument("--device-profile", default=None,
                   help=f"calibrated profile to validate (default: {LOCAL_NAME!r}, what `batchsim "
                   "calibrate` writes, else the shipped one calibrated on a machine like this)")
    p.add_argument("--matrix", default=MATRIX.stem, help="cases YAML, or the name of one in "
                   "configs/validation: matrix (dense), moe, sliding")
    p.add_argument("--cases", help="comma-separated case names to run (default: all)")
    p.add_argument("--repeats", type=positive_int, default=3,
                   help="real runs per case, taken round-robin over the matrix so a shared "
                        "machine's slow minutes spread over every case; the simulator is compared "
                        "with their median, and their spread is reported as the noise floor "
                        "(default: 3)")
    p.add_argument("--out", default="results", help="directory for validate.jsonl, PNG, run dirs")
    p.add_argument("--measured-from", metavar="VALIDATE_JSONL",
                   help="run nothing for real: score the profile (another profile, or a changed "
                        "cost model) against the real runs an earlier validate recorded (the last "
                        "row of this file; same model and cases), in seconds instead of an hour. "
                        "No step-time or probed-speed columns: those need the real runs themselves")


@dataclasses.dataclass
class _Validation:
    """What every step of one validation shares."""

    args: argparse.Namespace
    profile: Any  # the DeviceProfile under test
    cases: list[dict]
    real: Any  # Session on the real executor
    sim: Any  # Session on the simulator with the profile
    here: str  # the device the real runs ran on
    calibrated_on: str  # the device the profile was calibrated on ("" if unknown)
    out_dir: Path


def run(args: argparse.Namespace) -> dict:
    args.matrix = str(matrix_path(args.matrix))
    args.model = args.model or load_yaml(Path(args.matrix)).get("model") or DEFAULT_MODEL
    args.device_profile = args.device_profile or profile_for_this_machine()  # as run picks
    earlier = None
    if args.measured_from:
        earlier = _earlier_validation(Path(args.measured_from), args.model,
                                      load_cases(Path(args.matrix), args.cases))
    v = _open(args, earlier["device"] if earlier else None)
    if isinstance(v, str):  # the real executor cannot run this model yet
        return {"model": args.model, "skipped": v, "cases": []}
    configs = {c["name"]: case_config(v.real.config, c, v.real.weight_bytes) for c in v.cases}
    predicted = {name: _run(v.sim.with_config(_sim_config(cfg, args.device_profile, v.real.dtype)),
                            v.out_dir, name + "-sim")
                 for name, cfg in configs.items()}  # deterministic: one simulated run per case
    if earlier is not None:
        kept = ("repeat_abs_dev", "real_runs", "case_spec", "real_run_dir")
        rows = [compare(c["name"], earlier["cases"][c["name"]]["measured"], predicted[c["name"]])
                | {k: earlier["cases"][c["name"]].get(k) for k in kept} | {STEP: None, PARTS: None}
                for c in v.cases]
        return _finish(v, rows, repeats=earlier["repeats"], measured_from=args.measured_from)
    measured = _measure(v, configs, predicted)
    rows = [_case_row(v, c, configs[c["name"]], predicted[c["name"]], measured[c["name"]])
            for c in v.cases]
    return _finish(v, rows, repeats=args.repeats)


def _open(args: argparse.Namespace, measured_on: str | None) -> _Validation:
    """Profile, cases and both sessions; refuses a model the profile was calibrated on."""
    from batchsim.server.engine.session import open_session
    from batchsim.server.perf.devices import resolve_profile
    from batchsim.server.perf.profile_match import device_id, mismatch_warning

    profile = resolve_profile(args.device_profile)
    if profile.calibration and args.model in profile.calibration.calibrated_on:
        raise ConfigError(f"--model {args.model} was used to calibrate {args.device_profile}; "
                          "validate on a model the profile has not seen")
    cases = load_cases(Path(args.matrix), args.cases)
    try:
        real = open_session(RunConfig(model=args.model, dtype=args.dtype))
        reason = _not_runnable(real)
    except ConfigError as exc:  # the session refuses a family it does not run yet
        if "not yet" not in str(exc):
            raise
        reason = str(exc)
    if reason:
        err.print(f"validate: {args.model} is not runnable yet in the real executor "
                  f"({reason}); its {len(cases)} cases are skipped", style="yellow", soft_wrap=True)
        return f"not runnable yet: {reason}"
    sim = open_session(RunConfig(model=args.model, dtype=real.dtype, executor="sim",
                                 device_profile=args.device_profile))
    here = measured_on or device_id(real.environment())
    calibrated_on = profile.calibration.device if profile.calibration else ""
    warning = mismatch_warning(profile, args.device_profile, here)
    if warning:
        err.print(f"{warning} Every error below includes the difference between the two "
                  "machines.", style="yellow", soft_wrap=True)
    return _Validation(args, profile, cases, real, sim, here, calibrated_on,
                       Path(args.out) / f"validate-{timestamp()}")


@dataclasses.dataclass
class _Measured:
    """One case's real runs: summaries, probed device speeds, shadow timers."""

    runs: list[dict] = dataclasses.field(default_factory=list)
    speeds: list[float] = dataclasses.field(default_factory=list)
    shadows: list = dataclasses.field(default_factory=list)


def _measure(v: _Validation, configs: dict, predicted: dict) -> dict[str, _Measured]:
    """Every case's real runs, round-robin over the matrix `--repeats` times."""
    from batchsim.server.executors.factory import step_cost
    from batchsim.server.executors.shadow import ShadowTimer
    from batchsim.server.measure.calibration import device_speed, mean_by_key

    probe = _speed_probe(v.profile, v.real.dtype)
    cost = step_cost(v.sim.config, v.sim.ref)  # the simulator's, passed explicitly
    measured = {c["name"]: _Measured() for c in v.cases}
    repeats, total = v.args.repeats, len(v.cases) * v.args.repeats
    for rep in range(repeats):
        for i, case in enumerate(v.cases):
            name, m = case["name"], measured[case["name"]]
            err.print(f"[{rep * len(v.cases) + i + 1}/{total}] {name}: "
                      f"real run {rep + 1}/{repeats}")
            before = probe()
            shadow = ShadowTimer(cost, v.real.cache_layout)  # as the real pool holds
            result = _run(v.real.with_config(configs[name]), v.out_dir,
                          f"{name}-real{rep + 1}", shadow)
            result[STEP] = shadow.error()
            m.shadows.append(shadow)
            speed = device_speed(mean_by_key(before, probe()))
            if speed is not None:
                m.speeds.append(speed)
            m.runs.append(result)
            this = compare(name, result, predicted[name])["error"]
            err.print("   " + "  ".join(f"{k} {100 * this[k]:+.1f}%" for k in METRICS)
                      + f"  step time {100 * result[STEP]:+.1f}%"
                      + (f"  device speed x{speed:.2f}" if speed else ""))
    return measured


def _case_row(v: _Validation, case: dict, cfg, predicted: dict, m: _Measured) -> dict:
    """A case's errors against the median of its real runs, and re-simulated at the probed speed."""
    name = case["name"]
    median = median_run(m.runs)
    row = compare(name, median, predicted) | repeat_stats(m.runs, median) | {"case_spec": case}
    steps = [r[STEP] for r in m.runs if r[STEP] is not None]
    row[STEP] = float(np.median(steps)) if steps else None
    row[PARTS] = _part_shares(m.shadows)
    if m.speeds:  # the same simulation on the device as probed around this case's runs
        row["device_speed"] = speed = float(np.exp(np.mean(np.log(m.speeds))))
        row["device_speed_runs"] = m.speeds
        row["at_probed_speed"] = _at_probed_speed(v, name, cfg, row["measured"], speed)
        if row[STEP] is not None:  # every term scales by 1/speed, so this is exact
            row["at_probed_speed"][STEP] = (1 + row[STEP]) / speed - 1
    return row


def _at_probed_speed(v: _Validation, name: str, cfg, measured: dict, speed: float) -> dict:
    from batchsim.server.engine.session import open_session
    from batchsim.server.perf.devices import save_profile
    from batchsim.server.perf.profile import at_speed

    path = save_profile(at_speed(v.profile, speed), v.out_dir / f"{name}-profile-x{speed:.3f}.yaml")
    at_probed = open_session(dataclasses.replace(v.sim.config, device_profile=str(path)))
    adjusted = _run(at_probed.with_config(_sim_config(cfg, str(path), v.real.dtype)),
                    v.out_dir, name + "-sim-at-probed-speed")
    return compare(name, measured, adjusted)["error"]


def _finish(v: _Validation, rows: list[dict], **extra: Any) -> dict:
    summary = summarize(rows)
    summary.update({"model": v.args.model, "device_profile": v.args.device_profile,
                    "profile_source": v.profile.source, "profile_device": v.calibrated_on,
                    "device": v.here, "env": v.real.environment(), **extra,
                    "png": str(validate_view.plot(rows, v.out_dir, f"{v.args.model} on profile "
                                                                f"{v.args.device_profile}")),
                    "run_dir": str(v.out_dir)})
    validate_view.print_validation(rows, summary)
    append_jsonl(Path(v.args.out) / "validate.jsonl", [summary])
    return summary


def _part_shares(shadows: list) -> dict[str, float] | None:
    """Each part's share of the predicted time of every real step of a case's runs."""
    if not shadows:
        return None
    return sum((x.parts for x in shadows[1:]), shadows[0].parts).shares()


def _earlier_validation(path: Path, model: str, cases: list[dict]) -> dict:
    """The last validation recorded in `path`, checked to be of this model and these cases: its
    cases by name, its repeats and the device its real runs ran on."""
    import json

    from batchsim.server.results.json_text import jsonable

    try:
        rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    except (OSError, json.JSONDecodeError) as e:
        raise ConfigError(f"--measured-from: cannot read {path}: {e}") from None
    if not rows or not rows[-1].get("cases"):
        raise ConfigError(f"--measured-from: {path} holds no validation")
    last = rows[-1]
    if last.get("model") != model:
        raise ConfigError(f"--measured-from: {path}'s real runs are of {last.get('model')}, not "
                          f"{model}; "
                          f"pass --model {last.get('model')}")
    by_name = {r["case"]: r for r in last["cases"]}
    for case in cases:
        earlier = by_name.get(case["name"])
        if earlier is None:
            raise ConfigError(f"--measured-from: {path} has no real runs of case {case['name']!r}; "
                              f"it has: {', '.join(by_name)}")
        # None: recorded before case_spec
        if earlier.get("case_spec") not in (None, jsonable(case)):
            raise ConfigError(f"--measured-from: case {case['name']!r} has changed since {path} "
                              "measured it")
    return {"cases": by_name, "repeats": last.get("repeats"), "device": last.get("device", "")}


def _sim_config(cfg, device_profile: str, dtype: str):
    return dataclasses.replace(cfg, executor="sim", device_profile=device_profile, dtype=dtype)


def _speed_probe(profile, dtype: str) -> Callable[[], dict[str, float]]:
    """Reruns calibration's speed probe (real steps of the first calibration model): the device's
    speed now relative to calibration, per probe point (1.0 = same; {} when the profile has no
    model-step probe, e.g. one calibrated before it existed)."""
    from batchsim.server.engine.session import open_session
    from batchsim.server.measure.calibration import probe_speed, speed_probe_ms

    cal = profile.calibration
    model = cal.calibrated_on[0] if cal and cal.calibrated_on else None
    calibrated = {k: v for k, v in (cal.speed_probe_ms if cal else {}).items()
                  if k.startswith(f"{model}:")}
    if not calibrated:
        err.print("this profile has no model-step speed probe; rerun `batchsim calibrate` "
                  "to see the device's drift beside each case", style="yellow")
        return dict
    s = open_session(RunConfig(model=model, dtype=dtype))

    def probe() -> dict[str, float]:
        return probe_speed(speed_probe_ms(model, s.model, s.spec, s.kv_bytes_per_token), calibrated)

    return probe


def _not_runnable(session) -> str | None:
    """Why the real executor cannot serve this model (one request whose prompt passes any
    sliding window, a few decode steps), or None."""
    from batchsim.workloads.lengths import LengthSpec
    from batchsim.workloads.spec import WorkloadSpec

    spec = WorkloadSpec(name="validate-probe", num_prompts=2, arrival="poisson",
                        request_rate=float("inf"), input_len=LengthSpec("fixed", value=160),
                        output_len=LengthSpec("fixed", value=4), seed=0)
    try:
        _run(session.with_config(dataclasses.replace(session.config, workload=spec)), None, "probe")
    except Exception as exc:  # noqa: BLE001 (any failure: report it and skip the cases)
        return f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"[:200]
    return None


def _run(session, out_dir: Path | None, label: str, on_step: Callable | None = None) -> dict:
    return stop_if_interrupted(run_stoppable(session, session.config.workload, out_dir=out_dir,
                                             label=label, on_step=on_step).summary)
