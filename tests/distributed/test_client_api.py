"""What transformers and accelerate read from the engine and its optimizer, on 2 gloo ranks (issue 13)."""

from __future__ import annotations

import client_api_cases as cases
import pytest
import torch

from shardwise.testing import run_distributed_cases

pytestmark = pytest.mark.distributed


def test_client_reads_at_stages_1_and_3() -> None:
    by_stage = dict(zip((1, 3), run_distributed_cases(cases.client_reads, [1, 3], world_size=2, timeout=600)))
    for stage, ranks in by_stage.items():
        for rank, result in enumerate(ranks):
            assert result["pending"] == [1, 0, 1, 0, 1, 0], stage  # the mid-window warning's count
            assert result["overflow"] == [False, True, False], stage  # step 2 skipped on every rank
            assert result["stage_from_config"] == stage and result["fp16_in_config"]
            assert result["gather_on_save"] is True and result["steps_per_print"] is None
            assert result["accessors"] == (True, False, 0.0, 1)
            if rank == 1:
                assert result["full"] == {}  # the full dict is rank 0's; rank 1 took part in the gathers
    full_1, full_3 = by_stage[1][0]["full"], by_stage[3][0]["full"]
    assert full_1.keys() == full_3.keys() and full_1
    assert all(
        torch.equal(full_1[k], full_3[k]) for k in full_1
    )  # stage 3's gathered dict is stage 1's weights
    assert by_stage[3][0]["dtypes"] == ["torch.float16"]  # the training dtype, as DeepSpeed exports it
