"""Speculative decoding against plain decoding on real weights, all requests queued at once, at
each batch limit and K, the runs of one batch limit interleaved (none, then each K and drafter,
then again) so drift hits every mode alike.

- n-gram drafts (default): the chat prompts, greedy or sampled (--temperature: the rejection rule).
- --draft-model M: drafts by model M (default the target itself), on synthetic prompts of
  --input-len tokens and --max-tokens out (EOS ignored: every run emits the same tokens), with
  each drafter of --drafters: `batched` (draft_model.py: every row in one forward per draft
  token) and `serial` (the drafter before commit 9556f86, one row at a time, kept below).
  --sim-profile P: each real run is also simulated (--executor sim --device-profile P, the run's
  own acceptance: --acceptance-from), and the table gives sim tok/s over real.

    .venv/bin/python benchmarks/spec_decode.py --batch 1,8,32 --spec-tokens 2,4,8 --reps 1
    .venv/bin/python benchmarks/spec_decode.py --batch 1,8 --spec-tokens 2,4 --temperature 0.8
    .venv/bin/python benchmarks/spec_decode.py --draft-model smollm2-135m-instruct --batch 1,4,8 \
        --spec-tokens 4 --sim-profile linux-x86_64-openblas-2core

Each run is `batchsim run` in-process (the same engine, records and summary); the table reports
acceptance (vLLM's keys), output tok/s and mean TPOT, each mode's median over --reps, and the
ratio to `none` at the same batch limit, with the 1-minute load average after each run (and with
--sim-profile the simulated mean TPOT, to compare with the real mean). Not part
of the test suite; the last stdout line is one JSON document."""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import statistics
import sys
import tempfile
from pathlib import Path
from typing import NamedTuple

from batchsim.server.platform import blas

blas.preload()  # before anything imports mlx (the serial drafter's draft_model), as the CLI does

KEYS = ("output_throughput", "mean_tpot_ms", "spec_decode_acceptance_rate",
        "spec_decode_acceptance_length", "num_steps", "output_tokens_sha256")


def workload_yaml(path: Path, num_prompts: int, max_tokens: int, temperature: float) -> Path:
    path.write_text(f"name: chat\nnum_prompts: {num_prompts}\narrival: poisson\n"
                    f"request_rate: inf\nchat:\n  prompts: chat.yaml\n"
                    f"  temperature: {temperature}\n"
                    f"  max_tokens: {max_tokens}\nseed: 0\n")
    return path


class Mode(NamedTuple):
    k: int  # drafted tokens a row verifies per step; 0: plain decoding
    drafter: str  # none, ngram, batched or serial

    @property
    def label(self) -> str:
        return "none" if not self.k else f"{self.drafter} K={self.k}"


def _cli(argv: list[str]) -> dict:
    from batchsim.scripts.cli import main

    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        rc = main(argv)
    if rc != 0:
        raise SystemExit(f"batchsim {' '.join(argv)} exited {rc}")
    return json.loads(buf.getvalue().strip().splitlines()[-1])


def run_once(workload: list[str], out: Path, batch: int, mode: Mode,
             args: argparse.Namespace) -> dict:
    k, drafter = mode
    argv = ["run", *workload, "--model", args.model, "--max-num-seqs", str(batch),
            "--out", str(out), "--no-progress", "--no-timeline"]
    if k:
        argv += ["--spec-tokens", str(k), "--spec-policy", args.policy]
        argv += (["--spec-method", "ngram"] if drafter == "ngram" else
                 ["--spec-method", "draft", "--draft-model", args.draft_model])
    t0 = os.times()
    with _serial_drafter(drafter == "serial"):
        s = _cli(argv)
    t1 = os.times()
    check_env(s["env"])
    s["cpu_s"] = t1.user + t1.system - t0.user - t0.system  # this process's CPU, all threads
    s["loadavg_1m"] = os.getloadavg()[0]
    if args.sim_profile:  # the same run simulated, at the acceptance the real run measured
        sim = argv[:argv.index("--out")] + argv[argv.index("--out") + 2:]
        accept = ["--acceptance-from", s["run_dir"]] if k else []
        priced = _cli([*sim, "--out", str(out), "--executor", "sim", "--device-profile",
                       args.sim_profile, *accept])
        s["sim_tok_s"], s["sim_tpot_ms"] = priced["output_throughput"], priced["mean_tpot_ms"]
    return s


