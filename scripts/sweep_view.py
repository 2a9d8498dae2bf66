"""What `batchsim sweep` shows: its opening line, the table and verdict on the console, and the
plot of decode tok/s and KV bytes against batch (scripts/sweep.py runs the points)."""

from __future__ import annotations

import math
from pathlib import Path

from batchsim.scripts import sweep_spec, sweep_workload
from batchsim.scripts.common import fmt, out, pyplot, save_figure, table
from batchsim.server.perf import sweep_limits as sweep_math
from batchsim.server.platform.units import MIB, bytes_text
from batchsim.server.results.timeline import run_title


def what(meta: dict) -> str:
    """The model, its weights and where it ran, as run's header and timeline.png name them."""
    return run_title(meta["model"], meta["dtype"], meta.get("quantize_bits"), meta["executor"],
                     meta.get("device_profile"), meta.get("engine"), meta.get("env"))


def announce(meta: dict, batches: list[int]) -> None:
    lengths = (f"{meta['prompt_len']} + {meta['output_len']} tokens per request"
               if meta["workload"] is None else f"workload {meta['workload']} "
               f"({meta['num_prompts']} requests, the longest {meta['longest_prompt_len']} + "
               f"{meta['longest_output_len']} tokens)")
    out.print(f"batchsim sweep: {what(meta)}, {lengths}, budget "
              f"{bytes_text(meta['memory_budget_bytes'])} ({meta['budget_source']}): weights "
              f"{meta['weight_bytes'] / MIB:.1f} MiB + KV {meta['kv_bytes_per_seq'] / MIB:.2f} MiB "
              f"per sequence; batches {', '.join(map(str, batches))}")


def _status(row: dict) -> str:
    flags = [k for k in ("rejected", "preempted", "queued") if row[k]]
    return ", ".join(flags) or "ok"


def print_sweep(rows: list[dict], meta: dict, verdict: dict) -> None:
    ks = [e["spec_tokens"] for e in rows[0].get("spec", [])]
    out.print(table(
        f"Sweep: {what(meta)}, context {sweep_workload.context(meta)}, budget "
        f"{bytes_text(meta['memory_budget_bytes'])}",
        ["batch", "fits", "decoded", "decode tok/s", "step ms", "TPOT ms", "out tok/s",
         "KV MiB sched / exec", "KV MiB analytic", "active / peak MiB", "waits", "status",
         *[f"K={k} x plain" for k in ks]],
        [[r["batch"], "yes" if r["fits_analytic"] else "no", r["decoded_batch"], r["decode_tok_s"],
          r["step_ms"], r["median_tpot_ms"], r["output_throughput"],
          f"{fmt(r['kv_bytes'] / MIB)} / {fmt(_mib(r['kv_bytes_measured']))}",
          r["kv_bytes_analytic"] / MIB,
          f"{fmt(_mib(r['active_memory_bytes']))} / {fmt(_mib(r['peak_memory_bytes']))}",
          r["memory_wait_steps"], _status(r),
          *[sweep_spec.gain_cell(e) for e in r.get("spec", [])]]
         for r in rows],
    ))
    if ks:
        stops, said = verdict["spec_break_even_batch"], verdict["spec_break_even"]
        out.print(f"K=k x plain: speculation ({rows[0]['spec'][0]['spec_policy']} K) over plain "
                  "batching at the same batch, in decode tok/s (rows x acceptance length / "
                  "median verify step); stops paying at batch "
                  + ", ".join(f"{fmt(stops[str(k)])} (K={k}: {said[str(k)]})" for k in ks) + ".")
        if any(e["overrun"] for r in rows for e in r["spec"]):
            out.print(sweep_spec.OVERRUN_NOTE)
    if "spec_analytic_max_batch" in verdict:
        out.print(f"With the draft model's weights and its row beside each sequence, the "
                  f"analytic limit is batch {verdict['spec_analytic_max_batch']}.")
    agree = "agree" if verdict["agree_within_one_step"] else "DISAGREE"
    out.print(
        f"Analytic limit: batch {verdict['analytic_overrun_batch']} (weights + B x "
        f"{meta['seq_kv_tokens']} tokens x {meta['kv_bytes_per_token']} B fit); first listed "
        f"overrun {fmt(verdict['analytic_first_overrun_batch'])}. Measured overrun (first batch "
        f"{_overrun_means(meta)}, or preempted): {fmt(verdict['measured_overrun_batch'])}: {agree} "
        f"within one step. Throughput stopped scaling at {fmt(verdict['scaling_stopped_batch'])}.")
    if meta["budget_source"].startswith("--limit-batch"):
        out.print(f"The budget is emulated ({meta['budget_source']}: the sweep ends in minutes); "
                  f"the device's own, {bytes_text(meta['device_budget_bytes'])} for weights + KV, "
                  "holds "
                  f"{meta['device_analytic_max_batch']} sequences of these lengths by the same "
                  "arithmetic (--device-budget sweeps it).")
    out.print("decoded: largest batch decoded in one step; decode tok/s and step ms: median over "
              "pure-decode steps of that batch; waits: steps after which requests waited with a "
              "seat and token budget free (held back by KV memory); active: MLX's active bytes "
              "after a step (mlx); peak: MLX's peak, activations included (mlx), else weights + "
              "peak KV.")
    if meta["workload"] is not None:
        return
    width = sweep_math.mean_decode_width(meta["prompt_len"], meta["output_len"])
    out.print(f"Pure-decode steps read {width:g} tokens per row on average (prompt + output / 2): "
              f"`batchsim size --context {width:g}` predicts the simulator's decode tok/s at that "
              "context from the same step cost.")


