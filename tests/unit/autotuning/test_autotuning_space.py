"""The tuning space: stages, the micro batch ladder, gradient accumulation, fast mode, lists."""

from __future__ import annotations

import pytest

from shardwise.autotuning.space import Candidate, build_space, micro_batch_ladder, spread
from shardwise.config import load_config


def _settings(**block: object):
    return load_config({"train_micro_batch_size_per_gpu": 1, "autotuning": block}).config.autotuning


def test_ladder_is_powers_of_two_with_both_ends() -> None:
    assert micro_batch_ladder(1, 16) == [1, 2, 4, 8, 16]
    assert micro_batch_ladder(3, 20) == [3, 4, 8, 16, 20]
    assert micro_batch_ladder(5, 4) == []
    assert spread([1, 2, 4, 8, 16, 32, 64], 4) == [1, 4, 16, 64]


def test_no_stage_means_all_stages_and_fast_tunes_micro_batch_only() -> None:
    space = build_space({}, _settings(max_train_micro_batch_size_per_gpu=4), dp_size=2)
    assert space.stages == (0, 1, 2, 3)
    assert space.micro_batches == (1, 2, 4)
    assert [c.name for c in space.candidates(2)] == ["z2_mbs1_gas1", "z2_mbs2_gas1", "z2_mbs4_gas1"]


def test_outside_fast_mode_stages_1_to_3_try_overlap_and_buckets() -> None:
    space = build_space(
        {"zero_optimization": {"stage": 1}}, _settings(fast=False, max_train_micro_batch_size_per_gpu=1), 2
    )
    assert space.stages == (1,)
    assert {c.zero_extra for c in space.candidates(1)} == {
        (("overlap_comm", a), ("reduce_bucket_size", b)) for a in (True, False) for b in (5e7, 5e8)
    }


def test_config_lists_are_the_space_and_fast_keeps_their_first_value() -> None:
    base = {"zero_optimization": {"stage": [2, 0], "reduce_bucket_size": [1e6, 1e7]}}
    slow = build_space(base, _settings(fast=False, max_train_micro_batch_size_per_gpu=1), 2)
    assert slow.stages == (0, 2) and len(slow.candidates(2)) == 2
    fast = build_space(base, _settings(max_train_micro_batch_size_per_gpu=1), 2)
    (only,) = fast.candidates(0)
    assert only.ds_config(base, 2)["zero_optimization"] == {"stage": 0, "reduce_bucket_size": 1e6}


def test_max_train_batch_size_caps_micro_batch_and_sets_accumulation() -> None:
    space = build_space(
        {}, _settings(max_train_batch_size=32, max_train_micro_batch_size_per_gpu=64), dp_size=2
    )
    assert space.micro_batches == (1, 2, 4, 8, 16)
    assert dict(space.grad_accum) == {1: 16, 2: 8, 4: 4, 8: 2, 16: 1}
    config = Candidate(1, 4, 4).ds_config({"train_batch_size": 999}, 2)
    assert (config["train_batch_size"], config["gradient_accumulation_steps"]) == (32, 4)


def test_offload_candidate_gets_optimizer_and_stage3_param_offload() -> None:
    base = {"zero_optimization": {"offload_optimizer": {"device": "nvme", "nvme_path": "/x"}}}
    assert "offload_optimizer" not in Candidate(3, 1, 1).ds_config(base, 1)["zero_optimization"]
    zero = Candidate(3, 1, 1, offload=True).ds_config(base, 1)["zero_optimization"]
    assert zero["offload_optimizer"] == {"device": "nvme", "nvme_path": "/x"}
    assert zero["offload_param"] == {"device": "cpu"}


def test_bad_stage_and_empty_micro_batch_range_name_the_key() -> None:
    with pytest.raises(ValueError, match=r"zero_optimization\.stage = \[1, 4\]"):
        build_space({"zero_optimization": {"stage": [1, 4]}}, _settings(), 1)
    with pytest.raises(ValueError, match="min_train_micro_batch_size_per_gpu = 8"):
        build_space({}, _settings(min_train_micro_batch_size_per_gpu=8, max_train_batch_size=4), 1)
