"""What `batchsim calibrate` shows of its fit: every step sample measured vs predicted, the fitted
terms, the leave-one-model-out errors, and (--quick) the fitted profile beside the shipped ones on
a model it did not see. The measuring and the fit live in calibrate.py and server.measure."""

from __future__ import annotations

from batchsim.scripts.common import err, out, table
from batchsim.server.engine.run_config import RunConfig


def residuals(samples: list, sessions: dict, profile, dtype: str) -> list[dict]:
    """Every sample, measured vs predicted by the fitted profile."""
    from batchsim.server.measure import calibration as cal
    from batchsim.server.perf.stepcost import StepCost

    costs = {n: StepCost(s.spec, profile, dtype, None) for n, s in sessions.items()}
    rows = [{"model": s.model, "kind": s.kind, "rows": s.rows, "context": s.context,
             "measured_s": s.seconds,
                 "predicted_s": cal.predict(s, costs[s.model])} for s in samples]
    for r in rows:
        r["error"] = r["predicted_s"] / r["measured_s"] - 1
    return rows


def held_out(name: str, profile_name: str, dtype: str, profile) -> dict:
    """The fitted profile on a model calibration did not see (a smaller grid, one round), beside
    every shipped profile on the same steps: what to expect of it on a new model. `name`: that
    model; `profile_name`: the fitted profile's."""
    from batchsim.server.engine.session import open_session
    from batchsim.server.measure import calibration as cal
    from batchsim.server.perf.devices import SHIPPED_DIR, load_profile
    from batchsim.server.perf.stepcost import StepCost

    s = open_session(RunConfig(model=name, dtype=dtype))
    err.print(f"held-out check: {name} decode steps and prefill chunks")
    samples = cal.grid_samples({name: (s.model, s.spec, cal.session_layout(s))},
                               [1, 4, 16], [128, 512], [64, 256], [0], rounds=1, log=err.print)
    shipped = {f"shipped {p.stem}": load_profile(p) for p in sorted(SHIPPED_DIR.glob("*.yaml"))}
    # A shipped profile calibrated in another dtype (the CPU one: float32) cannot price this one's.
    profiles = {profile_name: profile} | {k: p for k, p in shipped.items()
                                       if p.calibration is None or dtype in p.calibration.gemm}
    result = {label: cal.sample_errors(samples, {name: StepCost(s.spec, p, dtype, None)})
              for label, p in profiles.items()}
    out.print(table(f"Held-out check: step time on {name} (not used to calibrate), "
                    "predicted vs measured",
                    ["profile", "median |error| %", "median error %", "max |error| %"],
                    [[k, 100 * e["median_abs_err"], 100 * e["median_err"], 100 * e["max_abs_err"]]
                     for k, e in result.items()]))
    return {"model": name, "profiles": result}


def print_fit(rows: list[dict], terms: dict, gemm, overhead_us: float, transfer: dict) -> None:
    out.print(table("Calibration fit: executor step time, measured vs predicted",
                    ["model", "kind", "rows", "context", "measured ms", "predicted ms", "error %"],
                    [[r["model"], r["kind"], r["rows"], r["context"], r["measured_s"] * 1e3,
                      r["predicted_s"] * 1e3, 100 * r["error"]] for r in rows]))
    out.print(table("Fitted terms", ["metric", "value"],
                    [[k, v] for k, v in terms.items()]
                    + [[f"gemm ns/weight at {kn:,} weights",
                        ns] for kn, ns in sorted(gemm.weight_ns.items())]
                    + [[f"gemm ns/FLOP at m={m}", ns] for m, ns in sorted(gemm.flop_ns.items())]
                    + [["engine step_overhead_us", overhead_us]]))
    if transfer:
        out.print(table("Leave one model out: fit on the other models, error on this one (what to "
                        "expect on a model calibration has not seen)",
                        ["model left out", "median |error| %", "median error %"],
                        [[m, 100 * e["median_abs_err"],
                          100 * e["median_err"]] for m, e in transfer.items()]))
