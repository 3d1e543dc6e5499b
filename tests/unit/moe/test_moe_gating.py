"""The gating maths of shardwise.moe against hand-worked cases."""

from __future__ import annotations

import math

import pytest
import torch

from shardwise.moe.gating import capacity, top1gating, top2gating, topkgating


def test_capacity_rounds_up_and_respects_the_minimum() -> None:
    assert capacity(10, 4, 1.0, 0) == 3  # ceil(2.5)
    assert capacity(10, 4, 2.0, 0) == 5
    assert capacity(10, 4, 1.0, 4) == 4
    assert capacity(8, 4, 1.25, 1) == 3  # ceil(2.5)


def _logits_prefer(choices: list[int], num_experts: int, high: float = 2.0) -> torch.Tensor:
    logits = torch.zeros(len(choices), num_experts)
    for s, e in enumerate(choices):
        logits[s, e] = high
    return logits


def test_top1_keeps_the_first_tokens_in_order_without_rts() -> None:
    # tokens 0, 1, 2 prefer expert 0, token 3 expert 1; capacity ceil(4 / 2 * 1) = 2
    logits = _logits_prefer([0, 0, 0, 1], 2)
    l_aux, combine, dispatch, counts = top1gating(logits, 1.0, 0, use_rts=False)
    gates = torch.softmax(logits, dim=1)
    assert counts.tolist() == [3, 1]  # counted before dropping
    assert combine.shape == (4, 2, 2)
    expected = torch.zeros(4, 2, 2)
    expected[0, 0, 0] = gates[0, 0]
    expected[1, 0, 1] = gates[1, 0]  # token 2 dropped: expert 0 is full
    expected[3, 1, 0] = gates[3, 1]
    assert torch.equal(combine, expected)
    assert torch.equal(dispatch, expected.bool())
    # E * sum_e mean_gate_e * fraction_e, fractions before dropping: 3/4 and 1/4
    me = gates.mean(dim=0)
    assert l_aux.item() == pytest.approx(2 * (me[0] * 0.75 + me[1] * 0.25).item(), abs=1e-7)


def test_top1_with_rts_keeps_capacity_tokens_of_the_preferred_expert() -> None:
    torch.manual_seed(0)
    logits = _logits_prefer([0, 0, 0, 0, 1, 1], 2)  # capacity ceil(6 / 2) = 3
    _, combine, _, counts = top1gating(logits, 1.0, 0, use_rts=True)
    kept = combine.sum(dim=2)  # [S, E]
    assert counts.tolist() == [4, 2]
    assert int((kept[:4, 0] > 0).sum()) == 3  # a random 3 of the 4
    assert bool((kept[4:, 1] > 0).all())
    slots = combine[:, 0].nonzero()[:, 1].sort().values.tolist()
    assert slots == [0, 1, 2]  # the kept tokens fill slots 0..2


def test_top1_without_dropping_sizes_capacity_to_the_busiest_expert() -> None:
    logits = _logits_prefer([0, 0, 0, 1], 2)
    _, combine, _, _ = top1gating(logits, 1.0, 0, drop_tokens=False, use_rts=False)
    assert combine.shape[-1] == 3
    assert int(combine.bool().sum()) == 4  # no token dropped


def test_top1_used_token_mask_routes_masked_tokens_nowhere() -> None:
    logits = _logits_prefer([0, 1, 0, 1], 2)
    used = torch.tensor([1.0, 1.0, 0.0, 1.0])
    _, combine, _, counts = top1gating(logits, 1.0, 0, used_token=used, use_rts=False)
    assert counts.tolist() == [1, 2]
    assert combine[2].abs().sum() == 0


def test_top2_renormalises_the_two_gates_and_places_second_choices_after_first() -> None:
    # 3 experts, 2 tokens: token 0 ranks 0 > 1 > 2, token 1 ranks 1 > 0 > 2
    logits = torch.tensor([[3.0, 2.0, 0.0], [2.0, 3.0, 0.0]])
    l_aux, combine, _, counts = top2gating(logits, 1.0, 0, top2_2nd_expert_sampling=False)
    gates = torch.softmax(logits, dim=1)
    cap = math.ceil(2 / 3 * 2)  # 2
    assert combine.shape == (2, 3, cap)
    assert counts.tolist() == [2, 2, 0]
    w0 = gates[0, 0] / (gates[0, 0] + gates[0, 1])
    w1 = gates[1, 1] / (gates[1, 0] + gates[1, 1])
    # expert 0: token 0's first choice in slot 0, token 1's second choice after the first choices (slot 1)
    assert combine[0, 0, 0].item() == pytest.approx(w0.item(), abs=1e-7)
    assert combine[1, 0, 1].item() == pytest.approx(1 - w1.item(), abs=1e-6)
    assert combine[1, 1, 0].item() == pytest.approx(w1.item(), abs=1e-7)
    assert combine[0, 1, 1].item() == pytest.approx(1 - w0.item(), abs=1e-6)
    assert combine.sum().item() == pytest.approx(2.0, abs=1e-6)
    me = gates.mean(dim=0)
    ce = torch.tensor([0.5, 0.5, 0.0])  # first choices only
    assert l_aux.item() == pytest.approx((me * ce).mean().item() * 9, abs=1e-7)


