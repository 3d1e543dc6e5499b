"""Replace a model's layers with tensor-parallel ones: by a plan, or by DeepSpeed's name rules.

Which plan decides, highest first (DeepSpeed's order): the ``tensor_parallel`` section's
``preset_model`` / ``partition_config``; the model's own transformers ``_tp_plan``; the name
rules of :func:`heuristic_kind`. Layers a plan does not match stay whole (``strict_mode``: an
unmatched ``nn.Linear`` is an error).

:func:`split_model` returns a :class:`SplitReport`: which layers were split how, and the map from
each replaced parameter to its local replacement, so an optimizer or a parameter list built on
the whole model can be re-pointed.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import cast

from torch import nn

from shardwise.comm import collectives
from shardwise.tensor_parallel.layers import (
    ColumnParallelLinear,
    ParallelEmbedding,
    RowParallelLinear,
    TensorParallelLayer,
    TPGroup,
)
from shardwise.tensor_parallel.specs import LayerSpec, PartitionPlan

__all__ = ["Partitioner", "SplitReport", "heuristic_kind", "split_model"]

# DeepSpeed's AutoTP name rules for layers inside a stack of transformer blocks (nn.ModuleList):
_ROW_NAMES = frozenset({"o_proj", "down_proj", "out_proj", "dense_4h_to_h", "w2", "c_proj", "fc2", "wo"})
_SKIP_NAMES = frozenset({"gate", "router", "q_a_proj", "kv_a_proj_with_mqa", "shared_expert_gate", "shared_experts_gate"})
_NORM_KEYS = frozenset({"LayerNorm", "layer_norm", "ln_1", "ln_2"})


@dataclass
class SplitReport:
    """What :func:`split_model` did.

    Attributes:
        kinds: module name -> ``"column"``, ``"column+gather"``, ``"row"``, ``"embedding"`` or ``"grad_allreduce"``.
        replaced: ``id`` of each replaced parameter -> its replacement (a local slice, or the
            same whole parameter for a row layer's bias).
        source: what decided: ``"config"``, ``"tp_plan"`` or ``"names"``.
        originals: the replaced parameters, kept alive so their ids stay unique.
    """

    kinds: dict[str, str] = field(default_factory=dict)
    replaced: dict[int, nn.Parameter] = field(default_factory=dict)
    source: str = "names"
    originals: list[nn.Parameter] = field(default_factory=list)


def _followed_by_norm(parent: nn.Module, key: str) -> bool:
    keys = list(parent._modules)
    index = keys.index(key)
    if index + 1 >= len(keys):
        return False
    nxt_key = keys[index + 1]
    nxt = parent._modules[nxt_key]
    return isinstance(nxt, nn.LayerNorm) or nxt_key in _NORM_KEYS


def heuristic_kind(name: str, in_block_stack: bool, parent: nn.Module, key: str, plan: PartitionPlan) -> str | None:
    """DeepSpeed's default rule for the ``nn.Linear`` called ``name``: the output head is column-split
    with its output gathered; inside a stack of blocks, attention-output / MLP-down names (and a
    linear directly before a LayerNorm) are row-split, routers and low-rank projections stay whole,
    every other linear is column-split; outside a stack, nothing is split (None)."""
    if plan.is_lm_head(name):
        return "column+gather"
    if not in_block_stack or key in _SKIP_NAMES:
        return None
    if key in _ROW_NAMES or _followed_by_norm(parent, key):
        return "row"
    return "column"


def _kind_of_spec(spec: LayerSpec) -> str:
    if spec.partition_type == "row":
        return "row"
    if spec.partition_type == "column":
        return "column+gather" if spec.gather_output else "column"
    return "grad_allreduce" if spec.grad_allreduce else "skip"


def _sub_sizes(spec: LayerSpec | None, module: nn.Linear, dim: int) -> tuple[int, ...]:
    """The packed sub-parameter sizes along the split dimension from a spec's ``shape``."""
    if spec is None or spec.shape is None:
        return ()
    if len(spec.shape) != 2 or spec.split_dim != dim:
        raise ValueError(
            f"tensor_parallel layer spec {spec.patterns}: shape {spec.shape} with partition_dim {spec.split_dim} "
            f"reshapes the weight; shardwise splits 2-D shapes along the layer's own split dimension ({dim}) only; "
            "describe the packed sizes as [[q, k, v], -1] (column) or [-1, [a, b]] (row)"
        )
    total = module.weight.shape[dim]
    packed = spec.shape[dim]
    if isinstance(packed, tuple):
        return packed
    if packed == -1:
        return ()
    if total % packed:
        raise ValueError(f"tensor_parallel layer spec {spec.patterns}: {packed} packed sub-parameters do not divide "
                         f"the dimension of {total}; fix the spec's shape")
    return (total // packed,) * packed


def _grad_allreduce_hooks(module: nn.Module, tp: TPGroup) -> None:
    def summed(grad):
        grad = grad.clone()
        collectives.all_reduce(grad, op="sum", group=tp.group)
        return grad

    for param in module.parameters(recurse=False):
        if param.requires_grad and tp.size > 1:
            param.register_hook(summed)


def _shared_weights(model: nn.Module) -> set[int]:
    seen: dict[int, int] = {}
    for _, module in model.named_modules(remove_duplicate=False):
        for param in module.parameters(recurse=False):
            seen[id(param)] = seen.get(id(param), 0) + 1
    return {key for key, count in seen.items() if count > 1}


class Partitioner:
    """The walk behind :func:`split_model` (DeepSpeed's ``AutoTP`` module walk): every child of a
    module either is replaced by a tensor-parallel layer, gets a gradient all-reduce, or is walked
    into; an AutoEP layer (``_is_autoep_layer``) keeps its router and routed experts whole (AutoEP
    places them by expert) and only its shared experts are split, like any dense MLP.

    Args: as :func:`split_model`; :attr:`report` collects what was split.
    """

    def __init__(self, model: nn.Module, tp: TPGroup, plan: PartitionPlan | None, *, source: str = "config",
                 model_type: str | None = None, kv_heads: int | None = None) -> None:
        self.tp, self.plan, self.model_type, self.kv_heads = tp, plan, model_type, kv_heads
        self.report = SplitReport(source=source if plan is not None else "names")
        self.names_plan = plan if plan is not None else PartitionPlan()
        self.shared = _shared_weights(model)

    def _replace_module(self, r_module: nn.Module, prev_name: str = "", in_stack: bool = False) -> nn.Module:
        """Split ``r_module``'s children (their names prefixed by ``prev_name``) in place; returns it."""
        for key, child in list(r_module._modules.items()):
            if child is None:
                continue
            name = f"{prev_name}.{key}" if prev_name else key
            if getattr(child, "_is_autoep_layer", False):
                self._replace_autoep_shared_experts(child, name)
                continue
            self._replace_child(r_module, key, child, name, in_stack)
        return r_module

    def _replace_autoep_shared_experts(self, autoep_layer: nn.Module, autoep_name: str) -> None:
        """Split an AutoEP layer's ``shared_experts`` and ``shared_experts_gate`` (router and routed
        experts stay whole: every tensor-parallel lane routes alike)."""
        for key in ("shared_experts", "shared_experts_gate"):
            child = getattr(autoep_layer, key, None)
            if isinstance(child, nn.Module):
                self._replace_child(autoep_layer, key, child, f"{autoep_name}.{key}", True)

    def _replace_child(self, parent: nn.Module, key: str, child: nn.Module, name: str, in_stack: bool) -> None:
        tp, report = self.tp, self.report
        if isinstance(child, TensorParallelLayer):
            return
        kind, spec = self._decide(child, name, parent, key, in_stack)
        if kind in (None, "skip"):
            self._replace_module(child, name, in_stack or isinstance(child, nn.ModuleList))
            return
        if kind == "grad_allreduce":
            _grad_allreduce_hooks(child, tp)
            report.kinds[name] = kind
            return
        if id(child.weight) in self.shared:
            raise ValueError(
                f"tensor parallelism would split {name}.weight, which another module shares (tied "
                "embeddings); untie it (e.g. tie_word_embeddings=False) or leave it whole with a layer spec "
                f'{{"patterns": ["{name}\\\\.weight$"], "partition_type": "skip"}}'
            )
        replacement = self._replace(child, name, kind, spec)
        for attr in ("weight", "bias"):
            old = getattr(child, attr, None)
            if isinstance(old, nn.Parameter):
                report.replaced[id(old)] = getattr(replacement, attr)
                report.originals.append(old)
        setattr(parent, key, replacement)
        report.kinds[name] = kind

    def _decide(self, child: nn.Module, name: str, parent: nn.Module, key: str,
                in_stack: bool) -> tuple[str | None, LayerSpec | None]:
        plan, model_type = self.plan, self.model_type
        weight = getattr(child, "weight", None)
        if not isinstance(weight, nn.Parameter) or weight.dim() != 2 or not isinstance(child, nn.Linear | nn.Embedding):
            if plan is not None and isinstance(weight, nn.Parameter):
                spec = plan.find(f"{name}.weight", model_type)
                if spec is not None and spec.partition_type != "skip":
                    raise ValueError(f"tensor_parallel: layer spec {spec.patterns} matches {name}.weight of a "
                                     f"{type(child).__name__}; only nn.Linear and nn.Embedding are split")
                if spec is not None and spec.grad_allreduce:
                    return "grad_allreduce", spec
            return None, None
        if plan is None:
            if isinstance(child, nn.Embedding):
                return None, None
            return heuristic_kind(name, in_stack, parent, key, self.names_plan), None
        spec = plan.find(f"{name}.weight", model_type)
        if spec is None:
            if plan.strict_mode and isinstance(child, nn.Linear):
                raise ValueError(f"tensor_parallel.partition_config.strict_mode: no layer spec matches "
                                 f"{name}.weight; add a spec for it (partition_type 'skip' keeps it whole)")
            return None, None
        if isinstance(child, nn.Embedding) and spec.partition_type != "skip":
            return "embedding", spec
        return _kind_of_spec(spec), spec

    def _replace(self, child: nn.Module, name: str, kind: str, spec: LayerSpec | None) -> nn.Module:
        tp, kv_heads = self.tp, self.kv_heads
        if kind == "embedding":  # _decide returns "embedding" for an nn.Embedding only
            return ParallelEmbedding(cast(nn.Embedding, child), tp, name, dim=self.names_plan.embedding_partition_dim)
        linear = cast(nn.Linear, child)  # every other kind is an nn.Linear's
        dim = 1 if kind == "row" else 0
        total = linear.weight.shape[dim]
        attention = ("attn" in name or "attention" in name) and kv_heads and total % kv_heads == 0
        unit = total // kv_heads if attention and kv_heads else 1
        if kind == "row":
            return RowParallelLinear(linear, tp, name, sub_sizes=_sub_sizes(spec, linear, 1), unit=unit)
        return ColumnParallelLinear(linear, tp, name, gather_output=kind == "column+gather",
                                    sub_sizes=_sub_sizes(spec, linear, 0), unit=unit)


def split_model(model: nn.Module, tp: TPGroup, plan: PartitionPlan | None, *, source: str = "config",
                model_type: str | None = None, kv_heads: int | None = None) -> SplitReport:
    """Replace ``model``'s layers in place with tensor-parallel ones over ``tp``.

    Args:
        model: the whole model (every rank holds the same values: the ranks' slices come from them).
        tp: the tensor-parallel group, this rank's index and the degree.
        plan: the layer specs to follow, or None for DeepSpeed's name rules.
        source: what the plan came from (recorded in the report).
        model_type: the model's ``config.model_type`` for specs limited by ``model_types``.
        kv_heads: the model's key-value head count: attention projections are cut in whole
            multiples of ``features / kv_heads``, so every rank holds whole (grouped) heads.

    Raises:
        ValueError: a weight shared between modules would be split (untie it or skip it), an
            unmatched linear under ``strict_mode``, or no layer to split by the name rules.
    """
    walker = Partitioner(model, tp, plan, source=source, model_type=model_type, kv_heads=kv_heads)
    walker._replace_module(model)
    report = walker.report
    if plan is None and not any(k == "row" for k in report.kinds.values()) and tp.size > 1:
        raise ValueError(
            f"tensor parallelism: {type(model).__name__} has no layer DeepSpeed's name rules split by rows "
            "(o_proj, down_proj, out_proj, dense_4h_to_h, ... inside a stack of blocks), so its split cannot be "
            "inferred; set tensor_parallel.preset_model (llama, qwen2, bloom, ...) or "
            "tensor_parallel.partition_config.layer_specs"
        )
    return report
