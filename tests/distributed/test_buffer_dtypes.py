"""``data_types.buffer_dtype`` and ``keep_in_fp32_modules`` in a bf16 run, at ZeRO stages 0-3 on 2 gloo
ranks: by default every floating buffer keeps its dtype (a rotary ``inv_freq`` stays fp32, bit for bit,
as in DeepSpeed 0.19.8); ``buffer_dtype`` casts them, except the buffers the model names for fp32
(transformers' ``_keep_in_fp32_modules_strict``, or the list given); ``[]`` keeps none."""

from __future__ import annotations

import pytest
from buffer_dtype_cases import run

from shardwise.testing import run_distributed_cases

pytestmark = pytest.mark.distributed

SETTINGS = {
    "default": ({}, {"inv_freq": "float32", "router.bias": "float32"}),
    "buffer_bf16": ({"buffer_dtype": "bf16"}, {"inv_freq": "bfloat16", "router.bias": "float32"}),
    "buffer_bf16_keep_none": ({"buffer_dtype": "bf16", "keep_in_fp32_modules": []},
                              {"inv_freq": "bfloat16", "router.bias": "bfloat16"}),
    "buffer_bf16_keep_listed": ({"buffer_dtype": "bf16", "keep_in_fp32_modules": ["inv_*"]},
                                {"inv_freq": "float32", "router.bias": "bfloat16"}),
}
STAGES = (0, 1, 2, 3)


@pytest.fixture(scope="module")
def runs() -> dict[tuple[int, str], list[dict]]:
    cases = [{"stage": stage, "data_types": data_types, "name": name}
             for stage in STAGES for name, (data_types, _) in SETTINGS.items()]
    results = run_distributed_cases(run, cases, world_size=2, timeout=600)
    return {(case["stage"], case["name"]): result for case, result in zip(cases, results, strict=True)}


@pytest.mark.parametrize("stage", STAGES)
@pytest.mark.parametrize("name", sorted(SETTINGS))
def test_buffers_take_the_dtype_data_types_gives_them(runs: dict, stage: int, name: str) -> None:
    expected = SETTINGS[name][1]
    for rank_result in runs[(stage, name)]:
        assert rank_result["before"] == expected and rank_result["after"] == expected
        if expected["inv_freq"] == "float32":
            assert rank_result["inv_freq_exact"]  # its fp32 values, not bf16-rounded ones
