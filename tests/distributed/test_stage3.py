"""ZeRO stage 3 (FSDP2) and offload on 2 gloo ranks, against the single-process reference.

All scenarios run in one spawn (stage3_cases.run_case dispatches them).

Tolerances. Stage 3 matches the reference as exactly as stages 0-2 do: FSDP2 reduce-
scatters every micro step's gradients as a plain sum (its divide factor is set to 1) and
adds them into the fp32 shard, which is the reference's stage-2 order (sum over ranks
per micro step, then accumulate: ``reduce_every_micro=True``); a sum of two values is the
same whichever rank adds, 16-bit models start from fp32 masters rounded through the
16-bit dtype exactly like the reference, the averaging/unscaling multiply is the same
power of two, and fused AdamW is element-wise, so updating a shard gives the same bits as
updating the whole tensor. The unsharded small parameters (persistence threshold) follow
the same order through their own all-reduce. The grid therefore asserts equality to
1e-6 relative, with and without offload (offload moves values, it does not change the
arithmetic). Bitwise equality would not hold for more than two ranks: a reduce-scatter
of three or more addends may associate them differently from the reference's
left-to-right sum, bounding the difference by one rounding per addition (<= (W-1) ulp of
the summed gradient before AdamW). With clipping the norm is summed shard by shard; as for
stages 0-2 the parameters are then bitwise equal by construction (the reference takes the
multiplier from the engine's norm) and the norm is checked within a derived bound
(zero_reference.norm_error_bound).
"""

from __future__ import annotations

import copy
import math
from pathlib import Path
from typing import Any

import pytest
import torch
from stage3_cases import NVME, run_case, with_path
from zero_reference import norm_error_bound, reference_run

from shardwise.testing import run_distributed_cases

pytestmark = [pytest.mark.distributed, pytest.mark.numeric]

WORLD, STEPS, MICRO = 2, 3, 2


def _train(precision: str, gas: int, **zero: Any) -> dict[str, Any]:
    return {
        "stage": 3,
        "precision": precision,
        "gas": gas,
        "micro_batch": MICRO,
        "steps": STEPS,
        "zero": zero,
    }


