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

__all__ = ["SplitReport", "heuristic_kind", "split_model"]

# DeepSpeed's AutoTP name rules for layers inside a stack of transformer blocks (nn.ModuleList):
_ROW_NAMES = frozenset({"o_proj", "down_proj", "out_proj", "dense_4h_to_h", "w2", "c_proj", "fc2", "wo"})
_SKIP_NAMES = frozenset({"gate", "router", "q_a_proj", "kv_a_proj_with_mqa", "shared_expert_gate"})
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
    report = SplitReport(source=source if plan is not None else "names")
    names_plan = plan if plan is not None else PartitionPlan()
    shared = _shared_weights(model)

    def visit(parent: nn.Module, prefix: str, in_stack: bool) -> None:
        for key, child in list(parent._modules.items()):
            if child is None:
                continue
            name = f"{prefix}{key}"
            if isinstance(child, TensorParallelLayer):
                continue
            kind, spec = _decide(child, name, parent, key, in_stack)
            if kind in (None, "skip"):
                visit(child, name + ".", in_stack or isinstance(child, nn.ModuleList))
                continue
            if kind == "grad_allreduce":
                _grad_allreduce_hooks(child, tp)
                report.kinds[name] = kind
                continue
            if id(child.weight) in shared:
                raise ValueError(
                    f"tensor parallelism would split {name}.weight, which another module shares (tied "
                    "embeddings); untie it (e.g. tie_word_embeddings=False) or leave it whole with a layer spec "
                    f'{{"patterns": ["{name}\\\\.weight$"], "partition_type": "skip"}}'
                )
            replacement = _replace(child, name, kind, spec)
            for attr in ("weight", "bias"):
                old = getattr(child, attr, None)
                if isinstance(old, nn.Parameter):
                    report.replaced[id(old)] = getattr(replacement, attr)
                    report.originals.append(old)
            setattr(parent, key, replacement)
            report.kinds[name] = kind

    def _decide(child: nn.Module, name: str, parent: nn.Module, key: str,
                in_stack: bool) -> tuple[str | None, LayerSpec | None]:
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
            return heuristic_kind(name, in_stack, parent, key, names_plan), None
        spec = plan.find(f"{name}.weight", model_type)
        if spec is None:
            if plan.strict_mode and isinstance(child, nn.Linear):
                raise ValueError(f"tensor_parallel.partition_config.strict_mode: no layer spec matches "
                                 f"{name}.weight; add a spec for it (partition_type 'skip' keeps it whole)")
            return None, None
        if isinstance(child, nn.Embedding) and spec.partition_type != "skip":
            return "embedding", spec
        return _kind_of_spec(spec), spec

    def _replace(child: nn.Module, name: str, kind: str, spec: LayerSpec | None) -> nn.Module:
        if kind == "embedding":  # _decide returns "embedding" for an nn.Embedding only
            return ParallelEmbedding(cast(nn.Embedding, child), tp, name, dim=names_plan.embedding_partition_dim)
        linear = cast(nn.Linear, child)  # every other kind is an nn.Linear's
        dim = 1 if kind == "row" else 0
        total = linear.weight.shape[dim]
        attention = ("attn" in name or "attention" in name) and kv_heads and total % kv_heads == 0
        unit = total // kv_heads if attention and kv_heads else 1
        if kind == "row":
            return RowParallelLinear(linear, tp, name, sub_sizes=_sub_sizes(spec, linear, 1), unit=unit)
        return ColumnParallelLinear(linear, tp, name, gather_output=kind == "column+gather",
                                    sub_sizes=_sub_sizes(spec, linear, 0), unit=unit)

    visit(model, "", False)
    if plan is None and not any(k == "row" for k in report.kinds.values()) and tp.size > 1:
        raise ValueError(
            f"tensor parallelism: {type(model).__name__} has no layer DeepSpeed's name rules split by rows "
            "(o_proj, down_proj, out_proj, dense_4h_to_h, ... inside a stack of blocks), so its split cannot be "
            "inferred; set tensor_parallel.preset_model (llama, qwen2, bloom, ...) or "
            "tensor_parallel.partition_config.layer_specs"
        )
    return report
