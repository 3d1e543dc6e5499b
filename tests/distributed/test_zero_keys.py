"""The remaining zero_optimization keys act, each observed on 2 gloo ranks (one spawn):

- reduce_scatter: false (stages 1-2): gradients are all-reduced, then sliced: the comms logger
  shows all-reduces and no reduce-scatter, and the weights are the same as with reduce-scatter;
- allgather_bucket_size (stages 1-2): the updated shards go in more, smaller all-gathers;
- allgather_partitions: false and disable_allgather: true (stages 1-2): broadcasts from each owner;
- ignore_unused_parameters: false (stages 0-3): the step raises naming the unused parameters;
- load_from_fp32_weights: false: the masters restart from the loaded bf16 weights;
- dump_state: true logs the resolved config at start-up;
- zero_quantized_weights (ZeRO++ qwZ) at stage 2: the updated shards travel as int8 blocks;
- sub_group_size at stage 3 without an offload store: the step runs sub-group by sub-group (each
  call sees at most sub_group_size elements, or one larger tensor), bitwise one step; with an
  optimizer shardwise cannot split, one call and a warning naming the key.
"""

from __future__ import annotations

import pytest
import torch
import zero_keys_cases as cases

from shardwise.testing import run_distributed_cases

pytestmark = pytest.mark.distributed

SMALL_GATHER = {"allgather_bucket_size": 500}
SUB_GROUP = 2000
HOST = {"offload_param": {"device": "cpu"}, "offload_optimizer": {"device": "cpu"}}
CASES = [
    {"kind": "count", "name": "s1", "stage": 1},
    {"kind": "count", "name": "s1_allreduce", "stage": 1, "zero": {"reduce_scatter": False}},
    {"kind": "count", "name": "s2", "stage": 2},
    {"kind": "count", "name": "s2_allreduce", "stage": 2, "zero": {"reduce_scatter": False}},
    {"kind": "count", "name": "s2_small_gather", "stage": 2, "zero": SMALL_GATHER},
    {"kind": "count", "name": "s1_broadcast", "stage": 1, "zero": {"allgather_partitions": False}},
    {"kind": "count", "name": "s2_disable", "stage": 2, "top": {"disable_allgather": True}},
    {"kind": "count", "name": "s2_qwz", "stage": 2, "zero": {"zero_quantized_weights": True}},
    *(
        {"kind": "unused", "name": f"unused_s{s}", "stage": s, "zero": {"ignore_unused_parameters": False}}
        for s in (0, 1, 2, 3)
    ),
    {"kind": "unused", "name": "unused_ok", "stage": 2},
    {"kind": "fp32", "name": "fp32_true", "stage": 1, "fp32": True},
    {"kind": "fp32", "name": "fp32_false", "stage": 1, "fp32": False},
    {"kind": "dump", "name": "dump_on", "dump": True},
    {"kind": "dump", "name": "dump_off", "dump": False},
    {"kind": "sub_groups", "name": "sg_default"},
    {"kind": "sub_groups", "name": "sg_small", "zero": {"sub_group_size": SUB_GROUP}},
    {"kind": "sub_groups", "name": "sg_custom", "zero": {"sub_group_size": SUB_GROUP}, "custom": True},
    {"kind": "sub_groups", "name": "sg_custom_default", "custom": True},
    # parameters and optimizer on the host: the masters are host tensors, no offload store
    {"kind": "sub_groups", "name": "sg_host_default", "zero": HOST},
    {"kind": "sub_groups", "name": "sg_host_small", "zero": {**HOST, "sub_group_size": SUB_GROUP}},
]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    tmp = str(tmp_path_factory.mktemp("zero_keys"))
    results = run_distributed_cases(cases.run_case, CASES, world_size=2, args=(tmp,), timeout=400)
    return {case["name"]: result for case, result in zip(CASES, results)}