GRID = [_train(p, g) for p in ("fp32", "bf16", "fp16") for g in (1, 4)]
PERSISTENT = [
    _train("fp32", 4, stage3_param_persistence_threshold=100),
    _train("fp16", 1, stage3_param_persistence_threshold=100),
    _train("bf16", 1, stage3_param_persistence_threshold=100_000),  # DeepSpeed's default: all unsharded here
]
_NVME_OPT = {
    "device": "nvme",
    "nvme_path": NVME,
    "buffer_count": 2,
    "pipeline_read": True,
    "pipeline_write": True,
}
OFFLOAD = [
    _train("fp32", 1, offload_optimizer={"device": "cpu", "ratio": 0.5}),
    _train("fp32", 4, offload_param={"device": "cpu"}, offload_optimizer={"device": "cpu"}),
    _train(
        "bf16",
        1,
        offload_param={"device": "nvme", "nvme_path": NVME, "buffer_count": 2},
        offload_optimizer={"device": "nvme", "nvme_path": NVME},
        stage3_param_persistence_threshold=100,
    ),
    _train("bf16", 4, offload_optimizer={"device": "cpu"}),
    _train("fp16", 1, offload_optimizer=_NVME_OPT, sub_group_size=3000),
    _train(
        "fp16", 4, offload_param={"device": "cpu"}, offload_optimizer={"device": "nvme", "nvme_path": NVME}
    ),
]
# stages 1-2 with offload: ZeroOptimizer with the offload store behind its inner optimizer
STAGE12_OFFLOAD = [
    {
        "kind": "zero_reference",
        "stage": 1,
        "precision": "bf16",
        "gas": 2,
        "micro_batch": MICRO,
        "steps": STEPS,
        "zero": {"offload_optimizer": {"device": "cpu"}},
    },
    {
        "kind": "zero_reference",
        "stage": 2,
        "precision": "fp32",
        "gas": 2,
        "micro_batch": MICRO,
        "steps": STEPS,
        "zero": {"offload_optimizer": {"device": "nvme", "nvme_path": NVME}, "sub_group_size": 2000},
    },
    {
        "kind": "zero_reference",
        "stage": 2,
        "precision": "fp16",
        "gas": 1,
        "micro_batch": MICRO,
        "steps": STEPS,
        "zero": {"offload_optimizer": {"device": "cpu"}},
    },
]
CLIP = [{**_train("fp32", 2), "steps": 2, "clip": 0.05}]
MEMORY = [
    {"kind": "memory", "precision": "fp32"},
    {"kind": "memory", "precision": "bf16", "persistence": 200},
    {"kind": "memory", "precision": "fp32", "offload_optimizer": {"device": "cpu", "ratio": 0.5}},
    {"kind": "memory", "precision": "fp32", "offload_optimizer": {"device": "nvme", "nvme_path": NVME}},
    {
        "kind": "memory",
        "precision": "fp32",
        "offload_param": {"device": "cpu"},
        "offload_optimizer": {"device": "cpu"},
    },
    {
        "kind": "memory",
        "precision": "bf16",
        "offload_param": {"device": "nvme", "nvme_path": NVME},
        "offload_optimizer": {"device": "nvme", "nvme_path": NVME},
    },
]
SCENARIOS = [
    {"kind": "lora", "precision": "bf16", "steps": 4},
    {"kind": "resized"},
    {"kind": "resized", "under_init": True},
    {"kind": "init_placeholders"},
    {"kind": "init_then_train", **_train("bf16", 1)},
    {"kind": "gathered_after_initialize"},
    {"kind": "save_16bit", "dir": NVME},
    {"kind": "external_parameter"},
    {"kind": "overflow"},
    {"kind": "unused_and_averaging"},
    {"kind": "float_target", "steps": 2},
]
CASES = GRID + PERSISTENT + OFFLOAD + STAGE12_OFFLOAD + CLIP + MEMORY + SCENARIOS


def _id(case: dict[str, Any]) -> str:
    return repr(sorted(case.items()))


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("nvme"))
    cases = [with_path(copy.deepcopy(c), path) for c in CASES]
    out = run_distributed_cases(run_case, cases, world_size=WORLD, timeout=900)
    found = dict(zip(map(_id, CASES), out))
    found["leftover_swap_files"] = [str(f) for f in (Path(path) / "shardwise").rglob("*") if f.is_file()]
    return found


def _assert_matches(ranks: list[dict[str, Any]], ref: dict[str, Any], steps: int = STEPS) -> None:
    for rank_result in ranks:
        assert rank_result["steps"] == steps and rank_result["skipped"] == 0
        for key, value in rank_result["losses"].items():
            assert value == pytest.approx(ref["losses"][key], rel=1e-6, abs=1e-7), key
    assert len(ranks[0]["params"]) == len(ref["params"])
    for ours, theirs in zip(ranks[0]["params"], ref["params"]):
        torch.testing.assert_close(ours, theirs, rtol=1e-6, atol=1e-8)
    for a, b in zip(ranks[0]["params"], ranks[1]["params"]):
        assert torch.equal(a, b)


@pytest.mark.parametrize(
    "case", GRID + PERSISTENT + OFFLOAD, ids=lambda c: f"{c['precision']}-gas{c['gas']}-{sorted(c['zero'])}"
)
def test_stage3_matches_single_process_reference(results, case):
    ref = reference_run(case["precision"], case["gas"], MICRO, WORLD, STEPS, reduce_every_micro=True)
    ranks = results[_id(case)]
    _assert_matches(ranks, ref)
    assert ranks[0]["optimizer"] == "Stage3Optimizer"
    assert ranks[0]["tied"]
    threshold = case["zero"].get("stage3_param_persistence_threshold", 0)
    assert (ranks[0]["n_replicated"] > 0) == (threshold > 0)
    if threshold < 10_000:  # one shard unit per block, the rest in the root
        assert ranks[0]["units"] == ["blocks.0", "blocks.1"] and ranks[0]["n_sharded"] > 0
    else:  # every parameter of the tiny model is below the threshold: nothing is sharded
        assert ranks[0]["units"] == [] and ranks[0]["n_sharded"] == 0


