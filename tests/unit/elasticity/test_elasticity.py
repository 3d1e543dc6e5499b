"""Elastic batch sizing (spec section 10): v0.1/v0.2 algorithms, compute_elastic_config, validation."""

from __future__ import annotations

import json
import logging
import re
from typing import Any

import pytest

from shardwise.elasticity import (
    HCN_LIST,
    ElasticityConfig,
    ElasticityConfigError,
    ElasticityError,
    ElasticityIncompatibleWorldSize,
    check_scheduler_elastic_config,
    compute_elastic_config,
    elastic_batch_for_world_size,
    get_compatible_gpus_v01,
    get_compatible_gpus_v02,
    reject_explicit_batch_keys,
)
from shardwise.utils.logging import logger

# Verified against DeepSpeed 0.19.6 (spec 10.2).
GPUS_1680 = [1, 2, 3, 4, 5, 6, 7, 8, 10, 12, 14, 15, 20, 21, 24, 28, 30, 35, 40, 42, 56, 60, 70, 84, 105, 120,
             140, 168, 210, 280, 420, 840]  # fmt: skip


def _cfg(**block: Any) -> dict[str, Any]:
    return {"elasticity": {"enabled": True, **block}}


V01 = _cfg(max_train_batch_size=2000, micro_batch_sizes=[2, 4, 6], min_gpus=1, max_gpus=10000, version=0.1)
V02 = _cfg(
    max_train_batch_size=1000, micro_batch_sizes=[8, 12], min_gpus=32, max_gpus=1500, num_gpus_per_node=8
)


# ---------------------------------------------------------------- v0.1


def test_hcn_list_shape() -> None:
    assert len(HCN_LIST) == 38
    assert list(HCN_LIST) == sorted(set(HCN_LIST))
    assert HCN_LIST[:8] == (1, 2, 4, 6, 12, 24, 36, 48) and HCN_LIST[-1] == 720720


def test_v01_spec_example() -> None:
    batch, gpus = get_compatible_gpus_v01([2, 4, 6], 2000, min_gpus=1, max_gpus=10000)
    assert batch == 1680
    assert gpus == GPUS_1680
    assert len(gpus) == 32


def test_v01_max_gpus_64_keeps_batch_and_truncates_counts() -> None:
    batch, gpus = get_compatible_gpus_v01([2, 4, 6], 2000, min_gpus=1, max_gpus=64)
    assert batch == 1680
    assert gpus == [g for g in GPUS_1680 if g <= 64]
    assert gpus[-1] == 60


def test_v01_defaults_give_the_same_answer() -> None:
    # Default max_gpus is 2000 // 2 = 1000, above every count in the list.
    assert get_compatible_gpus_v01([2, 4, 6], 2000) == (1680, GPUS_1680)
    assert get_compatible_gpus_v01([6, 2, 4], 2000) == (1680, GPUS_1680)


def test_v01_corpus_config() -> None:
    # From a real config (ms-swift docs): max 8, micro batches [4, 2], 1..4 GPUs.
    # Candidates: 4*2 and 2*4 -> 8 only. 8/4 = 2 -> {2, 1}; 8/2 = 4 -> {4, 1, 2}.
    assert get_compatible_gpus_v01([4, 2], 8, 1, 4) == (8, [1, 2, 4])


def test_v01_tie_goes_by_prefer_larger_and_skips_bases_above_max() -> None:
    # lcm 12 > 10 is skipped. Candidates 2*3 = 6 and 2*4 = 8 both run on {1, 2} (default max_gpus 10 // 3 = 3).
    assert get_compatible_gpus_v01([3, 4], 10) == (8, [1, 2])
    assert get_compatible_gpus_v01([3, 4], 10, prefer_larger=False) == (6, [1, 2])


def test_v01_base_equal_to_max_and_hcn_beyond_list() -> None:
    assert get_compatible_gpus_v01([8], 8) == (8, [1])
    batch, gpus = get_compatible_gpus_v01([1], 2_000_000, max_gpus=10)
    assert batch == 720720  # max // 1 is past the last HCN, so the last one is used
    assert gpus == [g for g in range(1, 11) if 720720 % g == 0]