def check_env(env: dict) -> None:
    """Refuses runs whose BLAS is unknown (mlx imported before blas.preload) while an optimized
    one is installed: their multi-token forwards (prefill, verify, draft feeding) ran on MLX's
    slow matmul path, and every ratio to plain decoding with them."""
    found = blas.optimized_paths()
    if env.get("blas") == "unknown" and found:
        raise SystemExit(f"spec_decode: not reported: the runs' BLAS is unknown "
                         f"({env.get('blas_note')}) while {found[0]} is installed; "
                         "call blas.preload() before anything imports mlx")


def main() -> None:
    args = _args()
    if args.propose_only:
        return propose_only(args)
    ks = [int(x) for x in args.spec_tokens.split(",")]
    drafters = args.drafters.split(",") if args.draft_model else ["ngram"]
    modes = [Mode(0, "none"), *(Mode(k, d) for k in ks for d in drafters)]
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for b in (int(x) for x in args.batch.split(",")):
            n = max(4, args.prompts_per_row * b)
            if args.draft_model:
                workload = ["--num-prompts", str(n), "--request-rate", "inf", "--input-len",
                            str(args.input_len), "--output-len", str(args.max_tokens)]
            else:
                workload = [str(workload_yaml(Path(tmp) / f"chat-{b}.yaml", n, args.max_tokens,
                                              args.temperature))]
            runs: dict[Mode, list[dict]] = {m: [] for m in modes}
            for rep in range(args.reps):
                for m in modes:
                    s = run_once(workload, Path(tmp) / "runs", b, m, args)
                    runs[m].append(s)
                    print(f"batch {b:3d} {m.label} rep {rep + 1}: {s['output_throughput']:.1f} "
                          f"tok/s, TPOT {s['mean_tpot_ms']:.1f} ms, acceptance "
                          f"{s.get('spec_decode_acceptance_rate', 0):.1f}%, load "
                          f"{s['loadavg_1m']:.1f}", file=sys.stderr)
            rows += _rows(b, runs, args)
    env = s["env"]
    _print(rows, env, args)
    print(json.dumps({"rows": rows, "env": env}))


def _args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--batch", default="1,8,32", help="batch limits (max_num_seqs)")
    p.add_argument("--spec-tokens", default="2,4,8", help="K values beside none")
    p.add_argument("--policy", default="fixed", choices=["fixed", "shrink"])
    p.add_argument("--reps", type=int, default=1, help="interleaved repetitions")
    p.add_argument("--prompts-per-row", type=int, default=1,
                   help="requests = max(4, this x batch limit)")
    p.add_argument("--max-tokens", type=int, default=96)
    p.add_argument("--model", default="smollm2-135m-instruct")
    p.add_argument("--temperature", type=float, default=0.0,
                   help="> 0: sampled rows (rejection sampling); tokens then differ from none")
    p.add_argument("--draft-model", default=None, metavar="M",
                   help="draft with model M instead of n-grams (synthetic prompts)")
    p.add_argument("--drafters", default="batched,serial",
                   help="with --draft-model: batched, serial or both")
    p.add_argument("--input-len", type=int, default=64, help="with --draft-model: prompt tokens")
    p.add_argument("--propose-only", action="store_true",
                   help="with --draft-model: time one drafting step alone, batched against serial "
                   "(interleaved, --reps each), rows of different lengths")
    p.add_argument("--asking", type=int, default=0, metavar="N",
                   help="with --propose-only: also time steps where N of the rows ask for "
                   "drafts (the real drafter drafts all it holds) against a drafter holding N")
    p.add_argument("--sim-profile", default=None, metavar="P",
                   help="also simulate each run on device profile P; report sim / real tok/s")
    args = p.parse_args()
    if not set(args.drafters.split(",")) <= {"batched", "serial"}:
        p.error("--drafters: batched, serial or both")
    return args


def _rows(b: int, runs: dict[Mode, list[dict]], args: argparse.Namespace) -> list[dict]:
    out = []
    none = runs[Mode(0, "none")]
    for mode, summaries in runs.items():
        row = {"batch_limit": b, "spec_tokens": mode.k, "drafter": mode.drafter,
               "policy": args.policy if mode.k else "none",
               "num_requests": summaries[0]["completed"], "reps": len(summaries)}
        for key in (*KEYS[:-1], "cpu_s", "loadavg_1m", "sim_tok_s", "sim_tpot_ms"):
            vals = [s.get(key, 0.0) for s in summaries]
            row[key] = statistics.median(vals)
        row["same_tokens_as_none"] = all(s["output_tokens_sha256"] ==
                                         none[0]["output_tokens_sha256"] for s in summaries)
        row["sim_over_real"] = statistics.median(
            s.get("sim_tok_s", 0.0) / s["output_throughput"] for s in summaries)
        out.append(row)
    base = out[0]
    for row in out:
        row["tok_s_vs_none"] = row["output_throughput"] / base["output_throughput"]
    return out