@pytest.fixture(scope="module")
def results_through_gloo():
    """The plain grid with shared memory switched off: FSDP2's collectives through gloo (the
    multi-host path: asynchronous reduce-scatters, :class:`DeferredReduceScatter`)."""
    cases = GRID + CLIP
    env = {"SHARDWISE_SHM_COLLECTIVES": "0"}
    out = run_distributed_cases(run_case, cases, world_size=WORLD, timeout=900, env=env)
    return dict(zip(map(_id, cases), out))


@pytest.mark.parametrize("case", GRID, ids=lambda c: f"{c['precision']}-gas{c['gas']}")
def test_stage3_through_gloo_matches_the_reference_and_shared_memory(results, results_through_gloo, case):
    ref = reference_run(case["precision"], case["gas"], MICRO, WORLD, STEPS, reduce_every_micro=True)
    ranks = results_through_gloo[_id(case)]
    _assert_matches(ranks, ref)
    for ours, shared in zip(ranks[0]["params"], results[_id(case)][0]["params"]):
        assert torch.equal(ours, shared)  # two ranks: a + b either way
    clipped = results_through_gloo[_id(CLIP[0])][0]
    assert clipped["norms"] == results[_id(CLIP[0])][0]["norms"]
    assert all(torch.equal(a, b) for a, b in zip(clipped["params"], results[_id(CLIP[0])][0]["params"]))


def test_offload_really_moved_state(results):
    half = results[_id(OFFLOAD[0])][0]  # offload_optimizer cpu, ratio 0.5
    assert half["inner"] == "OffloadedOptimizer"
    assert (
        half["breakdown"]["offloaded_host"] > 0 and half["breakdown"]["optimizer"] > 0
    )  # part stays on the device
    nvme_both = results[_id(OFFLOAD[2])][0]["breakdown"]
    assert nvme_both["offloaded_nvme"] > 0 and nvme_both["params"] < 4000  # only the small unsharded params
    params_cpu = results[_id(OFFLOAD[1])][0]
    assert params_cpu["inner"] == "DeepSpeedCPUAdam"  # masters already on the host: no staging store
    assert params_cpu["breakdown"]["params"] == 0 and params_cpu["breakdown"]["offloaded_host"] > 0
    nvme_opt = results[_id(OFFLOAD[4])][0]
    assert nvme_opt["inner"] == "OffloadedOptimizer" and nvme_opt["breakdown"]["offloaded_nvme"] > 0


@pytest.mark.parametrize("case", STAGE12_OFFLOAD, ids=lambda c: f"stage{c['stage']}-{c['precision']}")
def test_stage12_offload_matches_reference(results, case):
    ref = reference_run(
        case["precision"], case["gas"], MICRO, WORLD, STEPS, reduce_every_micro=case["stage"] == 2
    )
    ranks = results[_id(case)]
    for ours, theirs in zip(ranks[0]["params"], ref["params"]):
        torch.testing.assert_close(ours, theirs, rtol=1e-6, atol=1e-8)
    assert ranks[0]["skipped"] == 0


def test_clipping_matches_reference(results):
    case = CLIP[0]
    ranks = results[_id(case)]
    ref = reference_run(
        "fp32", case["gas"], MICRO, WORLD, 2, reduce_every_micro=True, clip=case["clip"],
        engine_norms=ranks[0]["norms"],
    )  # fmt: skip
    assert all(n > case["clip"] for n in ref["norms"]), "the test must actually clip"
    tensors = len(ref["params"])
    for rank_result in ranks:
        assert rank_result["norms"] == ranks[0]["norms"]
        for ours, exact in zip(rank_result["norms"], ref["norms"]):
            assert abs(ours - exact) <= norm_error_bound(exact, ref["largest_tensor"], tensors, WORLD)
    for ours, theirs in zip(ranks[0]["params"], ref["params"]):
        assert torch.equal(ours, theirs)


