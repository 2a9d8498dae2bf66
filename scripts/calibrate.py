"""`batchsim calibrate`: measure this device and write a profile the simulator (`--executor sim`)
uses: bandwidth and matmul ceilings, a GEMM timing model, copy bandwidth, and the per-forward
terms fitted on real decode and prefill steps of calibration models."""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import time
from pathlib import Path
from typing import Any

from batchsim.configs import ConfigError
from batchsim.scripts.calibrate_view import held_out, print_fit, residuals
from batchsim.scripts.common import (
    DTYPE_HELP,
    add_field_argument,
    append_jsonl,
    err,
    out,
    positive_int,
    run_stoppable,
    stop_if_interrupted,
    str_list,
)
from batchsim.server.engine.run_config import DTYPES, RunConfig
from batchsim.server.perf.devices import LOCAL_NAME
from batchsim.workloads.lengths import LengthSpec
from batchsim.workloads.spec import WorkloadSpec

# Two depths separate per-layer from per-forward costs; three head shapes (3:1 GQA x 64, 2:1 x 16,
# 8:1 x 32) separate attention's cost per K/V byte from its cost per score. Qwen3-0.6B is there
# because linear layers are most of its steps, as they are of the models users simulate: fitted
# on the three small models alone, the one they left out with most weight time (SmolLM2) was
# predicted 14% fast (leave-one-model-out on the 02:43 calibration's samples).
# Other architectures' terms are measured alone (fixed_cost.py, expert_cost.py), so no step of an
# MoE model is fitted on: `--models` may name one, and its steps are then reported, not fitted.
DEFAULT_MODELS = ["smollm2-135m", "tiny", "gqa8-probe", "qwen3-0.6b"]
FULL = {"models": DEFAULT_MODELS, "batches": ["1", "2", "4", "8", "12", "16", "24", "32", "64"],
            "widths": ["128", "512", "1024"], "chunks": ["16", "64", "256", "512"],
            "starts": ["0", "512"],
            "reps": 5, "rounds": 3}
# --quick: fewer models, grid points and repeats (minutes instead of half an hour), then the fitted
# profile predicts a model it has not seen (QUICK_HELD_OUT) and reports that error.
QUICK = {"models": ["smollm2-135m", "tiny"], "batches": ["1", "2", "4", "8", "16", "32"],
             "widths": ["128", "512"], "chunks": ["16", "64", "256"], "starts": ["0", "512"],
             "reps": 2, "rounds": 1}
QUICK_GEMM_ROWS = (1, 2, 3, 4, 8, 12, 16, 24, 32, 48, 64, 128, 512)
QUICK_GEMM_SHAPES = ((512, 512), (1024, 1024), (2048, 2048), (576, 1536), (1536, 576),
                     (1024, 4096), (1024, 32768))
QUICK_HELD_OUT = "gqa8-probe"

# Of the device's memory, what one decode grid point's KV (private caches and pool) may hold.
KV_CAP_FRACTION = 0.3


def add_parser(p: argparse.ArgumentParser) -> None:
    p.add_argument("--quick", action="store_true",
                   help=f"a usable profile in minutes: models {','.join(QUICK['models'])}, a "
                        f"smaller grid, one round; then its error on {QUICK_HELD_OUT}, which it "
                        "did not see")
    p.add_argument("--models", type=str_list, default=None,
                   help=f"calibration models (keep validation models out of this list; default "
                        f"{','.join(DEFAULT_MODELS)})")
    add_field_argument(p, RunConfig, "dtype", DTYPE_HELP, choices=list(DTYPES), unset=False)
    p.add_argument("--name", default=LOCAL_NAME,
                   help="profile name (written to $BATCHSIM_HOME/devices)")
    p.add_argument("--profile-out", help="also write the profile YAML here")
    grid = {k: (",".join(v) if isinstance(v, list) else v) for k, v in FULL.items()}
    quick = {k: (",".join(v) if isinstance(v, list) else v) for k, v in QUICK.items()}

    def default(key: str) -> str:
        return f" (default {grid[key]}; --quick {quick[key]})"

    p.add_argument("--batches", type=str_list, default=None,
                   help="decode batch sizes of the step grid (rows)" + default("batches"))
    p.add_argument("--widths", type=str_list, default=None,
                   help="decode attention widths (context tokens)" + default("widths"))
    p.add_argument("--chunks", type=str_list, default=None,
                   help="prefill chunk sizes (tokens)" + default("chunks"))
    p.add_argument("--starts", type=str_list, default=None,
                   help="tokens before a prefill chunk (0, or multiples of 256 from 512)"
                   + default("starts"))
    p.add_argument("--reps", type=positive_int, default=None,
                   help="passes over the GEMM grid (median per point)" + default("reps"))
    p.add_argument("--rounds", type=positive_int, default=None,
                   help="passes over the step grid, round-robin over the models (median per "
                        "point)" + default("rounds"))
    p.add_argument("--out", default="results", help="directory for calibrate.jsonl")