def test_v01_errors() -> None:
    with pytest.raises(ElasticityConfigError, match="<= max_train_batch_size"):
        get_compatible_gpus_v01([2, 4096], 2000)
    with pytest.raises(ElasticityConfigError, match=r"No GPU count in \[5000, 6000\]"):
        get_compatible_gpus_v01([2, 4, 6], 2000, min_gpus=5000, max_gpus=6000)
    with pytest.raises(ElasticityConfigError, match="positive integers"):
        get_compatible_gpus_v01([0, 2], 2000)


# ---------------------------------------------------------------- v0.2


def test_v02_spec_example() -> None:
    assert get_compatible_gpus_v02([8, 12], 1000, 64, 32, 1500, True, 8, 1) == (768, [32, 48, 64, 96], 12)


def test_v02_world_size_outside_valid_list_fits_batch_to_it() -> None:
    # dp 40: floor(1000/320)*320 = 960 and floor(1000/480)*480 = 960; 960/40 = 24 -> 8 and 12 fit, larger wins.
    assert get_compatible_gpus_v02([8, 12], 1000, 40, 32, 1500, True, 8, 1) == (960, [40], 12)
    # dp 24: 5*192 = 960 (m=8) and 3*288 = 864 (m=12).
    assert get_compatible_gpus_v02([8, 12], 1000, 24, 32, 1500, True, 8, 1) == (960, [24], 8)
    assert get_compatible_gpus_v02([8, 12], 1000, 24, 32, 1500, False, 8, 1) == (864, [24], 12)


def test_v02_micro_batch_first_in_list_order_unless_prefer_larger() -> None:
    # dp 40 -> 960/40 = 24: both 12 and 8 divide; list order [12, 8] vs largest.
    assert get_compatible_gpus_v02([12, 8], 1000, 40, 32, 1500, False, 8, 1)[2] == 12
    assert get_compatible_gpus_v02([8, 12], 1000, 40, 32, 1500, False, 8, 1)[2] == 8


def test_v02_model_parallel() -> None:
    # 4 dp ranks per node: node-level v0.1 on max 250 over 4..187 nodes gives 192 on [4, 6, 8, 12, 16, 24].
    assert get_compatible_gpus_v01([8, 12], 250, 4, 187) == (192, [4, 6, 8, 12, 16, 24])
    assert get_compatible_gpus_v02([8, 12], 1000, 64, 32, 1500, True, 8, 2) == (
        768,
        [16, 24, 32, 48, 64, 96],
        12,
    )


def test_v02_errors() -> None:
    with pytest.raises(ElasticityConfigError, match="multiple of model_parallel_size"):
        get_compatible_gpus_v02([8], 1000, 64, 32, 1500, True, 8, 3)
    with pytest.raises(ElasticityIncompatibleWorldSize, match="multiple of model_parallel_size"):
        get_compatible_gpus_v02([8], 1000, 63, 32, 1500, True, 8, 2)
    with pytest.raises(ElasticityIncompatibleWorldSize, match="too large"):
        get_compatible_gpus_v02([8, 12], 1000, 200, 32, 1500, True, 8, 1)
    with pytest.raises(ElasticityConfigError, match="per node"):
        get_compatible_gpus_v02([200], 1000, 8, 8, 64, True, 8, 1)
    with pytest.raises(ElasticityConfigError, match="No node count"):
        get_compatible_gpus_v02([8], 1000, 8, 1, 4, True, 8, 1)


# ---------------------------------------------------------------- compute_elastic_config


def test_compute_v01_without_and_with_world_size() -> None:
    assert compute_elastic_config(V01) == (1680, GPUS_1680)
    assert compute_elastic_config(V01, world_size=8, return_microbatch=True) == (1680, GPUS_1680, 6)
    assert compute_elastic_config(V01, 8, True, target_deepspeed_version="0.19.6") == (1680, GPUS_1680, 6)
    # 1680 // 280 = 6 -> largest micro batch dividing it is 6; 1680 // 840 = 2 -> 2.
    assert compute_elastic_config(V01, world_size=280, return_microbatch=True)[2] == 6
    assert compute_elastic_config(V01, world_size=840, return_microbatch=True)[2] == 2


def test_compute_v01_incompatible_world_size() -> None:
    with pytest.raises(ElasticityIncompatibleWorldSize, match="World size 9"):
        compute_elastic_config(V01, world_size=9)
    with pytest.raises(ElasticityConfigError, match="needs world_size"):
        compute_elastic_config(V01, return_microbatch=True)