@pytest.mark.parametrize(
    "case", MEMORY, ids=lambda c: "-".join(f"{k}={v}" for k, v in sorted(c.items()) if k != "kind")
)
def test_memory_plan_within_ten_percent_of_measured(results, case):
    for rank_result in results[_id(case)]:
        measured, plan = rank_result["measured"], rank_result["plan"]
        for key in ("params", "grads", "optimizer", "offloaded_host", "offloaded_nvme"):
            if plan[key] == 0:
                assert measured[key] == 0, (key, measured)
            else:
                assert measured[key] == pytest.approx(plan[key], rel=0.10), (key, measured, plan)
        assert sum(measured.values()) == pytest.approx(sum(plan.values()), rel=0.10)


def test_stage3_fp32_model_states_at_most_8_5_bytes_per_param(results):
    """DeepSpeed's stage 3 measured 10 B/param here; fp32 sharded params + grads + AdamW = 16 / 2."""
    worst = max(
        sum(r["measured"][k] for k in ("params", "grads", "optimizer")) / r["numel"]
        for r in results[_id(MEMORY[0])]
    )
    assert worst <= 8.5, worst


def test_lora_only_adapters_change(results):
    ranks = results[_id(SCENARIOS[0])]
    for rank_result in ranks:
        for name, changed in rank_result["changed"].items():
            assert changed == rank_result["trainable"][name], name
        assert any(rank_result["trainable"].values()) and not all(rank_result["trainable"].values())
        assert rank_result["losses"][-1] < rank_result["losses"][0]
        assert rank_result["n_masters"] == sum(rank_result["trainable"].values())
    assert [r["empty_shards"] for r in ranks] == [0, 4]  # the one-row shifts: nothing on rank 1


@pytest.mark.parametrize("case", SCENARIOS[1:3], ids=["plain", "under_init"])
def test_resized_and_tied_embeddings(results, case):
    for rank_result in results[_id(case)]:
        assert rank_result["tied"] and rank_result["gathered_tied"]
        assert rank_result["shape"] == (72, 32)
        assert rank_result["old_rows_kept"]
        assert not rank_result["head_in_names"]  # the tied head is one tensor, listed once (as wte)
        assert rank_result["losses"][1] < rank_result["losses"][0]


def test_init_placeholders_and_gathered_parameters(results):
    for rank, r in enumerate(results[_id(SCENARIOS[3])]):
        assert r["meta"] and r["meta_again"]
        assert r["shapes"] == [(10, 6), (10,), (3, 10), (3,)]
        assert r["ds_numel"] == [60, 10, 30, 3]
        assert r["local_rows"] == ([5, 5, 2, 2] if rank == 0 else [5, 5, 1, 1])
        assert r["status"] == ["NOT_AVAILABLE"] * 4
        assert r["gathered_equal"]  # leaf initialisation under Init is the normal one
        # inside a block the module's parameters are the whole copies: AVAILABLE, with the placeholders' ds_id
        assert r["status_inside"] == ["AVAILABLE"] * 4 and r["ids_inside"]
        assert r["status_after"] == ["NOT_AVAILABLE"] * 4
        assert r["discarded"] and r["kept_from_rank1"]


def test_model_built_under_init_trains_like_the_reference(results):
    case = SCENARIOS[4]
    ranks = results[_id(case)]
    ref = reference_run(case["precision"], case["gas"], MICRO, WORLD, STEPS, reduce_every_micro=True)
    for r in ranks:
        assert r["tied"]
        assert r["placeholder_bytes"] < 0.6 * r["full_bytes"] / 2  # 16-bit chunks, about half the rows
        for key, value in r["losses"].items():
            assert value == pytest.approx(ref["losses"][key], rel=1e-6, abs=1e-7), key
    for ours, theirs in zip(ranks[0]["params"], ref["params"]):
        torch.testing.assert_close(ours, theirs, rtol=1e-6, atol=1e-8)


