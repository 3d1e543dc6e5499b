"""AutoEP folded with AutoTP: every routed assignment dispatched by exactly one tensor-parallel lane
(``deepspeed.moe.ep_tp_dispatch``).

With ``expert_parallel.autoep_size`` > 1 beside ``tensor_parallel.autotp_size`` > 1 every rank of a
TP group holds the same tokens and routes them alike; sending them from every lane would dispatch
each (token, top-k slot) assignment ``tp_size`` times. Instead:

1. the router's decisions are written as a :class:`RoutedAssignmentPayload`, one row per assignment
   in expert order (:func:`~shardwise.autoep.tp_consistency.assert_tp_payload_consistent` checks
   that the lanes agree);
2. :func:`partition_assignments` keeps the rows this lane owns: the ``i``-th row of an expert's run
   (:func:`assignment_ordinals_by_expert`) belongs to lane ``i % tp_size``, so each expert's load is
   split evenly and every assignment has one owner; padded and dropped rows have none;
3. the lane dispatches, computes and brings back only its rows over the expert-parallel group;
4. :func:`restore_combined` gathers every lane's results, weights them and adds them up by token, the
   top-k slots of a token in ascending slot order: every lane ends with every token's output.

Gradients: the gather's backward hands each row the sum of every lane's gradient for it (a
reduce-scatter). The combine weights are not gathered: every lane holds all of them (the payload is
the same on every lane) and weights the gathered rows itself, so each lane's weight gradient is its
own loss's. Summed over the lanes both equal the gradient of the summed losses; with one loss
replicated on every lane (training), AVERAGE over TP gives the true gradient, and
:func:`average_gradient_over_tp` does that for the layer's input.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor

import shardwise.comm as dist
from shardwise.autoep.tp_consistency import assert_tp_payload_consistent

__all__ = [
    "RestoreContext",
    "RoutedAssignmentPayload",
    "assert_tp_payload_consistent",
    "assignment_ordinals_by_expert",
    "average_gradient_over_tp",
    "combine_lane_rows",
    "dispatch_counters",
    "partition_assignments",
    "restore_combined",
]

ROW_FIELDS = ("token_indices", "expert_indices", "assignment_indices", "capacity_slots", "combine_weights",
              "drop_mask", "pad_mask")
"""The payload's per-assignment tensors, one entry per row."""


@dataclass
class RoutedAssignmentPayload:
    """One row per routed (token, top-k slot) assignment, in expert order.

    ``token_indices``: the token; ``expert_indices``: the expert (global index); ``assignment_indices``:
    the row's ordinal within its expert's run (:func:`assignment_ordinals_by_expert`);
    ``capacity_slots``: the top-k slot (a token's slots are added in ascending order);
    ``combine_weights``: the weight of the expert's result (may carry the router's gradient);
    ``drop_mask``/``pad_mask``: rows that are not dispatched; ``input_splits``: rows sent to each
    expert-parallel rank; ``output_splits``: rows received from each (empty in a partitioned payload:
    known only after the dispatcher's count exchange); ``extra``: ``num_tokens`` (required by
    :func:`partition_assignments`), ``destination_ranks`` (per row, optional) and any other tensors
    (per-row ones follow the rows).
    """

    token_indices: Tensor
    expert_indices: Tensor
    assignment_indices: Tensor
    capacity_slots: Tensor
    combine_weights: Tensor
    drop_mask: Tensor
    pad_mask: Tensor
    input_splits: list[int]
    output_splits: list[int]
    extra: dict[str, Any] = field(default_factory=dict)


@dataclass
class RestoreContext:
    """What :func:`restore_combined` needs: the whole payload, the rows this lane kept (positions in
    it), the lane, the token count and the partition's counters."""

    original_payload: RoutedAssignmentPayload
    local_indices: Tensor
    tp_rank: int
    tp_size: int
    num_tokens: int
    counters: dict[str, int]


