"""PAGED_READ_RATIO (layer_cost.py, measured on the CPU) is charged only where the real executor
gathers blocks: the target's full and MLA layers in a paged pool."""

from __future__ import annotations

import pytest
from batchsim.server.models.spec import zoo_spec
from batchsim.server.perf import spec_price
from batchsim.server.perf.stepcost import StepCost

from tests.mac_costs import m2_ultra_cost


@pytest.fixture(scope="module")
def cost():
    return m2_ultra_cost()


def test_a_draft_model_beside_a_paged_target_pays_no_gather(cost):
    # The draft model keeps mlx-lm caches of its own (draft_model.py), never the paged pool.
    padded, paged = (StepCost(cost.spec, cost.profile, "float16", 4, paged=p) for p in (0, 1))
    draft = zoo_spec("llama-3.2-1b")
    by_layout = [spec_price.draft_s(spec_price.model_drafter(c, draft, "float16"), 8, 4, 2048)
                 for c in (padded, paged)]
    assert by_layout[0] == by_layout[1]
    # while the target's own decode read pays it
    assert paged.step_time(decode_rows=8, width=2048).attention_s > padded.step_time(
        decode_rows=8, width=2048).attention_s