def _same_weights(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    return all(torch.allclose(x, y, rtol=0, atol=1e-6) for x, y in zip(a, b))


@pytest.mark.parametrize("stage", [1, 2])
def test_reduce_scatter_false_all_reduces_then_slices(runs, stage: int) -> None:
    base, forced = runs[f"s{stage}"][0], runs[f"s{stage}_allreduce"][0]
    assert base["calls"].get("reduce_scatter_tensor", 0) > 0
    assert "reduce_scatter_tensor" not in forced["calls"]
    assert forced["calls"]["all_reduce"] > base["calls"].get("all_reduce", 0)
    for rank in (0, 1):
        assert _same_weights(runs[f"s{stage}"][rank]["weights"], runs[f"s{stage}_allreduce"][rank]["weights"])


def test_allgather_bucket_size_splits_the_gathers(runs) -> None:
    base, small = runs["s2"][0]["calls"], runs["s2_small_gather"][0]["calls"]
    assert small["all_gather_into_tensor"] > base["all_gather_into_tensor"]
    for rank in (0, 1):
        assert torch.equal(
            torch.cat([w.flatten() for w in runs["s2"][rank]["weights"]]),
            torch.cat([w.flatten() for w in runs["s2_small_gather"][rank]["weights"]]),
        )


@pytest.mark.parametrize(("name", "base"), [("s1_broadcast", "s1"), ("s2_disable", "s2")])
def test_allgather_partitions_false_and_disable_allgather_broadcast(runs, name: str, base: str) -> None:
    calls = runs[name][0]["calls"]
    assert "all_gather_into_tensor" not in calls
    assert calls["broadcast"] >= 2 * 3  # each rank's shard, every step
    for rank in (0, 1):
        assert torch.equal(
            torch.cat([w.flatten() for w in runs[base][rank]["weights"]]),
            torch.cat([w.flatten() for w in runs[name][rank]["weights"]]),
        )


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_ignore_unused_parameters_false_names_them(runs, stage: int) -> None:
    for rank in (0, 1):
        error = runs[f"unused_s{stage}"][rank]["error"]
        assert error is not None and "ignore_unused_parameters = false" in error
        assert "spare.weight" in error and "spare.bias" in error and "body." not in error
        assert "Fix:" in error
    assert runs["unused_ok"][0]["error"] is None


def test_load_from_fp32_weights(runs) -> None:
    for rank in (0, 1):
        kept, rebuilt = runs["fp32_true"][rank], runs["fp32_false"][rank]
        assert all(torch.equal(a, b) for a, b in zip(kept["masters"], kept["saved_masters"]))
        masters = torch.cat([m.flatten() for m in rebuilt["masters"]])
        assert torch.equal(masters, masters.bfloat16().float())  # from the bf16 weights
        saved = torch.cat([m.flatten() for m in rebuilt["saved_masters"]])
        assert not torch.equal(saved, saved.bfloat16().float())  # which the fp32 copy is not
        assert torch.equal(masters, saved.bfloat16().float())


def test_dump_state_logs_the_config_once(runs) -> None:
    (text,) = runs["dump_on"][0]["dumps"]
    assert "zero_optimization.stage" in text and "train_micro_batch_size_per_gpu" in text
    assert runs["dump_off"][0]["dumps"] == []


def test_quantized_weights_at_stage_2(runs) -> None:
    exact, quant = runs["s2"][0], runs["s2_qwz"][0]
    assert exact["calls"]["all_gather_into_tensor"] == quant["calls"]["all_gather_into_tensor"]
    assert exact["bytes"]["all_gather_into_tensor"] / quant["bytes"]["all_gather_into_tensor"] >= 3.5
    flat = [
        torch.cat([w.flatten() for w in runs[name][r]["weights"]])
        for name in ("s2", "s2_qwz")
        for r in (0, 1)
    ]
    assert torch.equal(flat[2], flat[3])  # every rank holds the same dequantized weights
    assert not torch.equal(flat[0], flat[2])
    for rank in (0, 1):  # trains within 1% of the exact run's loss, step by step
        pairs = zip(runs["s2"][rank]["losses"], runs["s2_qwz"][rank]["losses"])
        assert all(abs(a - b) <= 0.01 * a for a, b in pairs)


@pytest.mark.parametrize("small, default", [("sg_small", "sg_default"), ("sg_host_small", "sg_host_default")])
def test_sub_group_size_splits_the_stage3_step_bitwise(runs, small: str, default: str) -> None:
    from shardwise.zero.optimizer_subset import split_sub_groups

    for split, whole in zip(runs[small], runs[default]):
        groups = split_sub_groups(split["numels"], SUB_GROUP)
        assert len(groups) > 1 and len(whole["calls"]) == 3  # one call per step by default
        assert len(split["calls"]) == 3 * len(groups)
        assert all(sum(call) <= SUB_GROUP or len(call) == 1 for call in split["calls"])
        assert sorted(n for call in split["calls"][: len(groups)] for n in call) == sorted(split["numels"])
        assert all(torch.equal(a, b) for a, b in zip(split["shards"], whole["shards"], strict=True))
        assert not [w for w in split["warnings"] if "sub_group_size" in w]


def test_sub_group_size_with_an_optimizer_that_cannot_be_split_warns_and_steps_once(runs) -> None:
    for custom, whole in zip(runs["sg_custom"], runs["sg_custom_default"]):
        assert len(custom["calls"]) == 3
        (warning,) = [w for w in custom["warnings"] if "sub_group_size" in w]
        assert warning.startswith(
            f"'zero_optimization.sub_group_size' = {SUB_GROUP} has no effect: _CustomAdamW is not one of "
            "torch's element-wise optimizers"
        )
        assert not [w for w in whole["warnings"] if "sub_group_size" in w]
        assert all(torch.equal(a, b) for a, b in zip(custom["shards"], whole["shards"], strict=True))
