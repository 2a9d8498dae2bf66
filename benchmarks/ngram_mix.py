"""Is n-gram acceptance falling with the batch, or with the prompts? Under greedy sampling a
speculative run emits plain decoding's tokens, and the n-gram drafter sees only a request's own
tokens, so a request's acceptance does not depend on the batch it ran in (only on steps whose
budget dropped speculation). This runs the chat prompts once without speculation, replays the
drafter and the greedy rule over each request's tokens (as row_spec_tokens caps drafts near
max_tokens), and reports acceptance over the first 4, 8, 32 ... prompts: the request sets that
benchmarks/spec_decode.py ran at batch limits 1, 8, 32 (max(4, batch) prompts).

    .venv/bin/python benchmarks/ngram_mix.py --num-prompts 32 --spec-tokens 2,4 --max-tokens 48

The last stdout line is one JSON document: per K and prompt count, vLLM's acceptance keys, the
per-position rates (a `--acceptance` list for `size` and simulated runs) and the draft share (how
often a row found an n-gram match at all: `--draft-share`)."""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path

from spec_decode import workload_yaml


def greedy_outputs(num_prompts: int, max_tokens: int, model: str) -> list[tuple[list, list]]:
    """(prompt ids, output ids) per request in arrival order, plain greedy decoding."""
    from batchsim.server.engine.run_config import RunConfig, with_run_overrides
    from batchsim.server.engine.runner import run_workload
    from batchsim.server.engine.session import open_session
    from batchsim.workloads.spec import load_workload

    seen: dict = {}

    def on_step(engine, plan, result) -> None:
        seen.update(engine.scheduler.requests)

    with tempfile.TemporaryDirectory() as tmp:
        spec = load_workload(workload_yaml(Path(tmp) / "chat.yaml", num_prompts, max_tokens))
    cfg = with_run_overrides(RunConfig(workload=spec), {}, model=model,
                             **{"scheduler.max_num_seqs": num_prompts})
    run_workload(open_session(cfg), spec, out_dir=None, label="ngram-mix", on_step=on_step)
    return [(list(r.prompt_token_ids), list(r.output_token_ids))
            for _, r in sorted(seen.items())]


def replay(prompt: list[int], output: list[int], k: int, max_tokens: int) -> list[tuple]:
    """(drafted, accepted) per decode step of one request (the greedy rule against its own
    output); drafted 0: no n-gram match, a plain decode step."""
    from batchsim.server.executors.speculative import ngram_proposal

    accepted, t = [], 1  # the prefill sampled output[0]
    while t < len(output):
        left = max_tokens - t - 1
        drafts = ngram_proposal(prompt + output[:t], min(k, max(left, 0)))
        n = 0
        while n < len(drafts) and t + n < len(output) and drafts[n] == output[t + n]:
            n += 1
        accepted.append((len(drafts), n))
        t += n + 1
    return accepted


def counts(all_steps: list[tuple[int, int]], k: int) -> dict:
    steps = [s for s in all_steps if s[0]]
    drafts = len(steps)
    drafted = sum(d for d, _ in steps)
    acc = sum(n for _, n in steps)
    return {"spec_decode_acceptance_rate": 100.0 * acc / drafted if drafted else 0.0,
            "spec_decode_acceptance_length": 1.0 + acc / drafts if drafts else 1.0,
            "spec_decode_num_drafts": drafts,
            "decode_steps": len(all_steps),  # rows' decode steps, drafting or not
            "draft_share": drafts / len(all_steps) if all_steps else 0.0,  # --draft-share
            "spec_decode_per_position_acceptance_rates": [
                sum(n > i for _, n in steps) / drafts if drafts else 0.0 for i in range(k)]}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--num-prompts", type=int, default=32)
    p.add_argument("--spec-tokens", default="2,4")
    p.add_argument("--max-tokens", type=int, default=48)
    p.add_argument("--model", default="smollm2-135m-instruct")
    args = p.parse_args()
    reqs = greedy_outputs(args.num_prompts, args.max_tokens, args.model)
    firsts = sorted({n for n in (4, 8, 16, 32, len(reqs)) if n <= len(reqs)})
    rows = []
    for k in (int(x) for x in args.spec_tokens.split(",")):
        per_req = [replay(pr, o, k, args.max_tokens) for pr, o in reqs]
        for n in firsts:
            row = {"spec_tokens": k, "prompts": n,
                   **counts([s for steps in per_req[:n] for s in steps], k)}
            rows.append(row)
            rates = ", ".join(f"{x:.2f}" for x in row["spec_decode_per_position_acceptance_rates"])
            print(f"K {k} first {n:3d} prompts: acceptance "
                  f"{row['spec_decode_acceptance_rate']:5.1f}%, length "
                  f"{row['spec_decode_acceptance_length']:.2f}, drafted in "
                  f"{row['spec_decode_num_drafts']}/{row['decode_steps']} steps, per position "
                  f"{rates}")
    print(json.dumps({"rows": rows, "max_tokens": args.max_tokens, "model": args.model}))


if __name__ == "__main__":
    main()