def test_compute_v02_example_and_world_size_from_env(monkeypatch: pytest.MonkeyPatch) -> None:
    assert compute_elastic_config(V02, world_size=64, return_microbatch=True) == (768, [32, 48, 64, 96], 12)
    monkeypatch.setenv("WORLD_SIZE", "64")
    assert compute_elastic_config(V02, return_microbatch=True) == (768, [32, 48, 64, 96], 12)
    monkeypatch.delenv("WORLD_SIZE")
    with pytest.raises(ElasticityConfigError, match="WORLD_SIZE"):
        compute_elastic_config(V02)


def test_compute_v02_micro_batch_is_the_largest_that_fits() -> None:
    cfg = _cfg(**{**V02["elasticity"], "prefer_larger_batch": False})
    # Batch 864 on dp 24 (min candidate); 864/24 = 36 -> 12 fits, 8 does not.
    assert compute_elastic_config(cfg, world_size=24, return_microbatch=True) == (864, [24], 12)
    # Batch 960 on dp 40: the algorithm picks 8 (list order) but compute_elastic_config returns the largest.
    assert compute_elastic_config(cfg, world_size=40, return_microbatch=True) == (960, [40], 12)


def test_compute_errors() -> None:
    with pytest.raises(ValueError, match="must be a dict"):
        compute_elastic_config([1, 2])  # type: ignore[call-overload]
    with pytest.raises(ElasticityConfigError, match="no 'elasticity' block"):
        compute_elastic_config({"train_batch_size": 8})
    with pytest.raises(ElasticityConfigError, match="disabled"):
        compute_elastic_config({"elasticity": {"enabled": False}})
    with pytest.raises(ElasticityConfigError, match="world_size"):
        compute_elastic_config(V01, world_size=-1)
    with pytest.raises(ElasticityConfigError, match="world_size"):
        compute_elastic_config(V01, "0.19.6")  # type: ignore[call-overload]
    assert issubclass(ElasticityIncompatibleWorldSize, ElasticityError)
    assert issubclass(ElasticityConfigError, ElasticityError) and issubclass(ElasticityError, ValueError)


def test_elastic_batch_for_world_size() -> None:
    assert elastic_batch_for_world_size(V01, 8) == (1680, 6, 35)
    assert elastic_batch_for_world_size(V01, 840) == (1680, 2, 1)
    assert elastic_batch_for_world_size(V02, 64) == (768, 12, 1)
    assert elastic_batch_for_world_size(V02, 32) == (768, 12, 2)
    mp2 = _cfg(**{**V02["elasticity"], "model_parallel_size": 2})
    assert elastic_batch_for_world_size(mp2, 64) == (768, 12, 2)  # dp 32: 768 / (12 * 32)
    with pytest.raises(ElasticityConfigError, match="positive integer"):
        elastic_batch_for_world_size(V01, 0)
    for tbs, mbs, world in ((1680, 6, 8), (768, 12, 64)):
        assert tbs % (mbs * world) == 0


# ---------------------------------------------------------------- validation


def test_defaults_table() -> None:
    config = ElasticityConfig.from_dict({})
    assert config == ElasticityConfig(
        enabled=False, max_train_batch_size=2000, micro_batch_sizes=(2, 4, 6), min_gpus=1, max_gpus=10000,
        num_gpus_per_node=1, model_parallel_size=1, min_time=0, prefer_larger_batch=True,
        ignore_non_elastic_batch_info=False, version=0.2,
    )  # fmt: skip