def assignment_ordinals_by_expert(expert_indices: Tensor) -> Tensor:
    """Each row's ordinal within its run of equal consecutive experts (0, 1, ... restarting at every
    change).

    Example:
        >>> assignment_ordinals_by_expert(torch.tensor([0, 0, 2, 2, 2, 4])).tolist()
        [0, 1, 0, 1, 2, 0]
    """
    experts = expert_indices.reshape(-1).to(torch.long)
    if experts.numel() == 0:
        return experts
    starts_run = torch.ones_like(experts, dtype=torch.bool)
    starts_run[1:] = experts[1:] != experts[:-1]
    run_of_row = torch.cumsum(starts_run.to(torch.long), 0) - 1
    run_start = torch.nonzero(starts_run).flatten()
    return torch.arange(experts.numel(), device=experts.device) - run_start[run_of_row]


def _row_count(payload: RoutedAssignmentPayload) -> int:
    rows = int(payload.token_indices.shape[0])
    for name in ROW_FIELDS:
        value = getattr(payload, name)
        if value.dim() != 1 or value.shape[0] != rows:
            raise ValueError(
                f"RoutedAssignmentPayload.{name} has shape {tuple(value.shape)}; rule: every per-assignment "
                f"field is 1-D with one entry per row ({rows}, as token_indices); fix: build them from the same routes"
            )
    return rows


def _active(payload: RoutedAssignmentPayload) -> Tensor:
    return ~payload.drop_mask.to(torch.bool) & ~payload.pad_mask.to(torch.bool)


def _lane_rows(payload: RoutedAssignmentPayload, lane: int, tp_size: int) -> Tensor:
    """Positions of the rows lane ``lane`` owns (active ones whose ordinal is ``lane`` mod ``tp_size``)."""
    owned = _active(payload) & (payload.assignment_indices.to(torch.long).remainder(tp_size) == lane)
    return torch.nonzero(owned).flatten()


def _num_tokens(payload: RoutedAssignmentPayload) -> int:
    if "num_tokens" not in payload.extra:
        raise ValueError(
            "RoutedAssignmentPayload.extra has no 'num_tokens'; rule: the restored output has one row per "
            "token, including tokens with no active assignment; fix: set extra['num_tokens'] to the token count"
        )
    value = payload.extra["num_tokens"]
    return int(value.item()) if isinstance(value, Tensor) else int(value)


def _destinations(payload: RoutedAssignmentPayload, rows: int) -> Tensor:
    """Each row's expert-parallel destination: ``extra['destination_ranks']``, else read off
    ``input_splits`` (rows are grouped by destination)."""
    given = payload.extra.get("destination_ranks")
    if isinstance(given, Tensor):
        return given.reshape(-1).to(torch.long)
    if sum(payload.input_splits) != rows:
        raise ValueError(
            f"RoutedAssignmentPayload: no extra['destination_ranks'] and input_splits {payload.input_splits} "
            f"do not add up to the {rows} rows; fix: pass destination_ranks or splits that count every row"
        )
    device = payload.token_indices.device
    ranks = torch.arange(len(payload.input_splits), device=device)
    return torch.repeat_interleave(ranks, torch.tensor(payload.input_splits, device=device, dtype=torch.long))


def _split_counts(destinations: Tensor, ep_ranks: int) -> list[int]:
    if destinations.numel() == 0:
        return [0] * ep_ranks
    low, high = int(destinations.min()), int(destinations.max())
    if low < 0 or high >= ep_ranks:
        raise ValueError(
            f"RoutedAssignmentPayload: destination ranks {low}..{high} outside the {ep_ranks} expert-parallel "
            "ranks that input_splits lists; fix: give input_splits one entry per expert-parallel rank"
        )
    return [int(n) for n in torch.bincount(destinations, minlength=ep_ranks).tolist()]