def _print(rows: list[dict], env: dict, args: argparse.Namespace) -> None:
    mode = f"temperature {args.temperature}" if args.temperature else "greedy"
    what = f"draft model {args.draft_model}" if args.draft_model else "n-gram, chat prompts"
    print(f"{what} speculation, {mode}, {args.model} {env.get('dtype')} ({env.get('backend')}, "
          f"{env.get('cpu')}, {env.get('cores')} cores, shared machine)")
    print("batch  K  drafter  reqs  accept%  accept_len  steps  tok/s   x none  TPOT ms  "
          "sim TPOT  CPU s  sim/real  load  same tokens")
    for r in rows:
        print(f"{r['batch_limit']:5d} {r['spec_tokens']:2d} {r['drafter']:>8s} "
              f"{r['num_requests']:5d} {r['spec_decode_acceptance_rate']:7.1f} "
              f"{r['spec_decode_acceptance_length']:10.2f} {r['num_steps']:6.0f} "
              f"{r['output_throughput']:6.1f} {r['tok_s_vs_none']:7.2f} {r['mean_tpot_ms']:8.1f} "
              f"{r['sim_tpot_ms']:9.1f} {r['cpu_s']:6.1f} {r['sim_over_real']:9.2f} "
              f"{r['loadavg_1m']:5.1f}  "
              f"{r['same_tokens_as_none']}")


