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
            assert result["inference_all_reduce"] == 3.0
            if rank == 1:
                assert result["full"] == {}  # the full dict is rank 0's; rank 1 took part in the gathers
    full_1, full_3 = by_stage[1][0]["full"], by_stage[3][0]["full"]
    assert full_1.keys() == full_3.keys() and full_1
    assert all(
        torch.equal(full_1[k], full_3[k]) for k in full_1
    )  # stage 3's gathered dict is stage 1's weights
    assert by_stage[3][0]["dtypes"] == ["torch.float16"]  # the training dtype, as DeepSpeed exports it


def test_load_module_state_dict_takes_whole_tensors_at_every_stage() -> None:
    cases_ = [(1, "bf16"), (3, "fp32"), (3, "bf16")]
    for case, ranks in zip(
        cases_, run_distributed_cases(cases.load_module_state, cases_, world_size=2, timeout=600)
    ):
        for result in ranks:
            assert result["matches"], (
                case
            )  # every rank's module holds the loaded values (its shard at stage 3)
            missing, unexpected, shape = result["errors"]
            assert "missing keys ['lm_head.weight']" in missing and "strict=False" in missing, case
            assert "unexpected keys ['extra']" in unexpected, case
            assert "'lm_head.weight' has shape (1, 32)" in shape, case
            # the masters followed the load: training equals an engine built on the loaded model
            assert result["same_training"] and result["same_params"], case


def test_empty_partition_cache() -> None:
    stage0, stage3 = run_distributed_cases(cases.partition_cache, [0, 3], world_size=2, timeout=600)
    for result in stage0:
        assert (
            result["between_windows"] == [] and result["after_release"] == []
        )  # nothing is ever partitioned
    for result in stage3:
        assert result["gathered_mid_window"], "the root unit stays gathered inside an accumulation window"
        assert (
            result["after_release"] == result["between_windows"]
        )  # released: every sharded parameter is a shard again
