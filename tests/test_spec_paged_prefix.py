"""Speculative decoding in the paged layout with prefix caching, at the KV budget: a step whose
rows' drafted blocks no longer fit once the prefix cache has its blocks drafts nothing that step
(as StepBudget.fit_pool does), never plans a pool of no geometry (was a TypeError in the
scheduler's KV account: 'cannot unpack non-iterable NoneType object')."""

from __future__ import annotations

from batchsim.scheduler import step_budget
from batchsim.scripts.cli import main

from tests.cli_calls import last_json


def test_drafts_at_the_budget_with_paged_prefix_blocks_finish_every_request(tmp_path, capsys,
                                                                            monkeypatch):
    dropped = []  # steps whose drafts the cache's kept blocks left no room for
    fit_shared = step_budget.StepBudget._fit_shared_cache

    def watched(self, *args, **kwargs):
        k = self.spec_k
        plain = fit_shared(self, *args, **kwargs)  # (since 4ba3fbd, the plain prompts' blocks)
        dropped.extend([k] if k and not self.spec_k else [])
        return plain

    monkeypatch.setattr(step_budget.StepBudget, "_fit_shared_cache", watched)
    rc = main(["run", "--executor", "sim", "--device-profile", "M2", "--model", "llama-3.2-1b",
               "--kv-layout", "paged", "--prefix-cache", "on", "--workload", "shared-prompt",
               "--num-prompts", "40", "--request-rate", "inf", "--memory-gb", "2.6",
               "--spec-method", "ngram", "--spec-tokens", "3", "--acceptance", "0.5",
               "--no-progress", "--no-timeline", "--json", "--out", str(tmp_path)])
    summary = last_json(capsys.readouterr().out)
    assert rc == 0 and summary["completed"] == 40 and summary["kv_account_mismatches"] == 0
    assert summary["spec_decode_num_drafts"] > 0
    # the cache keeps what fits beside the pool without its drafted blocks counted twice (they
    # are in the pool's geometry already): its rows never lose their drafts to it
    assert dropped == []