@dataclasses.dataclass(frozen=True)
class _Ceilings:
    """This device's measured bandwidth, matmul and copy speed."""

    bandwidth_gbs: float
    gemm: Any  # calibration.GemmFit for the dtype
    peak_gflops: float
    copy_gbs: float
    quantized: Any = None  # quantized.QuantizedRates: 4/8-bit GEMV GB/s and GEMM GFLOP/s


def run(args: argparse.Namespace) -> dict:
    from batchsim.server.engine.session import open_session
    from batchsim.server.platform import env

    for key, value in (QUICK if args.quick else FULL).items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    if args.reps < 1 or args.rounds < 1:
        raise ConfigError(f"--reps and --rounds must be at least 1, got {args.reps} and "
                          f"{args.rounds}")
    bad = [x for x in args.starts
           if int(x) and (int(x) < max(512, *map(int, args.chunks)) or int(x) % 256)]
    if bad:  # a prefill reaches its start in one chunk of exactly that many tokens
        raise ConfigError(f"--starts: {bad[0]} must be 0 or a multiple of 256, at least 512 and "
                          "at least every chunk")
    dtype = env.default_dtype() if args.dtype == "auto" else args.dtype
    when, t0 = time.strftime("%Y-%m-%dT%H:%M:%S"), time.perf_counter()
    env_info = env.environment(dtype=dtype)
    err.print(f"calibrating {dtype} on {env_info['cpu']} ({env.backend()}, "
              f"BLAS {env_info['blas']})")
    ceilings = _measure_ceilings(dtype, args.reps, args.quick)
    pinned, alone = _measured_alone(args.quick, ceilings.bandwidth_gbs)  # before the models load
    sessions = {name: open_session(RunConfig(model=name, dtype=dtype)) for name in args.models}
    samples, probe_ms, drift = _step_grid(args, sessions)
    overhead_us, token_us, host_by_model = _engine_host_us(sessions)
    profile, terms, transfer = _fit(args, dtype, when, env_info, ceilings, sessions, samples,
                                    overhead_us, probe_ms, pinned, token_us)
    paths = _save(profile, args)
    rows = residuals(samples, sessions, profile, dtype)
    print_fit(rows, terms, ceilings.gemm, overhead_us, transfer)
    held = held_out(QUICK_HELD_OUT, args.name, dtype, profile) if args.quick else None
    errors = sorted(abs(r["error"]) for r in rows)
    q = ceilings.quantized
    summary = {"profile": str(paths[0]), "profile_paths": [str(p) for p in paths],
               "bandwidth_gbs": ceilings.bandwidth_gbs,
               "peak_gflops": {dtype: ceilings.peak_gflops},
               "copy_gbs": ceilings.copy_gbs, "terms": terms,
               "quantized_gemv_gbs": q.gemv_gbs, "quantized_gemm_gflops": q.gemm_gflops,
               "quantized_points": q.rows, "step_overhead_us": overhead_us,
               "step_overhead_us_by_model": {m: v[0] for m, v in host_by_model.items()},
               "host_token_us": token_us,
               "host_token_us_by_model": {m: v[1] for m, v in host_by_model.items()},
               "speed_probe_ms": probe_ms, "speed_drift": drift, "measured_alone": alone,
               "median_abs_err": errors[len(errors) // 2], "max_abs_err": errors[-1],
               "transfer_err": transfer, "samples": rows, "env": env_info}
    if held is not None:
        summary.update(quick=True, held_out=held, elapsed_s=time.perf_counter() - t0)
    append_jsonl(Path(args.out) / "calibrate.jsonl", [summary])
    out.print(f"profile written to {', '.join(str(p) for p in paths)}; use it with "
              f"`batchsim run --executor sim --device-profile {args.name}`", markup=False)
    return summary


def _measure_ceilings(dtype: str, reps: int, quick: bool = False) -> _Ceilings:
    import mlx.core as mx
    from batchsim.server.measure import calibration as cal
    from batchsim.server.measure import quantized
    from batchsim.server.measure.microbench import cache_limit, measure_bandwidth_gbs

    with cache_limit():  # as the executor runs: freed buffers reused, not re-faulted
        bandwidth = measure_bandwidth_gbs()
        grid = {"rows": QUICK_GEMM_ROWS, "shapes": QUICK_GEMM_SHAPES} if quick else {}
        gemm, gemm_samples = cal.measure_gemm(getattr(mx, dtype), reps=reps, log=err.print, **grid)
        copy_gbs = cal.measure_copy_gbs(reps)
    rates = quantized.measure_rates(dtype, bandwidth, reps=max(3, reps),
                                    max_s_per_point=3.0 if quick else 10.0, log=err.print)
    peak_gflops = max(2 * m * k * n / t for (m, k, n), t in gemm_samples.items()) / 1e9
    err.print(f"bandwidth {bandwidth:.1f} GB/s, peak {peak_gflops:.1f} GFLOP/s, "
              f"copy {copy_gbs:.1f} GB/s; quantized GEMV GB/s {rates.gemv_gbs}, "
              f"GEMM GFLOP/s {rates.gemm_gflops}")
    return _Ceilings(bandwidth, gemm, peak_gflops, copy_gbs, rates)


def _step_grid(args: argparse.Namespace, sessions: dict) -> tuple[list, dict, dict]:
    """Real decode and prefill steps over the grid, bracketed by the speed probe: the samples,
    the probe's reference timings and how the device's speed drifted meanwhile."""
    from batchsim.server.measure import calibration as cal
    from batchsim.server.measure.microbench import memory_budget_bytes

    first = args.models[0]
    probe_before = _probe(sessions[first], first)
    samples = cal.grid_samples(
        {n: (s.model, s.spec, cal.session_layout(s)) for n, s in sessions.items()},
        [int(b) for b in args.batches], [int(w) for w in args.widths],
        [int(c) for c in args.chunks],
        [int(x) for x in args.starts], rounds=args.rounds,
        max_kv_bytes=memory_budget_bytes(KV_CAP_FRACTION), log=err.print)
    probe_after = _probe(sessions[first], first)
    # The probe's reference: calibration's own grid medians at the probe points (three rounds
    # spread over the whole run), else the mean of the probe at the start and the end.
    probe_ms = cal.mean_by_key(probe_before, probe_after) | {
        cal.probe_key(x): x.seconds * 1e3 for x in samples
        if x.model == first and cal.is_probe_point(x)}
    drift = cal.probe_speed(probe_after, probe_before)
    if abs((cal.device_speed(drift) or 1.0) - 1) > 0.1:
        err.print("warning: the device's speed changed during calibration ("
                  + cal.format_speed(drift)
                  + "); another process or a busy host. Calibrate on a quiet machine.",
                  style="yellow")
    return samples, probe_ms, drift


def _measured_alone(quick: bool, bandwidth_gbs: float) -> tuple[dict[str, Any], dict[str, Any]]:
    """The terms measured alone and pinned: the per-layer fixed cost of a llama layer and of each
    other architecture's (fixed_cost.py) and what a routed (token, expert) pair costs, per pair
    and per multiply-add (expert_cost.py: mlx-lm's SwitchGLU, its weights streamed at
    `bandwidth_gbs`); and the timings they came from, for calibrate.jsonl."""
    from batchsim.server.measure import expert_cost, fixed_cost

    costs = fixed_cost.measure_all(reps=3 if quick else 9)
    pinned = fixed_cost.pinned_terms(costs)
    experts = expert_cost.measure(bandwidth_gbs, reps=3 if quick else 5)
    by_arch = ", ".join(f"{a} {us:.0f}" for a, us in pinned["layer_overhead_us_by_arch"].items())
    err.print(f"fixed costs: {pinned['layer_overhead_us']:.0f} us per llama layer ({by_arch}; bare "
              f"loop at batch {costs['dense'][0].batch}: {costs['dense'][0].forward_us:.0f} us per "
              f"forward pass, not pinned); routed experts (SwitchGLU): "
              f"{experts.ns_per_pair:.0f} ns per pair + {experts.ns_per_mac:.3f} ns per "
              "multiply-add")
    timings = {"layer_stacks": {a: [dataclasses.asdict(c) for c in cs] for a, cs in costs.items()},
               "switchglu_us": experts.rows()}
    return pinned | {"experts_ns_per_pair": experts.ns_per_pair,
                     "experts_ns_per_mac": experts.ns_per_mac}, timings


def _fit(args, dtype: str, when: str, env_info: dict, ceilings: _Ceilings, sessions: dict,
         samples: list, overhead_us: float, probe_ms: dict,
         pinned: dict[str, float] | None = None,
         host_token_us: float = 0.0) -> tuple[Any, dict, dict]:
    """The profile: measured ceilings, the measured fixed costs (`pinned`), the engine's host
    work per step and per token, and the other per-forward terms fitted on the step samples."""
    from batchsim.server.measure import calibration as cal
    from batchsim.server.measure import fixed_cost
    from batchsim.server.perf.profile import DeviceProfile
    from batchsim.server.perf.profile_match import device_id
    from batchsim.server.perf.stepcost import StepCost

    base = DeviceProfile(name=args.name, bandwidth_gbs=ceilings.bandwidth_gbs,
                         peak_tflops={dtype: ceilings.peak_gflops / 1e3}, bandwidth_efficiency=1.0,
                         compute_efficiency=1.0,
                         **_quantized_fields(ceilings.quantized))
    gemm = {dtype: ceilings.gemm}
    zero = cal.calibration_from(gemm, dict.fromkeys(cal.FORWARD_TERMS, 0.0), ceilings.copy_gbs,
                                0.0, args.models, when)
    costs0 = {n: StepCost(s.spec, _with(base, zero), dtype, None) for n, s in sessions.items()}
    # The forward terms' features (calibration._features) describe dense models; others: reported.
    dense = [s for s in samples if costs0[s.model].spec.is_dense]
    pinned = dict(pinned or {})
    experts = {k: pinned.pop(k, 0.0) for k in ("experts_ns_per_pair", "experts_ns_per_mac")}
    by_arch = pinned.pop("layer_overhead_us_by_arch", {})
    terms = cal.fit_forward_terms(dense, costs0, pinned)
    transfer = cal.transfer_errors(dense, {n: c for n, c in costs0.items() if c.spec.is_dense},
                                   pinned)
    calib = cal.calibration_from(gemm, terms, ceilings.copy_gbs, overhead_us, args.models, when,
                                 probe_ms, device=device_id(env_info))
    alone = [m for a in by_arch if (m := fixed_cost.ARCH_MODELS[a]) not in args.models]
    calib = dataclasses.replace(calib, layer_overhead_us_by_arch=by_arch,
                                calibrated_on=(*calib.calibrated_on, *alone),
                                host_token_us=host_token_us, **experts)
    terms.update({f"layer_overhead_us[{a}]": us for a, us in by_arch.items()}, **experts)
    profile = _with(base, calib, source=f"batchsim calibrate {when}: {env_info['cpu']}, "
                    f"{env_info['backend']}, BLAS {env_info['blas']}, "
                    f"models {', '.join(args.models)}")
    return profile, terms, transfer


def _quantized_fields(rates) -> dict[str, dict[int, float]]:
    """The profile's quantized ceilings from measure_rates (none measured: empty, the float
    ones)."""
    return {"quantized_gemv_gbs": dict(rates.gemv_gbs) if rates else {},
            "quantized_gemm_gflops": dict(rates.gemm_gflops) if rates else {}}


def _save(profile, args: argparse.Namespace) -> list[Path]:
    from batchsim.server.perf.devices import save_profile, user_dir

    paths = [save_profile(profile, user_dir() / f"{args.name}.yaml")]
    if args.profile_out:
        paths.append(save_profile(profile, Path(args.profile_out)))
    return paths


def _probe(session, name: str) -> dict[str, float]:
    from batchsim.server.measure import calibration as cal

    return cal.speed_probe_ms(name, session.model, session.spec, cal.session_layout(session))


def _with(profile, calibration, source: str | None = None):
    return dataclasses.replace(profile, calibration=calibration, source=source or profile.source)


def _engine_host_us(sessions: dict) -> tuple[float, float, dict[str, tuple[float, float]]]:
    """batchsim's engine host work (scheduling, hand-off to the executor thread and back,
    recording tokens): per step and per sampled token, each the median over the calibration
    models of `_engine_host_one_us`; and each model's pair, for calibrate.jsonl. One model's run
    alone swings 2x from run to run (368-970 us a step on SmolLM2-135M, 2-core EPYC VM) and it
    differs by model (~100 us on tiny's, ~550 us on Qwen3-0.6B's steps)."""
    import numpy as np

    by_model = {name: _engine_host_one_us(s) for name, s in sessions.items()}
    step_us, token_us = (float(np.median([v[i] for v in by_model.values()])) for i in (0, 1))
    return step_us, token_us, by_model


def _engine_host_one_us(session) -> tuple[float, float]:
    """(us per step, us per sampled token) of the engine's time between busy steps (their
    spacing minus the executor's time) on a short real run whose batch shrinks from 16 rows to 1
    (output lengths 1 to 48): the line's intercept and slope over the batch size, neither
    negative; with fewer than three batch sizes, the median gap and no per-token term."""
    import numpy as np

    spec = WorkloadSpec(name="calibrate-overhead", num_prompts=16, arrival="poisson",
                        request_rate=float("inf"), input_len=LengthSpec("fixed", value=16),
                        output_len=LengthSpec("uniform", min=1, max=48), seed=0)
    gaps = _busy_gaps(session, spec)
    if not gaps:
        return 0.0, 0.0
    rows, gap_s = np.asarray(gaps, dtype=float).T
    if len(set(rows)) < 3:
        return max(0.0, float(np.median(gap_s)) * 1e6), 0.0
    slope, intercept = np.polyfit(rows, gap_s, 1)
    if slope <= 0:  # no growth with the rows to measure: the step's cost is the median gap
        return max(0.0, float(np.median(gap_s)) * 1e6), 0.0
    if intercept < 0:  # the line through the origin
        return 0.0, float(rows @ gap_s / (rows @ rows)) * 1e6
    return float(intercept) * 1e6, float(slope) * 1e6


def _busy_gaps(session, spec: WorkloadSpec) -> list[tuple[int, float]]:
    """(batch size, seconds between the ends of two back-to-back steps less the later one's
    executor time) for each busy pair of steps of a real run of `spec`."""
    outcome = run_stoppable(session, spec, out_dir=None, label="calibrate")
    stop_if_interrupted(outcome.summary)  # Ctrl-C: no step overhead fitted on part of a run
    steps = outcome.steps
    return [(b.batch_size, b.end_s - a.end_s - b.compute_s) for a, b in itertools.pairwise(steps)
            if b.start_s - a.end_s < 0.005 and b.compute_s is not None]