def _overrun_means(meta: dict) -> str:
    if meta["workload"] is None:
        return "not decoded together"
    return "not decoded together while requests waited with a seat free"


def _mib(nbytes: int | None) -> float | None:
    return None if nbytes is None else nbytes / MIB


def plot(rows: list[dict], meta: dict, verdict: dict, path: Path) -> Path:
    """Decode tok/s and KV bytes against batch, the analytic limit and the measured overrun."""
    plt = pyplot()

    batches = [r["batch"] for r in rows]
    fig, (ax_t, ax_k) = plt.subplots(1, 2, figsize=(12, 4.5))
    ax_t.plot(batches, [r["decode_tok_s"] or math.nan for r in rows], "o-", label="decode tok/s")
    ax_t.set_ylabel("decode tok/s (steady state)")
    if verdict["scaling_stopped_batch"] is not None:
        ax_t.axvline(verdict["scaling_stopped_batch"], color="gray", ls=":",
                     label="stopped scaling")
    for key, label in (("kv_bytes", "scheduler peak"), ("kv_bytes_measured", "executor peak"),
                       ("kv_bytes_analytic", "analytic (full length)")):
        style = "s:" if key == "kv_bytes_measured" else "o-"
        ax_k.plot(batches, [(r[key] or math.nan) / MIB for r in rows], style, label=label,
                  ms=4 if key == "kv_bytes_measured" else 6)
    ax_k.axhline(meta["kv_budget_bytes"] / MIB, color="gray", ls=":", label="KV budget")
    ax_k.set_ylabel("KV MiB")
    measured = verdict["measured_overrun_batch"]
    for ax, key in ((ax_t, "decode_tok_s"), (ax_k, "kv_bytes")):
        ax.axvline(verdict["analytic_overrun_batch"], color="red", ls="--", label="analytic limit")
        if measured is not None:
            row = next(r for r in rows if r["batch"] == measured)
            y = (row[key] or 0) / (MIB if key == "kv_bytes" else 1)
            ax.plot([measured], [y], "X", color="black", ms=12, label="measured overrun")
        ax.set_xscale("log", base=2)
        ax.set_xticks(batches, [str(b) for b in batches], fontsize=7, rotation=90)
        ax.set_xlabel("batch (requests at once, max_num_seqs)")
        ax.legend(fontsize=8)
    fig.suptitle(f"{what(meta)}: context {sweep_workload.context(meta)}, budget "
                 f"{bytes_text(meta['memory_budget_bytes'])} ({meta['budget_source']})")
    return save_figure(fig, path)