@pytest.mark.parametrize(
    ("block", "fragment"),
    [
        ({"enabled": True, "micro_batch_sizes": [2]}, "max_train_batch_size is required"),
        ({"enabled": True, "max_train_batch_size": 8}, "micro_batch_sizes is required"),
        ({"max_train_batch": 8}, "Did you mean 'max_train_batch_size'"),
        ({"enabled": "yes"}, "elasticity.enabled must be true or false"),
        ({"prefer_larger_batch": 1}, "prefer_larger_batch must be true or false"),
        ({"max_train_batch_size": 0}, "max_train_batch_size must be an integer >= 1"),
        ({"max_train_batch_size": 64.0}, "max_train_batch_size must be an integer"),
        ({"min_gpus": 0}, "min_gpus must be an integer >= 1"),
        ({"min_gpus": True}, "min_gpus must be an integer"),
        ({"min_gpus": 8, "max_gpus": 4}, "max_gpus must be an integer >= min_gpus"),
        ({"min_time": -1}, "min_time must be an integer >= 0"),
        ({"num_gpus_per_node": 0}, "num_gpus_per_node must be an integer >= 1"),
        ({"micro_batch_sizes": []}, "non-empty list of positive integers"),
        ({"micro_batch_sizes": [2, -4]}, "non-empty list of positive integers"),
        ({"micro_batch_sizes": 4}, "non-empty list of positive integers"),
        ({"max_train_batch_size": 8, "micro_batch_sizes": [4, 16]}, "above max_train_batch_size"),
        ({"version": 0.3}, "version must be one of"),
        ({"version": "0.2"}, "version must be one of"),
        ({"version": 0.1, "model_parallel_size": 2, "num_gpus_per_node": 2}, "needs version 0.2"),
        ({"model_parallel_size": 3, "num_gpus_per_node": 8}, "multiple of model_parallel_size"),
    ],
)
def test_validation_errors(block: dict[str, Any], fragment: str) -> None:
    with pytest.raises(ElasticityConfigError, match=re.escape(fragment)):
        ElasticityConfig.from_dict(block)


def test_validation_error_reaches_compute() -> None:
    with pytest.raises(ElasticityConfigError, match="version must be one of"):
        compute_elastic_config(_cfg(max_train_batch_size=8, micro_batch_sizes=[2], version=1.0))
    with pytest.raises(ElasticityConfigError, match="must be a JSON object"):
        compute_elastic_config({"elasticity": [1]})


def test_supported_versions_are_accepted() -> None:
    assert ElasticityConfig.from_dict({"version": 0.1}).version == 0.1
    assert (
        ElasticityConfig.from_dict({"version": 0.2, "model_parallel_size": 2, "num_gpus_per_node": 4}).version
        == 0.2
    )


# ---------------------------------------------------------------- runtime checks (10.5)


def test_reject_explicit_batch_keys() -> None:
    with pytest.raises(ElasticityConfigError, match="One or more batch related parameters") as info:
        reject_explicit_batch_keys({**V01, "train_batch_size": 32, "gradient_accumulation_steps": 2})
    assert "train_batch_size, gradient_accumulation_steps" in str(info.value)
    reject_explicit_batch_keys(V01)
    ignore = _cfg(**{**V01["elasticity"], "ignore_non_elastic_batch_info": True})
    reject_explicit_batch_keys(
        {**ignore, "train_batch_size": "auto", "train_micro_batch_size_per_gpu": "auto"}
    )


def test_check_scheduler_elastic_config() -> None:
    block = V01["elasticity"]
    check_scheduler_elastic_config(V01, json.dumps(block))
    check_scheduler_elastic_config(
        V01, {"max_train_batch_size": 2000, "micro_batch_sizes": [2, 4, 6], "version": 0.1}
    )
    with pytest.raises(ElasticityConfigError, match="max_train_batch_size=1000"):
        check_scheduler_elastic_config(V01, json.dumps({**block, "max_train_batch_size": 1000}))
    with pytest.raises(ElasticityConfigError, match="micro_batch_sizes"):
        check_scheduler_elastic_config(V01, json.dumps({**block, "micro_batch_sizes": [2, 4]}))
    with pytest.raises(ElasticityConfigError, match=r"version=0\.2"):  # scheduler left version at its default
        check_scheduler_elastic_config(
            V01, json.dumps({"max_train_batch_size": 2000, "micro_batch_sizes": [2, 4, 6]})
        )
    with pytest.raises(ElasticityConfigError, match="not valid JSON"):
        check_scheduler_elastic_config(V01, "{oops")


def test_check_scheduler_elastic_config_missing_only_warns() -> None:
    records: list[logging.LogRecord] = []

    class _Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            records.append(record)

    handler = _Keep()
    logger.addHandler(handler)
    try:
        check_scheduler_elastic_config(V01, None)
    finally:
        logger.removeHandler(handler)
    assert any("DEEPSPEED_ELASTICITY_CONFIG" in r.getMessage() for r in records)