def propose_only(args: argparse.Namespace) -> None:
    """Per batch B: rows of input_len/2 .. 3 input_len/2 tokens caught up by each drafter, then
    --reps drafting steps of K timed (each row took one token since, no draft kept), the cases
    interleaved; medians in ms. Cases: `batched` (every row asks K), `serial` (the drafter before
    9556f86), and with --asking N: `asking` (B rows held, the first N ask K, the rest 0: what
    the real drafter drafts then) against `only` (a drafter holding just those N rows: what
    drafting only the asking rows would cost); --sim-profile: the simulator's draft_s of B and
    of N rows beside them."""
    import random
    import time

    from batchsim.scheduler.pool_geometry import KV_STEP, PoolGeometry, round_up
    from batchsim.server.executors.draft_model import DraftModelDrafter
    from batchsim.server.models.loader import load, resolve

    model = load(resolve(args.draft_model, "float32"))[0]
    k, vocab = int(args.spec_tokens.split(",")[0]), model.args.vocab_size
    rng, rows = random.Random(0), []
    for b in (int(x) for x in args.batch.split(",")):
        seqs = [_Row([rng.randrange(vocab) for _ in range(rng.randint(
            args.input_len // 2, 3 * args.input_len // 2))]) for _ in range(b)]
        n = min(args.asking or b, b)
        cases = {"batched": (DraftModelDrafter(model), b, [k] * b),
                 "serial": (SerialDraftModelDrafter(model), b, [k] * b),
                 "asking": (DraftModelDrafter(model), b, [k] * n + [0] * (b - n)),
                 "only": (DraftModelDrafter(model), n, [k] * n)}
        cases = {c: v for c, v in cases.items()
                 if c in args.drafters.split(",") or (args.asking and c in ("asking", "only"))}
        geometry = PoolGeometry(b, round_up(3 * args.input_len // 2 + args.reps + k, KV_STEP))
        for d, m, _ in cases.values():
            d.resize(geometry)  # the target pool's, as the executor hands it
            d.propose(list(range(m)), seqs[:m], [k] * m)  # catch-up
        times: dict[str, list[float]] = {name: [] for name in cases}
        drafts: dict[str, list] = {}
        for _ in range(args.reps):
            for s in seqs:
                s.token_ids.append(rng.randrange(vocab))
            for name, (d, m, ks) in cases.items():
                t0 = time.perf_counter()
                drafts[name] = [x.tokens for x in d.propose(list(range(m)), seqs[:m], ks)]
                times[name].append(1e3 * (time.perf_counter() - t0))
        row = {"batch": b, "spec_tokens": k, "asking": n,
               **{f"{c}_ms": statistics.median(t) for c, t in times.items()},
               "loadavg_1m": os.getloadavg()[0]}
        if "asking" in cases:
            row["same_drafts"] = drafts["asking"][:n] == drafts["only"]
            row["sim_draft_ms"] = {r: _sim_draft_ms(args, r, k) for r in (b, n)}
        print(f"batch {b:3d} K {k}: " + ", ".join(
            f"{c} {row[f'{c}_ms']:.1f} ms" for c in cases) + f"; {row.get('sim_draft_ms', '')}"
            f" load {row['loadavg_1m']:.1f}", file=sys.stderr)
        rows.append(row)
    print(json.dumps({"rows": rows, "model": args.draft_model, "dtype": "float32"}))


def _sim_draft_ms(args: argparse.Namespace, rows: int, k: int) -> float | None:
    """The simulator's price of drafting K tokens for `rows` rows after input_len tokens
    (spec_price.draft_s on --sim-profile; None without one)."""
    if not args.sim_profile:
        return None
    from batchsim.server.models.loader import spec_for
    from batchsim.server.perf import spec_price
    from batchsim.server.perf.devices import resolve_profile
    from batchsim.server.perf.stepcost import StepCost

    draft = spec_for(args.draft_model)
    cost = StepCost(draft, resolve_profile(args.sim_profile), "float32", None)
    return 1e3 * spec_price.draft_s(spec_price.Drafter(cost, draft.name), rows, k,
                                    args.input_len)


class _Row:
    def __init__(self, token_ids: list[int]) -> None:
        self.token_ids = token_ids
        from batchsim.scheduler.request import SamplingParams

        self.sampling = SamplingParams(max_tokens=1 << 20)
        self.num_prompt_tokens = len(token_ids)


@contextlib.contextmanager
def _serial_drafter(on: bool):
    """The factory builds SerialDraftModelDrafter instead of the batched drafter while on."""
    from batchsim.server.executors import draft_model

    batched = draft_model.DraftModelDrafter
    if on:
        draft_model.DraftModelDrafter = SerialDraftModelDrafter
    try:
        yield
    finally:
        draft_model.DraftModelDrafter = batched


class SerialDraftModelDrafter:
    """The draft-model drafter before commit 9556f86, for comparison: each row drafts alone, k
    one-row forwards on its own mlx-lm caches (trimmed back to what the target kept), each draft
    read back to the host."""

    def __init__(self, model, kv_bits=None):  # kv_bits: the factory's; the benchmark sets none
        self.model = model
        self._held: dict[int, tuple[list, list[int]]] = {}  # rid -> (caches, tokens they hold)

    def propose(self, rids, seqs, ks):
        return [self._one(rid, s.token_ids, k, s.sampling) for rid, s, k in zip(rids, seqs, ks)]

    def _one(self, rid: int, token_ids: list[int], k: int, sampling):
        import mlx.core as mx
        from batchsim.server.executors import sampler
        from batchsim.server.executors.acceptance import KEY_DRAFT, position_key
        from batchsim.server.executors.draft_model import _common_prefix
        from batchsim.server.executors.speculative import Draft
        from mlx_lm.models.cache import make_prompt_cache, trim_prompt_cache

        if k <= 0:
            return Draft([])
        cache, held = self._held.get(rid) or (make_prompt_cache(self.model), [])
        same = _common_prefix(held, token_ids, len(token_ids) - 1)  # feed >= 1 token
        trim_prompt_cache(cache, len(held) - same)
        feed, drafts, probs = token_ids[same:], [], []
        for i in range(k):
            logits = self.model(mx.array([feed]), cache=cache)[:, -1]
            if sampling.temperature > 0:
                probs.append(sampler.probabilities(logits, [sampling]))
                key = position_key(sampling, rid, len(token_ids) + i, KEY_DRAFT)
                token = mx.random.categorical(mx.log(probs[-1]), key=key)
            else:
                token = mx.argmax(logits, axis=-1)
            drafts.append(int(token.item()))
            feed = drafts[-1:]
        self._held[rid] = (cache, token_ids + drafts[:-1])
        return Draft(drafts, mx.concatenate(probs) if probs else None)

    def forget(self, request_id: int) -> None:
        self._held.pop(request_id, None)

    # Its mlx-lm caches stay outside the memory account, as they were before the draft pool
    # joined it: the scheduler prices no draft rows beside this drafter, the executor counts none.
    cache = None
    nbytes = 0

    def resize(self, geometry) -> None:
        pass


if __name__ == "__main__":
    main()
