"""ZeRO stage 3 with expert parallelism > 1: the same training as expert parallelism 1 at stage 3.

Models (moe_stage3_cases): the tiny MoE GPT (``deepspeed.moe``'s ``MoE``, 4 experts, top-2) and a
tiny random Mixtral converted by AutoEP (4 experts, top-2), trained through ``initialize`` with SGD
with momentum and ``gradient_clipping`` below the gradient norm (so the clip coefficient, hence the
norm, enters every update). Expert parallelism 2 on 2 ranks (each expert unit on a mesh of one) and
on 4 ranks (ep=2 x edp=2: each expert sharded over two ranks) against expert parallelism 1.

Why the bound (fp32): every token meets the same expert weights in both runs and each output row
of an expert is computed alone, so the forward values are the same; what differs is the order of
the float additions that reduce gradients (an expert's gradient is summed over both ranks' tokens
by the all-to-all's backward then reduce-scattered over its expert-data-parallel ranks at EP=2,
reduce-scattered over all ranks at EP=1) and of the squared norm's partial sums: a few ulps of the
gradient per step, times a learning rate of 0.5 and the momentum's accumulation over 3 steps. We
assert parameters within 1e-6 absolute (measured <= 6e-8) and losses within 1e-6 (measured 0);
the norm to 1e-6 relative (fp32 partial sums added in another order).
"""

from __future__ import annotations

import pytest
import torch
from moe_stage3_cases import CLIP, run_case

from shardwise.testing import run_distributed_cases

pytestmark = pytest.mark.distributed

MODELS = ("moe", "autoep")
REFUSALS = {
    "hpz": ({"zero_hpz_partition_size": 2}, "zero_optimization.zero_hpz_partition_size", "hpZeRO"),
    "qgz": ({"zero_quantized_gradients": True}, "zero_optimization.zero_quantized_gradients",
            "zero_quantized_gradients"),
}


def _merged(per_rank: list[dict], key: str = "params") -> dict[str, torch.Tensor]:
    return {k: v for r in per_rank for k, v in r[key].items()}


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory: pytest.TempPathFactory) -> dict[object, list[dict]]:
    """Every 2-rank case in one spawn: training at ep 1 and 2 for both models, the refusals, and
    checkpoints saved at stage 3 and resumed at the same and the other expert-parallel size."""
    root = tmp_path_factory.mktemp("z3ep")
    train = [{"kind": "train", "model": m, "ep": ep} for m in MODELS for ep in (1, 2)]
    refuse = [{"kind": "train", "model": "moe", "ep": 2, "refuse": name, "zero": zero}
              for name, (zero, _, _) in REFUSALS.items()]
    resume = [{"kind": "resume", "model": m, "save_ep": s, "load_ep": load, "dir": str(root / f"{m}{s}{load}")}
              for m, s, load in (("moe", 2, 2), ("moe", 2, 1), ("autoep", 1, 2))]
    bf16 = [{"kind": "train", "model": "moe", "ep": 2, "bf16": True, "stage": stage} for stage in (2, 3)]
    full = [{"kind": "full_grads", "model": "moe", "stage": 3, "ep": ep} for ep in (1, 2)]
    modify = {"kind": "modify", "model": "moe", "ep": 2}
    cases = [*train, *refuse, *resume, *bf16, *full, modify, {"kind": "zero_init", "model": "autoep", "ep": 2}]
    results = run_distributed_cases(run_case, cases, world_size=2, timeout=600)
    out = {_key(case): result for case, result in zip(cases, results, strict=True)}
    assert len(out) == len(cases)  # one key per case
    return out


def _key(case: dict) -> object:
    """How the tests look a 2-rank case up."""
    if case.get("refuse"):
        return case["refuse"]
    if case.get("bf16"):
        return ("bf16", case["stage"])
    if case["kind"] == "resume":
        return ("resume", case["model"], (case["save_ep"], case["load_ep"]))
    if case["kind"] in ("zero_init", "full_grads", "modify"):
        return (case["kind"], case["ep"])
    return ("train", case["model"], case["ep"])


@pytest.fixture(scope="module")
def four_ranks() -> dict[object, list[dict]]:
    """AutoEP at ep 1 and 2 on 4 ranks (ep=2: two expert-data-parallel ranks per expert)."""
    cases = [{"kind": "train", "model": "autoep", "ep": ep} for ep in (1, 2)]
    results = run_distributed_cases(run_case, cases, world_size=4, timeout=600)
    return {case["ep"]: result for case, result in zip(cases, results, strict=True)}


def _check_parity(ep1: list[dict], ep2: list[dict]) -> None:
    whole, split = _merged(ep1), _merged(ep2)
    assert sorted(whole) == sorted(split)  # every parameter once, experts by global index
    for name, value in whole.items():
        torch.testing.assert_close(split[name], value, rtol=0, atol=1e-6, msg=name)
    for a, b in zip(ep1, ep2):
        assert max(abs(x - y) for x, y in zip(a["loss"], b["loss"])) <= 1e-6, (a["loss"], b["loss"])
        assert b["norm"] == pytest.approx(a["norm"], rel=1e-6)  # the norm counts every expert once
        assert min(a["norm"]) > CLIP  # clipping acted on every step
    assert ep1[0]["loss"][-1] < ep1[0]["loss"][0]  # it trains