def test_top2_a_token_whose_second_choice_is_dropped_keeps_weight_one() -> None:
    # capacity 1 slot per expert (factor 0.25 * 2 * 4 tokens / 4 experts -> ceil(0.5) = 1)
    logits = torch.tensor([[3.0, 2.0, 0.0, 0.0], [0.0, 3.0, 2.0, 0.0], [0.0, 0.0, 3.0, 2.0], [2.0, 0.0, 0.0, 3.0]])
    _, combine, _, _ = top2gating(logits, 0.25, 0, top2_2nd_expert_sampling=False)
    assert combine.shape[-1] == 1
    # every expert's single slot goes to its first-choice token; all second choices dropped
    per_token = combine.sum(dim=(1, 2))
    assert torch.allclose(per_token, torch.ones(4))


def test_topk_probs_policy_keeps_the_highest_gates_and_position_the_first() -> None:
    # expert 0 is everyone's top choice; capacity for k=1, factor 1, 4 tokens, 2 experts: 2
    logits = torch.tensor([[1.0, 0.0], [3.0, 0.0], [2.0, 0.0], [4.0, 0.0]])
    _, _, by_probs, _ = topkgating(logits, 1, 1.0, 0, drop_policy="probs")
    _, _, by_position, _ = topkgating(logits, 1, 1.0, 0, drop_policy="position")
    assert by_probs[:, 0].any(dim=1).tolist() == [False, True, False, True]
    assert by_position[:, 0].any(dim=1).tolist() == [True, True, False, False]
    with pytest.raises(ValueError, match="drop_policy"):
        topkgating(logits, 1, 1.0, 0, drop_policy="random")


def test_topk_loss_is_scaled_by_one_over_k() -> None:
    logits = torch.tensor([[3.0, 2.0, 0.0], [2.0, 3.0, 0.0]])
    l_aux, _, _, counts = topkgating(logits, 2, 1.0, 0)
    gates = torch.softmax(logits, dim=1)
    ce = torch.tensor([1.0, 1.0, 0.0])  # every choice counts
    assert counts.tolist() == [2, 2, 0]
    assert l_aux.item() == pytest.approx((gates.mean(0) * ce).mean().item() * 9 / 2, abs=1e-7)


@pytest.mark.parametrize("k", [1, 2, 3])
def test_sparse_routes_move_tokens_as_the_dense_weights_say(k: int) -> None:
    from shardwise.moe.dispatch import combine, dispatch, route_slots, sparse_decode, sparse_encode

    torch.manual_seed(k)
    logits, tokens = torch.randn(16, 4), torch.randn(16, 8)
    if k == 1:
        dense, sparse = (top1gating(logits, 1.0, 0, use_rts=False, sparse_routes=s) for s in (False, True))
    elif k == 2:
        dense, sparse = (
            top2gating(logits, 1.0, 0, top2_2nd_expert_sampling=False, sparse_routes=s) for s in (False, True)
        )
    else:
        dense, sparse = (topkgating(logits, k, 1.0, 0, sparse_routes=s) for s in (False, True))
    _, weights, mask, counts = dense
    l_aux, cap, experts, indices, locations, gates, sparse_counts = sparse
    assert torch.equal(l_aux, dense[0]) and torch.equal(counts, sparse_counts) and cap == weights.shape[-1]
    assert indices.shape == (k, 16) and bool((indices < 0).any() == (mask.sum() < 16 * k))  # some dropped
    slots = route_slots(indices, locations, experts, cap)
    block = sparse_encode(tokens, slots, experts, cap)
    assert torch.equal(block, dispatch(tokens, mask))  # a copy of each token, exactly
    out = torch.randn_like(block)
    torch.testing.assert_close(sparse_decode(out.view(-1, 8), slots, gates, 16), combine(out, weights))