def test_gathered_parameters_after_initialize(results):
    for r in results[_id(SCENARIOS[5])]:
        assert r["qkv_sharded"] and not r["ln_sharded"]
        assert r["inside_plain"] and r["restored"]
        # sharded NOT_AVAILABLE, persistent (unsharded) AVAILABLE; inside, the module's whole copy is
        # AVAILABLE with the shard's ds_id while the sharded original still says NOT_AVAILABLE
        assert r["status_before"] == ("NOT_AVAILABLE", "AVAILABLE")
        assert r["status_inside"] == ("AVAILABLE", "NOT_AVAILABLE", True)
        assert r["status_after"] == "NOT_AVAILABLE"
        assert r["qkv_all"] and r["ln_all"] and r["ln_module"]  # rank 0's edit reached every rank and master
        assert r["finite"]


def test_gather_16bit_weights_on_model_save(results):
    for r in results[_id(SCENARIOS[6])]:
        # false: no 16-bit file (a sharded checkpoint is saved instead, see engine_io.save_16bit_model)
        assert r[False]["ok"] is False and not r[False]["file"] and r[False]["checkpoint_instead"]
        assert r[True]["sharded"]
        assert r[True]["ok"] is True and r[True]["file"]
        assert r[True]["dtypes"] == ["torch.bfloat16"] and r[True]["match"]
        assert "lm_head.weight" in r[True]["keys"] and "wte.weight" in r[True]["keys"]


def test_external_parameter_keeps_the_weight_gathered(results):
    for r in results[_id(SCENARIOS[7])]:
        assert r[False]["units"] == ["embed"] and not r[False]["ok"]
        assert r[True]["units"] == [] and r[True]["ok"]


def test_fp16_overflow_on_one_rank_skips_the_step_everywhere(results):
    for r in results[_id(SCENARIOS[8])]:
        rec = r["record"]
        assert [x["applied"] for x in rec] == [True, False, False, True]
        assert [x["changed"] for x in rec] == [True, False, False, True]
        assert [x["scale"] for x in rec] == [16.0, 16.0, 8.0, 8.0]  # hysteresis 2, as at stages 0-2
        assert math.isinf(rec[1]["norm"]) and math.isfinite(rec[3]["norm"])


def test_frozen_unused_and_averaging_options(results):
    for r in results[_id(SCENARIOS[9])]:
        default = r["default"]
        assert all(v == 0.0 for v in default["frozen.weight"] + default["frozen.bias"])  # frozen: untouched
        assert any(v != 0.0 for v in default["sometimes.weight"])  # stepped at step 0 (zero grad at step 1)
        scale = max(abs(v) for values in default.values() for v in values)
        for name in ("prescale", "predivide", "comm_bf16"):
            # the same mean, rounded differently (1e-6); bf16 on the wire rounds every
            # gradient to 8 bits of mantissa (relative 2**-8), judged against the largest update
            tol = 1e-2 if name == "comm_bf16" else 1e-6
            for key, delta in r[name].items():
                torch.testing.assert_close(
                    torch.tensor(delta), torch.tensor(default[key]), rtol=tol, atol=tol * scale
                )


def test_swap_files_are_removed(results):
    """Every NVMe store deletes its files (explicit close, or when it is collected / at exit)."""
    assert results["leftover_swap_files"] == []


def test_bf16_forward_keeps_fp32_inputs_like_stage_2(results):
    """Stage 3 casts no forward inputs (FSDP2's ``cast_forward_inputs`` is off), like stage 2:
    an fp32 target reaches the fp32 loss unrounded, so the losses are the same bits (same
    weights, same bf16 kernels; the second loss also checks the first step's update)."""
    for rank in results[_id({"kind": "float_target", "steps": 2})]:
        assert rank["stage3_sharded"] > 0 and rank["stage3_persistent_sharded"] == 0
        assert rank["stage3"] == rank["stage2"]
        assert rank["stage3_persistent"] == rank["stage2"]
