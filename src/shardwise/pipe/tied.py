"""Tied layers across pipeline stages: one copy per stage that uses the key, kept equal.

Each stage that holds a :class:`~shardwise.pipe.spec.TiedLayerSpec` key builds its own copy. At
start the copies take the first holder's values (a broadcast) and, each step, their gradients
are summed over the holders before the data-parallel reduction, so every copy takes the same
update (DeepSpeed's ``ReduceTiedGrads``). Unlike DeepSpeed, which keeps only ``tied_weight_attr``
equal, every parameter of the tied module is (the declared tensors first): a copy's unused parts
(a position table on the head's stage) would otherwise drift under weight decay, and checkpoints
keyed by parameter name would hold two different values for one name. Both go over the layout's pipeline group, the only
group the mesh gives along the pipe axis: stages that do not hold a key add zeros of the same
shape (taken from a meta-device build of the spec), so the sum is exactly the holders' sum.

The first holder's copy counts in the gradient norm; the others are marked
``ds_pipe_replicated`` (DeepSpeed's flag) and counted once.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import torch
from torch import nn

from shardwise.comm import collectives
from shardwise.comm.group_type import Group
from shardwise.pipe.spec import TiedLayerSpec


def resolve_attr(module: nn.Module, dotted: str) -> torch.Tensor:
    """``module.a.b`` for ``"a.b"``."""
    value: object = module
    for part in dotted.split("."):
        value = getattr(value, part)
    assert isinstance(value, torch.Tensor), f"tied attribute {dotted!r} is not a tensor"
    return value


@dataclass
class TiedKey:
    """One tie: the stages holding it, the tied attributes, and this stage's copy (None if absent)."""

    key: str
    stages: list[int]
    attrs: list[str]
    shapes: list[tuple[torch.Size, torch.dtype]]
    module: nn.Module | None = None
    ranks: list[int] = field(default_factory=list)

    def tensors(
        self, device: torch.device, dtype: torch.dtype | None = None
    ) -> Iterator[tuple[torch.Tensor, bool]]:
        """This stage's tied tensors, or zero stand-ins (second item False, of ``dtype`` if given)
        where it holds none."""
        for attr, (shape, spec_dtype) in zip(self.attrs, self.shapes):
            if self.module is not None:
                yield resolve_attr(self.module, attr), True
            else:
                yield torch.zeros(shape, dtype=dtype or spec_dtype, device=device), False


def index_ties(specs: list[object], stage_of: list[int], pipe_ranks: list[int]) -> list[TiedKey]:
    """Every tie key (sorted, the same on every rank) with the stages whose layers use it."""
    ties = []
    keys = sorted({s.key for s in specs if isinstance(s, TiedLayerSpec)})
    for key in keys:
        idxs = [i for i, s in enumerate(specs) if isinstance(s, TiedLayerSpec) and s.key == key]
        first = specs[idxs[0]]
        assert isinstance(first, TiedLayerSpec)
        with torch.device("meta"):
            shell = first.build()
        # The declared tied tensors, then every other parameter of the module: a copy is kept
        # whole-equal, so unused parts of it (a position table on the head's stage) do not drift.
        attrs = list(first.tied_weight_attr)
        attrs += [name for name, _ in shell.named_parameters() if name not in attrs]
        shapes = [(resolve_attr(shell, a).shape, resolve_attr(shell, a).dtype) for a in attrs]
        stages = sorted({stage_of[i] for i in idxs})
        ties.append(TiedKey(key, stages, attrs, shapes, ranks=[pipe_ranks[s] for s in stages]))
    return ties


def synchronize(ties: list[TiedKey], group: Group, group_size: int, device: torch.device) -> None:
    """Every holder's copy takes the first holder's values (collective over the pipeline group)."""
    if group_size <= 1:
        return
    for tie in ties:
        if len(tie.stages) < 2:
            continue
        for tensor, _ in tie.tensors(device):
            with torch.no_grad():
                collectives.broadcast(tensor.data, src=tie.ranks[0], group=group)


def sum_gradients(
    ties: list[TiedKey],
    grad_of: Callable[[torch.Tensor], torch.Tensor],
    group: Group,
    group_size: int,
    device: torch.device,
    grad_dtype: torch.dtype,
) -> None:
    """Sum the tied tensors' accumulated gradients over the holders (collective over the pipeline
    group). ``grad_of(tensor)`` returns the tensor holding the accumulated gradient (of
    ``grad_dtype``), summed in place."""
    if group_size <= 1:
        return
    for tie in ties:
        if len(tie.stages) < 2:
            continue
        for tensor, held in tie.tensors(device, grad_dtype):
            grad = grad_of(tensor) if held else tensor  # zeros where this stage holds no copy
            collectives.all_reduce(grad, op="sum", group=group)


def mark_replicas(ties: list[TiedKey], stage_id: int) -> None:
    """Flag the copies held by later holders ``ds_pipe_replicated`` (counted once in norms)."""
    for tie in ties:
        if tie.module is not None:
            for p in tie.module.parameters():
                setattr(p, "ds_pipe_replicated", stage_id != tie.stages[0])  # noqa: B010 - DeepSpeed's dynamic attribute