@pytest.mark.parametrize("model", MODELS)
def test_stage3_ep2_trains_like_ep1_on_two_ranks(two_ranks: dict, model: str) -> None:
    ep1, ep2 = two_ranks[("train", model, 1)], two_ranks[("train", model, 2)]
    _check_parity(ep1, ep2)
    for a, b in zip(ep1, ep2):
        logical1, _ = a["experts"]
        logical2, stored2 = b["experts"]
        assert logical2 * 2 == logical1  # each rank computes half of the experts...
        assert stored2 == logical2  # ...whole: its expert-data-parallel group is itself
        # DeepSpeed's markers survive FSDP2's new parameters (is_moe_param above reads allreduce=False)
        assert b["families"] == (["autoep_expert"] if model == "autoep" else ["None"])


def test_stage3_autoep2_trains_like_autoep1_on_four_ranks(four_ranks: dict) -> None:
    _check_parity(four_ranks[1], four_ranks[2])
    for a, b in zip(four_ranks[1], four_ranks[2]):
        assert b["experts"][0] * 2 == a["experts"][0]
        assert b["experts"][1] * 2 == b["experts"][0]  # sharded over its two expert-data-parallel ranks


def test_stage3_ep2_bf16_is_stage2_ep2_bitwise(two_ranks: dict) -> None:
    # bf16: stage 2 with ep=2 is checked against ep=1 (test_moe_expert_parallel); stage 3 computes the
    # same 16-bit forward and backward and reduces the same fp32 sums of two addends, so its weights
    # rounded to bf16 (stage 2 holds bf16 weights, stage 3 fp32 masters) and its losses are the same bits
    stage2, stage3 = two_ranks[("bf16", 2)], two_ranks[("bf16", 3)]
    for a, b in zip(stage2, stage3):
        assert a["loss"] == b["loss"]
        assert b["norm"] == pytest.approx(a["norm"], rel=1e-6)
    rounded2 = {k: v.bfloat16() for k, v in _merged(stage2).items()}
    rounded3 = {k: v.bfloat16() for k, v in _merged(stage3).items()}
    assert sorted(rounded2) == sorted(rounded3)
    for name, value in rounded2.items():
        assert torch.equal(rounded3[name], value), name
    assert any(not torch.equal(v.float(), v.bfloat16().float()) for v in _merged(stage3).values())  # fp32 masters


def test_safe_get_full_of_an_expert_at_stage3_ep2_is_that_expert_at_ep1(two_ranks: dict) -> None:
    # DeepSpeed's safe_get_full_grad / safe_get_full_fp32_param: an expert parameter gathered over its
    # expert-data-parallel group, by global expert index
    ep1, ep2 = two_ranks[("full_grads", 1)], two_ranks[("full_grads", 2)]
    owned = {**ep2[0], **ep2[1]}
    assert sorted(owned) == sorted(ep1[0])
    for key, value in ep1[0].items():
        torch.testing.assert_close(owned[key], value, rtol=1e-6, atol=1e-7, msg=key)
    assert any(float(v.abs().sum()) > 0 for k, v in owned.items() if k.startswith("grad"))


def test_autoep_converts_a_zero_init_model_at_stage3_ep2(two_ranks: dict) -> None:
    # the source block's placeholders are gathered and each rank keeps its own experts' exact values
    first, second = two_ranks[("zero_init", 2)]
    assert set(first) == {"router", *(f"w{i}.{e}" for e in (0, 1) for i in (1, 2, 3))}
    assert set(second) == {"router", *(f"w{i}.{e}" for e in (2, 3) for i in (1, 2, 3))}
    assert all(first.values()) and all(second.values()), (first, second)


@pytest.mark.parametrize("name", sorted(REFUSALS))
def test_stage3_ep_refuses_what_it_cannot_shard(two_ranks: dict, name: str) -> None:
    _, key, phrase = REFUSALS[name]
    for result in two_ranks[name]:
        assert result["error"] is not None and result["assertion"], result
        assert key in result["error"] and phrase in result["error"] and "fix:" in result["error"], result


@pytest.mark.parametrize(("model", "save", "load"), [("moe", 2, 2), ("moe", 2, 1), ("autoep", 1, 2)])
def test_stage3_ep_checkpoint_resumes_at_any_expert_parallel_size(
    two_ranks: dict, model: str, save: int, load: int
) -> None:
    per_rank = two_ranks[("resume", model, (save, load))]
    saved, loaded = _merged(per_rank, "saved"), _merged(per_rank, "loaded")
    assert sorted(saved) == sorted(loaded)
    for name, value in saved.items():
        assert torch.equal(loaded[name], value), name  # the weights come back bitwise
    continued = {k: v for r in per_rank for k, v in r["continued"]["params"].items()}
    resumed = {k: v for r in per_rank for k, v in r["resumed"]["params"].items()}
    for r in per_rank:  # and the next step (with the momentum) is the step the saving run took
        assert r["resumed"]["loss"] == r["continued"]["loss"]
    bound = 0.0 if save == load else 1e-6  # same layout: bitwise; another: gradient sums reordered
    for name, value in continued.items():
        torch.testing.assert_close(resumed[name], value, rtol=0, atol=bound, msg=name)



def test_gathered_parameters_modifier_rank_counts_within_the_parameters_group(two_ranks: dict) -> None:
    # DeepSpeed's rule: modifier_rank is a world rank for a parameter partitioned over every rank, and a
    # rank of the parameter's own group otherwise. At ep=2 on 2 ranks each expert's group is its rank
    # alone, so every rank is "rank 0" of its experts and keeps its own edit; the dense one keeps rank 0's
    held = two_ranks[("modify", 2)]
    assert [h["dense"] for h in held] == [[1.0], [1.0]]
    assert [h["expert"] for h in held] == [[10.0], [20.0]]
