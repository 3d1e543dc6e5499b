"""What ``initialize`` does for a ``tensor_parallel`` section: split the model over the mesh's
``tp`` dimension and re-point whatever was built on the whole model.

The degree is ``tensor_parallel.autotp_size`` (or ``tp_model_init``'s, merged into the config
first); the group is the topology's tensor-parallel group (``comm.mesh``), never one of our own.
The layer rules: the section's ``preset_model`` / ``partition_config``, else the model's
transformers ``_tp_plan``, else DeepSpeed's name rules.
"""

from __future__ import annotations

from typing import Any

from torch import nn

from shardwise.comm.topology import Topology
from shardwise.config.sections.features import TensorParallelConfig
from shardwise.tensor_parallel.batch_check import install_batch_check
from shardwise.tensor_parallel.hf_plan import hf_tp_plan, specs_from_hf_plan
from shardwise.tensor_parallel.layers import TensorParallelLayer, TPGroup
from shardwise.tensor_parallel.partitioner import SplitReport, split_model
from shardwise.tensor_parallel.presets import resolve_plan
from shardwise.tensor_parallel.specs import PartitionPlan

__all__ = ["check_section", "remap_optimizer", "remap_parameters", "split_for_engine", "split_parameter_names", "tp_group_of"]


def check_section(section: TensorParallelConfig) -> PartitionPlan | None:
    """The section's plan (model-free checks for ``config check`` too).

    Raises:
        ValueError: a bad preset or partition_config, or a setting shardwise does not provide.
    """
    if section.vocab_parallel_lm_head:
        raise ValueError(
            "tensor_parallel.vocab_parallel_lm_head = true: shardwise has no vocabulary-parallel output head; "
            "remove it (the head is column-split with its output gathered) or set it to false"
        )
    return resolve_plan(preset_model=section.preset_model, partition_config=section.partition_config)


def tp_group_of(topology: Topology) -> TPGroup:
    """The tensor-parallel group of ``topology`` (its model-parallel dimension)."""
    return TPGroup(topology.mp_group if topology.mp_size > 1 else None, topology.mp_rank, topology.mp_size)


def _kv_heads(model: nn.Module) -> int | None:
    config = getattr(model, "config", None)
    config = getattr(config, "text_config", None) or config
    for name in ("num_key_value_heads", "num_attention_heads", "n_head"):
        value = getattr(config, name, None)
        if isinstance(value, int) and value > 0:
            return value
    return None


def split_for_engine(model: nn.Module, section: TensorParallelConfig, topology: Topology, *,
                     zero_stage: int = 0) -> SplitReport | None:
    """Split ``model`` in place when ``autotp_size`` > 1; None otherwise.

    Raises:
        ValueError: the topology's tensor-parallel degree is not ``autotp_size`` (the layout was
            declared by someone else), the plan cannot be applied, or it sums a replicated
            parameter's gradient (``grad_allreduce``) at ZeRO stage 3, where FSDP2 replaces the
            parameter that carries the hook.
    """
    plan = check_section(section)
    size = section.autotp_size
    if size <= 1:
        return None
    if topology.mp_size != size:
        raise ValueError(
            f"tensor_parallel.autotp_size = {size}, but the process layout has a tensor-parallel degree of "
            f"{topology.mp_size}; an mpu passed to initialize must report model-parallel size {size}, or drop it"
        )
    source = "config"
    if plan is None:
        hf_plan = hf_tp_plan(model)
        if hf_plan:
            plan, source = PartitionPlan(specs=specs_from_hf_plan(hf_plan)), "tp_plan"
    config = getattr(model, "config", None)
    tp = tp_group_of(topology)
    report = split_model(model, tp, plan, source=source, model_type=getattr(config, "model_type", None),
                         kv_heads=_kv_heads(model))
    summed = sorted(name for name, kind in report.kinds.items() if kind == "grad_allreduce")
    if summed and zero_stage == 3:
        raise ValueError(
            f"tensor parallelism: {summed} sum their gradients over the tensor-parallel ranks "
            "(replicated_with_grad_allreduce / grad_allreduce), which shardwise does at ZeRO stages 0-2 only; "
            "use stage 0-2, or a layer spec that splits those layers"
        )
    install_batch_check(model, tp)
    return report


def remap_parameters(items: Any, report: SplitReport) -> Any:
    """``model_parameters`` (tensors or param-group dicts) with every replaced parameter re-pointed."""
    if items is None:
        return None

    def mapped(params: Any) -> list[Any]:
        return [report.replaced.get(id(p), p) for p in params]

    listed = list(items)
    if listed and isinstance(listed[0], dict):
        return [{**group, "params": mapped(group["params"])} for group in listed]
    return mapped(listed)


def remap_optimizer(optimizer: object, report: SplitReport) -> None:
    """Re-point a client ``torch.optim.Optimizer`` built on the whole model at the local slices."""
    for group in getattr(optimizer, "param_groups", None) or ():
        group["params"] = [report.replaced.get(id(p), p) for p in group["params"]]


def split_parameter_names(model: nn.Module) -> frozenset[str]:
    """The names of the parameters ``model`` holds only a tensor-parallel slice of: those of its
    tensor-parallel layers and any marked ``tensor_model_parallel`` / ``model_parallel`` (an mpu's
    Megatron-style layers)."""
    names = {
        f"{prefix}.{name}" if prefix else name
        for prefix, module in model.named_modules()
        if isinstance(module, TensorParallelLayer)
        for name in module.splits
    }
    marked = {name for name, p in model.named_parameters()
              if getattr(p, "tensor_model_parallel", False) or getattr(p, "model_parallel", False)}
    return frozenset(names | marked)
