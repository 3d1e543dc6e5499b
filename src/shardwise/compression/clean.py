"""``redundancy_clean``'s work: bake the compressed weights, then cut the pruned units out.

Pass 1 replaces every compression-aware module's weight and bias by what its forward used
(masks and quantization applied, as if every technique had reached its schedule) and returns it
to its plain class (a module with activation quantization keeps that one technique). Pass 2
removes the pruned units: the rows (row pruning) or output channels (channel pruning) of the
module and the matching input columns/channels of its related ``Linear``/``Conv2d`` modules
(features of a related ``BatchNorm2d``); the pruned heads' input columns of an attention output
and the matching output rows of the related query/key/value linears (a fused ``qkv`` linear whose
width is a multiple of the heads' width is cut in each part). Parameters shared by two modules
stay shared when neither changes shape.
"""

from __future__ import annotations

import torch
from torch import nn

from shardwise.compression.layers import PLAIN, CompressedModule
from shardwise.compression.structured import StructuredPruning

__all__ = ["clean_model"]

_PRUNING = ("sparse_pruning", "row_pruning", "head_pruning", "channel_pruning", "weight_quantization")


def _bake(module: CompressedModule, step: int, shared: dict[int, nn.Parameter]) -> dict[str, torch.Tensor]:
    """Pass 1 on one module; returns the keep masks of its structured techniques."""
    keeps: dict[str, torch.Tensor] = {}
    for technique in module.compression.values():
        if not technique.active:
            technique.update(module, max(step, technique.schedule_offset))
        if isinstance(technique, StructuredPruning) and technique.name in (
            "row_pruning",
            "head_pruning",
            "channel_pruning",
        ):
            keeps[technique.name] = technique.kept(module)
    original: nn.Parameter = module.weight  # type: ignore[assignment]
    with torch.no_grad():
        weight, bias = module.compressed_weight()
        weight, bias = weight.detach().clone(), None if bias is None else bias.detach().clone()
    for name in _PRUNING:
        if module.compression.pop(name, None) is None:
            continue
        for attr in (f"{name}_mask", f"{name}_scores", "snip_score"):
            if hasattr(module, attr):
                delattr(module, attr)
    previous = shared.get(id(original))
    if previous is not None and previous.shape == weight.shape and torch.equal(previous.data, weight):
        module.weight = previous
    else:
        module.weight = nn.Parameter(weight, requires_grad=original.requires_grad)
        shared.setdefault(id(original), module.weight)
    if bias is not None:
        old_bias: torch.Tensor = module.bias  # type: ignore[assignment]
        module.bias = nn.Parameter(bias, requires_grad=old_bias.requires_grad)
    if not module.compression:
        del module.compression
        module.__class__ = PLAIN[type(module)]  # type: ignore[assignment]
    return keeps


def _select(module: nn.Module, name: str, keep: torch.Tensor, dim: int) -> None:
    tensor = getattr(module, name, None)
    if tensor is None:
        return
    index = keep.nonzero().flatten().to(tensor.device)
    cut = tensor.detach().index_select(dim, index).clone()
    if isinstance(tensor, nn.Parameter):
        setattr(module, name, nn.Parameter(cut, requires_grad=tensor.requires_grad))
    else:
        setattr(module, name, cut)


def _cut_outputs(module: nn.Module, keep: torch.Tensor) -> None:
    """Keep the output rows/channels/features where ``keep`` (repeated for fused projections)."""
    if isinstance(module, nn.BatchNorm2d):
        for name in ("weight", "bias", "running_mean", "running_var"):
            _select(module, name, keep, 0)
        module.num_features = int(keep.sum())
        return
    weight: torch.Tensor = module.weight  # type: ignore[assignment]
    keep = keep.repeat(weight.shape[0] // keep.numel())
    _select(module, "weight", keep, 0)
    _select(module, "bias", keep, 0)
    if isinstance(module, nn.Linear):
        module.out_features = int(keep.sum())
    elif isinstance(module, nn.Conv2d):
        module.out_channels = int(keep.sum())


def _cut_inputs(module: nn.Module, keep: torch.Tensor) -> None:
    """Keep the input columns/channels of a related module where ``keep``."""
    if isinstance(module, nn.BatchNorm2d):
        _cut_outputs(module, keep)
        return
    _select(module, "weight", keep, 1)
    if isinstance(module, nn.Linear):
        module.in_features = int(keep.sum())
    elif isinstance(module, nn.Conv2d):
        module.in_channels = int(keep.sum())


def clean_model(model: nn.Module, related: dict[tuple[str, str], list[str]], step: int) -> None:
    """Bake and cut every compression-aware module of ``model`` (see the module docstring).

    Args:
        model: the prepared model.
        related: ``(module name, technique)`` -> the related modules' names.
        step: the scheduler's step (a technique not yet on is baked as at its ``schedule_offset``).
    """
    shared: dict[int, nn.Parameter] = {}
    plans = []
    for name, module in list(model.named_modules()):
        if isinstance(module, CompressedModule):
            plans.append((name, module, _bake(module, step, shared)))
    for name, module, keeps in plans:
        if "head_pruning" in keeps:
            heads = keeps["head_pruning"]
            weight: torch.Tensor = module.weight  # type: ignore[assignment]
            columns = heads.repeat_interleave(weight.shape[1] // heads.numel())
            _cut_inputs(module, columns)
            for partner in related.get((name, "head_pruning"), []):
                _cut_outputs(model.get_submodule(str(partner)), columns)
        for tech in ("row_pruning", "channel_pruning"):
            if tech in keeps:
                _cut_outputs(module, keeps[tech])
                for partner in related.get((name, tech), []):
                    target = model.get_submodule(str(partner))
                    if isinstance(target, nn.BatchNorm2d):
                        _cut_outputs(target, keeps[tech])
                    else:
                        _cut_inputs(target, keeps[tech])
