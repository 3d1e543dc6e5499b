"""Rank-side cases: folded AutoEP+AutoTP dispatch over a tensor-parallel group of 2 lanes (the world)."""

from __future__ import annotations

from typing import Any

TOKENS, TOP_K, EXPERTS, HIDDEN = 9, 2, 4, 3


def _payload(seed: int, one_row_per_expert: bool = False) -> Any:
    """A top-2 routing (the same on every lane), rows in expert order, one dropped and one padded
    row; values small integers and weights multiples of 1/8 (exact in fp32)."""
    import torch

    from shardwise.autoep.tp_dispatch import RoutedAssignmentPayload, assignment_ordinals_by_expert

    g = torch.Generator().manual_seed(seed)
    tokens = EXPERTS // TOP_K if one_row_per_expert else TOKENS
    if one_row_per_expert:  # every expert one row: lane 1 owns nothing
        chosen = torch.arange(EXPERTS).reshape(tokens, TOP_K)
    else:
        chosen = torch.stack([torch.randperm(EXPERTS, generator=g)[:TOP_K] for _ in range(tokens)])
    routes = torch.argsort(chosen.reshape(-1), stable=True)
    experts = chosen.reshape(-1)[routes]
    rows = routes.numel()
    drop, pad = torch.zeros(rows, dtype=torch.bool), torch.zeros(rows, dtype=torch.bool)
    if not one_row_per_expert:
        drop[3], pad[rows - 2] = True, True
    return RoutedAssignmentPayload(
        token_indices=routes // TOP_K, expert_indices=experts, assignment_indices=assignment_ordinals_by_expert(experts),
        capacity_slots=routes % TOP_K, combine_weights=torch.randint(1, 8, (rows,), generator=g).float() / 8,
        drop_mask=drop, pad_mask=pad, input_splits=[0, 0], output_splits=[0, 0],
        extra={"destination_ranks": experts // 2, "num_tokens": torch.tensor(tokens)},
    ), torch.randint(-9, 9, (rows, HIDDEN), generator=g).float()


def restore(rank: int, world: int, case: dict[str, Any]) -> dict[str, Any]:
    """Partition, restore from this lane's rows, backward of a loss that differs per lane
    (``sum(out * C_rank)``); returns the restored output and this lane's gradients."""
    import torch

    import shardwise.comm as dist
    from shardwise.autoep.tp_dispatch import (
        assert_tp_payload_consistent,
        partition_assignments,
        restore_combined,
    )

    group = dist.get_world_group()
    payload, results = _payload(case["seed"], case.get("one_row_per_expert", False))
    assert_tp_payload_consistent(payload, tp_group=group, tp_size=world)
    weights = payload.combine_weights.clone().requires_grad_(True)
    payload.combine_weights = weights
    local, ctx = partition_assignments(payload, tp_group=group, tp_rank=rank, tp_size=world)
    mine = results.index_select(0, ctx.local_indices).requires_grad_(True)
    out = restore_combined(mine, ctx, tp_group=group, validate_coverage=case["validate"])
    loss_weights = torch.arange(out.numel(), dtype=torch.float32).reshape(out.shape).remainder(5).sub(2) / 4
    (out * (rank + 1) * loss_weights).sum().backward()
    value_grad = torch.zeros_like(results)
    value_grad[ctx.local_indices] = mine.grad
    return {"out": out.detach(), "value_grad": value_grad, "weight_grad": weights.grad, "rows": local.token_indices.numel(),
            "payload": (payload.token_indices, weights.detach(),
                        ~payload.drop_mask & ~payload.pad_mask), "results": results, "loss_weights": loss_weights}


def divergent_payload(rank: int, world: int, case: dict[str, Any]) -> str:
    """Lane 1 holds one combine weight one ulp larger: both lanes must refuse, naming the field."""
    import torch

    import shardwise.comm as dist
    from shardwise.autoep.tp_dispatch import assert_tp_payload_consistent

    payload, _ = _payload(0)
    if rank == 1:
        payload.combine_weights[2] = torch.nextafter(payload.combine_weights[2], torch.tensor(9.0))
    try:
        assert_tp_payload_consistent(payload, tp_group=dist.get_world_group(), tp_size=world)
    except RuntimeError as error:
        return str(error)
    return ""


def averaged_input_gradient(rank: int, world: int, case: dict[str, Any]) -> Any:
    """average_gradient_over_tp: identity forward, gradient averaged over the lanes."""
    import torch

    import shardwise.comm as dist
    from shardwise.autoep.tp_dispatch import average_gradient_over_tp

    x = torch.ones(2, 3, requires_grad=True)
    y = average_gradient_over_tp(x, dist.get_world_group(), world)
    assert torch.equal(y, x)
    (y * (rank + 1) * 4.0).sum().backward()
    return x.grad


def check(rank: int, world: int, case: dict[str, Any]) -> Any:
    """The case's check by name, so that every case shares one spawn."""
    return {"restore": restore, "divergent": divergent_payload, "average": averaged_input_gradient}[case["check"]](
        rank, world, case)
