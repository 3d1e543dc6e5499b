"""Copying a source MoE block's weights into an AutoEP layer: the router's gate (and score-correction
bias), and this rank's slice of the experts as stacked ``w1`` / ``w2`` / ``w3``.

Source parameters partitioned by ZeRO-3 construction (``zero.Init``: they carry ``ds_id``) are read
inside :data:`GatheredParameters` (``modifier_rank=None``: read only; the gathered values replace the
placeholders in their modules while inside, so they are looked up again there), the router's in one block,
fused experts in one block, a module list one expert at a time in global order (every rank enters
every block: the gathers are collective).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from typing import Any

import torch
from torch import Tensor, nn

from shardwise.autoep.fused_layout import split_fused_gate_up
from shardwise.zero import GatheredParameters

__all__ = ["GatheredParameters", "gathered_source", "repack_expert_requires_grad_flags", "repack_expert_weights"]


@contextlib.contextmanager
def gathered_source(params: Sequence[Any]) -> Iterator[None]:
    """Full data of the ZeRO-partitioned ones among ``params`` (None entries and ordinary tensors
    are left as they are; nothing to gather: no collective)."""
    partitioned = [p for p in params if isinstance(p, Tensor) and hasattr(p, "ds_id")]
    if not partitioned:
        yield
        return
    with GatheredParameters(partitioned, modifier_rank=None):
        yield


def _local_range(spec: Any, ep_rank: int, ep_size: int) -> range:
    local = spec.num_experts // ep_size
    return range(ep_rank * local, (ep_rank + 1) * local)


def _expert_tensors(experts: nn.Module, spec: Any, index: int | None = None) -> list[Tensor]:
    """``[w1, w2, w3]`` of a module-list expert ``index``, or the fused tensors (w3 may be absent)."""
    owner = experts[index] if index is not None else experts  # type: ignore[index]
    names = [spec.expert_w1_name, spec.expert_w2_name, spec.expert_w3_name]
    found: list[Tensor] = []
    for name in names:
        if name is None:
            continue
        value = getattr(owner, name)
        tensor = value.weight if isinstance(value, nn.Module) else value
        assert isinstance(tensor, Tensor), (spec.moe_module_name, name)
        found.append(tensor)
    return found


def _uniform(tensors: list[Tensor], spec: Any) -> None:
    if len({t.requires_grad for t in tensors}) > 1:
        raise ValueError(
            f"AutoEP layer {spec.moe_module_name!r}: its experts' weights have mixed requires_grad flags; "
            "rule: the stacked w1/w2/w3 of a layer are trained or frozen as a whole; fix: freeze all experts "
            "of the layer or none"
        )
    if len({(t.dtype, t.device) for t in tensors}) > 1:
        raise ValueError(
            f"AutoEP layer {spec.moe_module_name!r}: its experts' weights have mixed dtype/device "
            f"({sorted({f'{t.dtype}@{t.device}' for t in tensors})}); rule: they are stacked into one tensor "
            "per projection; fix: cast the model to one dtype and device before initialize"
        )


def repack_expert_requires_grad_flags(experts_source: nn.Module, spec: Any, ep_rank: int,
                                      ep_size: int) -> tuple[bool, bool, bool]:
    """Whether the stacked ``w1``, ``w2``, ``w3`` train (mixed flags among experts refused)."""
    if spec.expert_storage == "module_list":
        per_expert = [_expert_tensors(experts_source, spec, e) for e in range(spec.num_experts)]
        columns = [[tensors[i] for tensors in per_expert] for i in range(3)]
        for column in columns:
            _uniform(column, spec)
        return columns[0][0].requires_grad, columns[1][0].requires_grad, columns[2][0].requires_grad
    tensors = _expert_tensors(experts_source, spec)
    w1, w2 = tensors[0], tensors[1]
    w3 = tensors[2] if len(tensors) > 2 else w1
    return w1.requires_grad, w2.requires_grad, w3.requires_grad


def repack_expert_weights(experts_source: nn.Module, spec: Any, ep_rank: int, ep_size: int,
                          ) -> tuple[Tensor, Tensor, Tensor]:
    """This rank's experts (global indices ``ep_rank * E/ep`` onwards) as ``w1 [L, F, H]``,
    ``w2 [L, H, F]``, ``w3 [L, F, H]`` copies, in the source's dtype and device (a fused gate/up
    tensor in either layout of :mod:`~shardwise.autoep.fused_layout`)."""
    keep = _local_range(spec, ep_rank, ep_size)
    if spec.expert_storage == "module_list":
        picked: list[list[Tensor]] = []
        for e in range(spec.num_experts):
            tensors = _expert_tensors(experts_source, spec, e)
            with gathered_source(tensors):  # the gathered values stand in the module while inside
                if e in keep:
                    picked.append([t.detach().clone() for t in _expert_tensors(experts_source, spec, e)])
        everything = [t for e in range(spec.num_experts) for t in _expert_tensors(experts_source, spec, e)]
        _uniform(everything, spec)
        return tuple(torch.stack([p[i] for p in picked]) for i in range(3))  # type: ignore[return-value]
    if spec.expert_storage != "fused_3d":
        raise ValueError(f"AutoEP layer {spec.moe_module_name!r}: expert_storage = {spec.expert_storage!r}; "
                         "rule: 'fused_3d' or 'module_list'; fix: use a preset that describes the model")
    tensors = _expert_tensors(experts_source, spec)
    _uniform(tensors, spec)
    with gathered_source(tensors):  # the gathered values stand in the module while inside
        local = [t.detach()[keep.start:keep.stop].clone() for t in _expert_tensors(experts_source, spec)]
    if spec.expert_w3_name is None:  # w1 holds gate and up fused, in either layout
        gate_up, down = local
        return split_fused_gate_up(gate_up, down, f"AutoEP layer {spec.moe_module_name!r}")
    w1, w2, w3 = local
    return w1, w2, w3
