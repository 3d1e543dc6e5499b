"""Folded AutoEP+AutoTP dispatch on one process: the partition of routed assignments over TP lanes,
the restore (forward and gradients) against the unpartitioned combine, the coverage check, and the
payload fingerprint the lanes compare. The collectives over real ranks are in
tests/distributed/test_autoep_tp_dispatch_ranks.py.

Exact by construction: values are small integers and weights multiples of 1/8, so every product and
sum is exact in fp32 and the fp64 reference must match bit for bit.
"""

from __future__ import annotations

import pytest
import torch

from shardwise.autoep.tp_consistency import assert_tp_payload_consistent, payload_fingerprint
from shardwise.autoep.tp_dispatch import (
    RoutedAssignmentPayload,
    assignment_ordinals_by_expert,
    dispatch_counters,
    partition_assignments,
    restore_combined,
)

TOKENS, TOP_K, EXPERTS, EP = 7, 2, 4, 2


def routed_payload(seed: int, *, drop: int = 0, pad: int = 0) -> RoutedAssignmentPayload:
    """A top-2 routing of TOKENS tokens over EXPERTS experts (2 per EP rank), rows in expert order;
    ``drop``/``pad`` rows masked; weights multiples of 1/8."""
    g = torch.Generator().manual_seed(seed)
    chosen = torch.stack([torch.randperm(EXPERTS, generator=g)[:TOP_K] for _ in range(TOKENS)])
    routes = torch.argsort(chosen.reshape(-1), stable=True)
    experts = chosen.reshape(-1)[routes]
    rows = routes.numel()
    drop_mask, pad_mask = torch.zeros(rows, dtype=torch.bool), torch.zeros(rows, dtype=torch.bool)
    masked = torch.randperm(rows, generator=g)[: drop + pad]
    drop_mask[masked[:drop]] = True
    pad_mask[masked[drop:]] = True
    return RoutedAssignmentPayload(
        token_indices=routes // TOP_K, expert_indices=experts, assignment_indices=assignment_ordinals_by_expert(experts),
        capacity_slots=routes % TOP_K, combine_weights=torch.randint(1, 8, (rows,), generator=g).float() / 8,
        drop_mask=drop_mask, pad_mask=pad_mask, input_splits=[0] * EP, output_splits=[0] * EP,
        extra={"destination_ranks": experts // (EXPERTS // EP), "num_tokens": torch.tensor(TOKENS)},
    )


def test_ordinals_restart_at_every_change_of_expert() -> None:
    experts = torch.tensor([3, 3, 3, 0, 1, 1, 3, 2, 2, 2, 2])
    expected, run = [], 0
    for i, e in enumerate(experts.tolist()):
        run = run + 1 if i and e == experts[i - 1] else 0
        expected.append(run)
    assert assignment_ordinals_by_expert(experts).tolist() == expected
    assert assignment_ordinals_by_expert(torch.empty(0, dtype=torch.long)).numel() == 0


@pytest.mark.parametrize("tp_size", [1, 2, 3])
def test_each_active_assignment_has_one_lane_and_experts_split_evenly(tp_size: int) -> None:
    payload = routed_payload(tp_size, drop=2, pad=1)
    active = (~payload.drop_mask & ~payload.pad_mask).nonzero().flatten().tolist()
    lanes = [partition_assignments(payload, tp_group=None, tp_rank=r, tp_size=tp_size) for r in range(tp_size)]
    owned = [ctx.local_indices.tolist() for _, ctx in lanes]
    assert sorted(row for rows in owned for row in rows) == active  # each active row once, no masked row
    for expert in range(EXPERTS):
        loads = [int((local.expert_indices == expert).sum()) for local, _ in lanes]
        assert max(loads) - min(loads) <= 1, (expert, loads)
    for (local, ctx), rows in zip(lanes, owned, strict=True):
        assert torch.equal(local.token_indices, payload.token_indices[rows])
        assert torch.equal(local.extra["destination_ranks"], payload.extra["destination_ranks"][rows])
        assert local.input_splits == torch.bincount(local.extra["destination_ranks"], minlength=EP).tolist()
        assert local.output_splits == []  # known only after the dispatcher's count exchange
        assert dispatch_counters(ctx) == {"assignments_total": len(active), "assignments_local": len(rows),
                                          "padded": 1, "dropped": 2, "split_sum_in": len(rows)}


def test_destinations_are_read_off_the_splits_when_not_given() -> None:
    payload = routed_payload(5)
    given, _ = partition_assignments(payload, tp_group=None, tp_rank=1, tp_size=2)
    payload.input_splits = torch.bincount(payload.extra.pop("destination_ranks"), minlength=EP).tolist()
    derived, _ = partition_assignments(payload, tp_group=None, tp_rank=1, tp_size=2)
    assert derived.input_splits == given.input_splits


def test_bad_payloads_are_refused_by_name() -> None:
    payload = routed_payload(0)
    with pytest.raises(ValueError, match="0 <= tp_rank < tp_size"):
        partition_assignments(payload, tp_group=None, tp_rank=2, tp_size=2)
    payload.input_splits = [0]  # one EP rank listed, destinations 0..1
    with pytest.raises(ValueError, match="outside the 1 expert-parallel ranks"):
        partition_assignments(payload, tp_group=None, tp_rank=0, tp_size=1)
    payload = routed_payload(0)
    del payload.extra["num_tokens"]
    with pytest.raises(ValueError, match="num_tokens"):
        partition_assignments(payload, tp_group=None, tp_rank=0, tp_size=1)
    payload = routed_payload(0)
    payload.capacity_slots = payload.capacity_slots[:-1]
    with pytest.raises(ValueError, match="capacity_slots"):
        partition_assignments(payload, tp_group=None, tp_rank=0, tp_size=1)


def test_restore_is_the_unpartitioned_combine_forward_and_backward() -> None:
    payload = routed_payload(7, drop=1, pad=2)
    rows = payload.token_indices.numel()
    results = torch.randint(-9, 9, (rows, 3)).float()
    weights = payload.combine_weights.clone().requires_grad_(True)
    payload.combine_weights = weights
    local, ctx = partition_assignments(payload, tp_group=None, tp_rank=0, tp_size=1)
    mine = results.index_select(0, ctx.local_indices).requires_grad_(True)
    restored = restore_combined(mine, ctx, tp_group=None, validate_coverage=True)
    loss_weights = torch.randint(-4, 5, (TOKENS, 3)).float() / 4
    (restored * loss_weights).sum().backward()

    active = ~payload.drop_mask & ~payload.pad_mask
    expected = torch.zeros(TOKENS, 3, dtype=torch.float64)
    for row in active.nonzero().flatten().tolist():
        expected[payload.token_indices[row]] += weights[row].double() * results[row].double()
    assert restored.dtype == torch.float32 and torch.equal(restored.double(), expected)
    tokens = local.token_indices
    assert torch.equal(mine.grad, local.combine_weights.detach()[:, None] * loss_weights[tokens])
    expected_weight_grad = torch.zeros(rows)
    expected_weight_grad[ctx.local_indices] = (results[ctx.local_indices] * loss_weights[tokens]).sum(1)
    assert torch.equal(weights.grad, expected_weight_grad)  # masked rows: no gradient


def test_a_token_adds_its_slots_in_ascending_slot_order() -> None:
    # rows in expert order hold the token's slots 2, 0, 1: 1e20 - 1e20 + 1 in slot order; row order or
    # descending slots would give 0
    payload = RoutedAssignmentPayload(
        token_indices=torch.zeros(3, dtype=torch.long), expert_indices=torch.tensor([0, 1, 2]),
        assignment_indices=torch.zeros(3, dtype=torch.long), capacity_slots=torch.tensor([2, 0, 1]),
        combine_weights=torch.ones(3), drop_mask=torch.zeros(3, dtype=torch.bool),
        pad_mask=torch.zeros(3, dtype=torch.bool), input_splits=[3], output_splits=[3], extra={"num_tokens": 2},
    )
    _, ctx = partition_assignments(payload, tp_group=None, tp_rank=0, tp_size=1)
    restored = restore_combined(torch.tensor([[1.0], [1.0e20], [-1.0e20]]), ctx, tp_group=None)
    assert restored.tolist() == [[1.0], [0.0]]


def test_bf16_results_are_weighted_and_added_in_fp32() -> None:
    payload = routed_payload(3)
    _, ctx = partition_assignments(payload, tp_group=None, tp_rank=0, tp_size=1)
    results = torch.randn(ctx.local_indices.numel(), 4).bfloat16()
    restored = restore_combined(results, ctx, tp_group=None)
    reference = restore_combined(results.float(), ctx, tp_group=None)
    assert restored.dtype == torch.bfloat16 and torch.equal(restored, reference.bfloat16())


def test_coverage_check_names_missing_repeated_and_masked_rows() -> None:
    payload = routed_payload(2, drop=1)
    _, ctx = partition_assignments(payload, tp_group=None, tp_rank=0, tp_size=1)
    dropped = int(payload.drop_mask.nonzero())
    full = ctx.local_indices
    for indices, shown in [(full[:-1], f"missing [{int(full[-1])}]"), (torch.cat((full, full[:1])), "restored twice"),
                           (torch.cat((full, torch.tensor([dropped]))), f"restored [{dropped}]")]:
        ctx.local_indices = indices
        values = torch.ones(indices.numel(), 2)
        assert restore_combined(values, ctx, tp_group=None).shape == (TOKENS, 2)  # unchecked: restores what it has
        with pytest.raises(RuntimeError, match=r"restore coverage mismatch.*" + shown.replace("[", r"\[")):
            restore_combined(values, ctx, tp_group=None, validate_coverage=True)
    with pytest.raises(ValueError, match=r"one row per ctx\.local_indices"):
        restore_combined(torch.ones(1, 2), ctx, tp_group=None)


def test_lanes_needing_a_process_group_say_so() -> None:
    payload = routed_payload(1)
    _, ctx = partition_assignments(payload, tp_group=None, tp_rank=0, tp_size=2)
    with pytest.raises(RuntimeError, match="init_distributed"):
        restore_combined(torch.ones(ctx.local_indices.numel(), 2), ctx, tp_group=None)
    with pytest.raises(RuntimeError, match="init_distributed"):
        assert_tp_payload_consistent(payload, tp_group=None, tp_size=2)
    assert_tp_payload_consistent(payload, tp_group=None, tp_size=1)  # one lane: nothing to compare


def _swap_two_different_slots(p: RoutedAssignmentPayload) -> None:
    other = int((p.capacity_slots != p.capacity_slots[0]).nonzero()[0])
    p.capacity_slots[[0, other]] = p.capacity_slots[[other, 0]]


@pytest.mark.parametrize(
    ("field", "change"),
    [
        ("token_indices", lambda p: p.token_indices.__setitem__(0, p.token_indices[0] + 1)),
        ("combine_weights", lambda p: p.combine_weights.__setitem__(3, torch.nextafter(p.combine_weights[3],
                                                                                         torch.tensor(2.0)))),
        ("capacity_slots", _swap_two_different_slots),
        ("drop_mask", lambda p: p.drop_mask.__setitem__(5, True)),
        ("input_splits", lambda p: p.input_splits.__setitem__(0, 1)),
        ("extra", lambda p: p.extra.__setitem__("num_tokens", torch.tensor(TOKENS + 1))),
        ("extra", lambda p: p.extra.__setitem__("top_scores", torch.ones(3))),
    ],
)
def test_the_fingerprint_changes_with_any_field(field: str, change) -> None:
    payload, twin = routed_payload(4), routed_payload(4)
    assert torch.equal(payload_fingerprint(payload), payload_fingerprint(twin))
    change(twin)
    differs = (payload_fingerprint(payload) != payload_fingerprint(twin)).any(dim=1)
    names = ["token_indices", "expert_indices", "assignment_indices", "capacity_slots", "combine_weights",
             "drop_mask", "pad_mask", "input_splits", "output_splits", "extra"]
    assert [n for n, d in zip(names, differs.tolist(), strict=True) if d] == [field]