def _select_rows(payload: RoutedAssignmentPayload, positions: Tensor, rows: int) -> RoutedAssignmentPayload:
    extra = {
        key: value.index_select(0, positions) if isinstance(value, Tensor) and value.dim() >= 1
        and value.shape[0] == rows else value
        for key, value in payload.extra.items()
    }
    picked = {name: getattr(payload, name).index_select(0, positions) for name in ROW_FIELDS}
    return RoutedAssignmentPayload(**picked, input_splits=[], output_splits=[], extra=extra)


def partition_assignments(payload: RoutedAssignmentPayload, *, tp_group: Any, tp_rank: int,
                          tp_size: int) -> tuple[RoutedAssignmentPayload, RestoreContext]:
    """The rows of ``payload`` lane ``tp_rank`` of ``tp_size`` dispatches, and the context that
    restores the whole output afterwards. Local work only (``tp_group`` is not used: the partition
    is a function of the payload, the same on every lane).

    The local payload's ``input_splits`` count its rows per expert-parallel destination; its
    ``output_splits`` are left empty for the dispatcher's count exchange. Counters
    (:func:`dispatch_counters`): ``assignments_total`` (active rows of the whole payload),
    ``assignments_local``, ``padded``, ``dropped``, ``split_sum_in``.

    Raises:
        ValueError: a lane outside ``0..tp_size-1``, fields of different lengths, no ``num_tokens``,
            destinations that do not match ``input_splits``.
    """
    del tp_group
    if tp_size < 1 or not 0 <= tp_rank < tp_size:
        raise ValueError(f"partition_assignments: tp_rank={tp_rank}, tp_size={tp_size}; rule: 0 <= tp_rank < "
                         "tp_size; fix: pass this rank's index in its tensor-parallel group and the group's size")
    rows = _row_count(payload)
    mine = _lane_rows(payload, tp_rank, tp_size)
    local = _select_rows(payload, mine, rows)
    local.input_splits = _split_counts(_destinations(payload, rows).index_select(0, mine),
                                       len(payload.input_splits)) if rows else [0] * len(payload.input_splits)
    counters = {
        "assignments_total": int(_active(payload).sum()),
        "assignments_local": int(mine.numel()),
        "padded": int(payload.pad_mask.to(torch.bool).sum()),
        "dropped": int(payload.drop_mask.to(torch.bool).sum()),
        "split_sum_in": sum(local.input_splits),
    }
    ctx = RestoreContext(original_payload=payload, local_indices=mine, tp_rank=tp_rank, tp_size=tp_size,
                         num_tokens=_num_tokens(payload), counters=counters)
    return local, ctx


def dispatch_counters(ctx: RestoreContext) -> dict[str, int]:
    """A copy of the partition's counters (see :func:`partition_assignments`)."""
    return dict(ctx.counters)


def _gather(rows: Tensor, counts: list[int], group: Any) -> Tensor:
    """Every lane's ``rows`` (``counts[r]`` of them on lane ``r``) concatenated in lane order."""
    widest = max(counts)
    tail = tuple(rows.shape[1:])
    padded = rows.new_zeros((widest, *tail))
    padded[: rows.shape[0]] = rows
    every = rows.new_empty((len(counts) * widest, *tail))
    dist.all_gather_into_tensor(every, padded, group=group)
    return torch.cat([every[lane * widest: lane * widest + n] for lane, n in enumerate(counts)])


class _GatherLaneRows(torch.autograd.Function):
    """:func:`_gather` whose backward returns to each lane the sum over lanes of its rows' gradients."""

    @staticmethod
    def forward(ctx: Any, rows: Tensor, group: Any, counts: tuple[int, ...], lane: int) -> Tensor:
        ctx.group, ctx.counts, ctx.lane = group, counts, lane
        return _gather(rows, list(counts), group)

    @staticmethod
    def backward(ctx: Any, *grads: Tensor) -> tuple[Tensor, None, None, None]:
        grad, counts = grads[0], ctx.counts
        widest = max(counts)
        padded = grad.new_zeros((len(counts) * widest, *grad.shape[1:]))
        for lane, piece in enumerate(torch.split(grad, list(counts))):
            padded[lane * widest: lane * widest + piece.shape[0]] = piece
        mine = grad.new_empty((widest, *grad.shape[1:]))
        dist.reduce_scatter_tensor(mine, padded, op="sum", group=ctx.group)
        return mine[: counts[ctx.lane]], None, None, None


