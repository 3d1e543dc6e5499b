"""``managed_gradient_accumulation: false`` (DeepSpeed's caller-owned accumulation, spec 7.5) at ZeRO
stages 0-3 on 2 gloo ranks: windows of 2, 3, 1 and 2 micro batches, each ended by ``step()``, train
exactly as the managed engine does when the boundary is forced on each window's last micro batch.

Exact by construction (fp32): both modes divide every loss by ``gradient_accumulation_steps``,
accumulate the same micro batches' gradients in the same order and reduce their sums once per window
(stages 0-1 at the unmanaged ``step()`` instead of in the last backward; stages 2-3 every micro
step in both), so the parameters are compared bit for bit. At stage 3 the units the window kept
gathered must be resharded before the next forward, or it would compute with the old weights.
"""

from __future__ import annotations

import pytest
import torch
from unmanaged_accumulation_cases import GAS, WINDOWS, run

from shardwise.testing import run_distributed_cases

pytestmark = pytest.mark.distributed

STAGES = (0, 1, 2, 3)


@pytest.fixture(scope="module")
def runs() -> dict[tuple[int, bool], list[dict]]:
    cases = [{"stage": stage, "unmanaged": unmanaged} for stage in STAGES for unmanaged in (False, True)]
    results = run_distributed_cases(run, cases, world_size=2, timeout=600)
    return {(c["stage"], c["unmanaged"]): r for c, r in zip(cases, results, strict=True)}


@pytest.mark.parametrize("stage", STAGES)
def test_unmanaged_windows_train_like_forced_boundaries(runs: dict, stage: int) -> None:
    for managed, unmanaged in zip(runs[(stage, False)], runs[(stage, True)], strict=True):
        assert unmanaged["loss"] == managed["loss"]
        for name, value in managed["params"].items():
            assert torch.equal(unmanaged["params"][name], value), name
        # one optimizer step per window; samples: (train_batch_size / GAS) per backward
        train_batch = 4 * GAS * 2
        assert unmanaged["counters"] == (len(WINDOWS), train_batch // GAS * sum(WINDOWS), False)
        assert managed["counters"] == (len(WINDOWS), train_batch * len(WINDOWS), True)
        # between backwards no micro batch is the boundary: step() is
        assert unmanaged["boundaries"] == [False] * sum(WINDOWS)
        assert "managed_gradient_accumulation=false" in unmanaged["refused"]
    first = runs[(stage, False)][0]["loss"]
    assert first[-1] < first[0]  # it trains