def _require_group(what: str, tp_group: Any, tp_rank: int, tp_size: int) -> None:
    if not dist.is_initialized():
        raise RuntimeError(f"{what}: tp_size={tp_size} needs the process group; fix: call "
                           "deepspeed.init_distributed() first (or pass tp_size=1)")
    if dist.get_world_size(tp_group) != tp_size or dist.get_rank(tp_group) != tp_rank:
        raise ValueError(f"{what}: tp_rank={tp_rank}, tp_size={tp_size} but this rank is "
                         f"{dist.get_rank(tp_group)} of {dist.get_world_size(tp_group)} in tp_group; fix: pass "
                         "the tensor-parallel group the payload was partitioned for")


def _check_coverage(payload: RoutedAssignmentPayload, positions: Tensor) -> None:
    """Every active row restored once, no padded or dropped row restored."""
    hits = torch.bincount(positions, minlength=payload.token_indices.shape[0])
    active = _active(payload)
    missing = torch.nonzero(active & (hits == 0)).flatten()
    twice = torch.nonzero(hits > 1).flatten()
    inactive = torch.nonzero(~active & (hits > 0)).flatten()
    if missing.numel() or twice.numel() or inactive.numel():
        raise RuntimeError(
            "AutoEP+AutoTP restore coverage mismatch: assignment rows missing "
            f"{missing[:8].tolist()}, restored twice {twice[:8].tolist()}, padded/dropped but restored "
            f"{inactive[:8].tolist()} ({positions.numel()} rows restored, {int(active.sum())} active); rule: each "
            "active assignment comes back from exactly one lane; fix: restore with the context "
            "partition_assignments returned, and the lanes' results in the order of its local_indices"
        )


def _lane_positions(payload: RoutedAssignmentPayload, ctx: RestoreContext, counts: list[int]) -> Tensor:
    """Where each lane's rows sit in the payload: this lane's from its context, the others' from the
    partition rule (checked against the row counts they sent)."""
    pieces = []
    for lane, count in enumerate(counts):
        owned = ctx.local_indices if lane == ctx.tp_rank else _lane_rows(payload, lane, ctx.tp_size)
        if owned.numel() != count:
            raise RuntimeError(
                f"AutoEP+AutoTP restore coverage mismatch: lane {lane} returned {count} rows but its partition "
                f"holds {owned.numel()}; fix: every lane restores the rows partition_assignments gave it"
            )
        pieces.append(owned.to(torch.long))
    return torch.cat(pieces)


def _combine(rows: Tensor, positions: Tensor, payload: RoutedAssignmentPayload, num_tokens: int) -> Tensor:
    """``rows`` (results of the payload rows at ``positions``) weighted and added into their tokens, in
    at least fp32, one top-k slot at a time in ascending order; cast back to ``rows.dtype``."""
    compute = torch.promote_types(rows.dtype, torch.float32)
    weights = payload.combine_weights.index_select(0, positions).to(compute)
    weighted = rows.to(compute) * weights.reshape(-1, *([1] * (rows.dim() - 1)))
    tokens = payload.token_indices.index_select(0, positions).to(torch.long)
    slots = payload.capacity_slots.index_select(0, positions)
    out = weighted.new_zeros((num_tokens, *rows.shape[1:]))
    for slot in torch.unique(slots).tolist():
        pick = torch.nonzero(slots == slot).flatten()
        out.index_add_(0, tokens.index_select(0, pick), weighted.index_select(0, pick))
    return out.to(rows.dtype)


def restore_combined(local_combined: Tensor, ctx: RestoreContext, *, tp_group: Any,
                     validate_coverage: bool = False) -> Tensor:
    """Every token's combined output ``[num_tokens, ...]`` from this lane's results ``local_combined``
    (one row per ``ctx.local_indices``, in that order), identical on every lane.

    Collectives over ``tp_group`` when ``ctx.tp_size`` > 1: the lanes' row counts, their rows, and
    with ``validate_coverage`` their positions, which are then checked to cover every active
    assignment once (``RuntimeError`` "restore coverage mismatch", also raised when a lane's row
    count differs from its partition).
    """
    payload = ctx.original_payload
    if local_combined.shape[0] != ctx.local_indices.numel():
        raise ValueError(f"restore_combined: {local_combined.shape[0]} result rows for "
                         f"{ctx.local_indices.numel()} local assignments; fix: one row per ctx.local_indices entry")
    own = ctx.local_indices.to(torch.long)
    if ctx.tp_size == 1:
        rows, positions = local_combined, own
    else:
        _require_group("restore_combined", tp_group, ctx.tp_rank, ctx.tp_size)
        count = torch.tensor([own.numel()], dtype=torch.long, device=local_combined.device)
        every = count.new_empty(ctx.tp_size)
        dist.all_gather_into_tensor(every, count, group=tp_group)
        counts = [int(n) for n in every.tolist()]
        if max(counts) == 0:
            rows, positions = local_combined, own
        elif local_combined.requires_grad:
            rows = _GatherLaneRows.apply(local_combined, tp_group, tuple(counts), ctx.tp_rank)
        else:
            rows = _gather(local_combined, counts, tp_group)
        if max(counts) > 0:
            positions = (_gather(own.to(local_combined.device), counts, tp_group).to(own.device)
                         if validate_coverage else _lane_positions(payload, ctx, counts))
    if validate_coverage:
        _check_coverage(payload, positions)
    return _combine(rows, positions, payload, ctx.num_tokens)


def combine_lane_rows(local_combined: Tensor, ctx: RestoreContext) -> Tensor:
    """This lane's share of the combined output ``[num_tokens, ...]``: its results ``local_combined``
    (one row per ``ctx.local_indices``) weighted and added into their tokens, zero for the rest. Local
    work; summed over the lanes it is :func:`restore_combined`'s output (the folded AutoEP layer sums
    it with an all-reduce whose backward is the identity, so no gradient needs a correction after).
    """
    if local_combined.shape[0] != ctx.local_indices.numel():
        raise ValueError(f"combine_lane_rows: {local_combined.shape[0]} result rows for "
                         f"{ctx.local_indices.numel()} local assignments; fix: one row per ctx.local_indices entry")
    return _combine(local_combined, ctx.local_indices.to(torch.long), ctx.original_payload, ctx.num_tokens)


class _AverageOverTP(torch.autograd.Function):
    """Identity forward; backward averages the gradient over the tensor-parallel group."""

    @staticmethod
    def forward(ctx: Any, tensor: Tensor, group: Any) -> Tensor:
        ctx.group = group
        return tensor.view_as(tensor)

    @staticmethod
    def backward(ctx: Any, *grads: Tensor) -> tuple[Tensor, None]:
        grad = grads[0].contiguous().clone()
        dist.all_reduce(grad, op="avg", group=ctx.group)
        return grad, None


def average_gradient_over_tp(tensor: Tensor, tp_group: Any, tp_size: int) -> Tensor:
    """``tensor`` unchanged, its gradient averaged over ``tp_group`` in backward.

    For the input of a folded MoE layer: lane ``p``'s input gradient is ``tp_size`` times the expert
    part of its own rows plus what every lane computes alike; tensor-parallel layers before it need
    the true gradient on every lane, which is the average (no-op when ``tp_size`` is 1 or the tensor
    needs no gradient).
    """
    if tp_size <= 1 or not tensor.requires_grad:
        return tensor
    if not dist.is_initialized():
        raise RuntimeError(f"average_gradient_over_tp: tp_size={tp_size} needs the process group; fix: call "
                           "deepspeed.init_distributed() first (or pass tp_size=1)")
    return _AverageOverTP.apply(tensor, tp_group)
