"""Stage 3 with expert parallelism: which modules are sharded over the expert-data-parallel group.

With ``ep_size > 1`` each rank of an expert-parallel group holds *other* experts under the same
local names (``deepspeed_experts.0`` is global expert 0 on expert-parallel rank 0 and expert 2 on
rank 1 of ``ep_size=2`` with four experts). FSDP2 shards a unit's parameters over one mesh, so:

- every *expert root* (a module whose parameters are all expert parameters -- DeepSpeed's
  ``allreduce = False`` marker, :func:`shardwise.zero.reduction_domain.expert_group_name` -- under a
  parent that holds dense ones: a MoE layer's ``Experts``, an AutoEP layer's ``GroupedExperts``)
  becomes a unit of its own, ``fully_shard`` ed over the expert-data-parallel mesh (the ranks
  holding the same experts, :func:`shardwise.comm.mesh.expert_data_parallel_mesh`);
- every other unit (and the root) shards over the data-parallel mesh and holds no expert parameter.

So the expert all-to-all meets each rank's own experts gathered whole over their own group, and
their gradients are reduce-scattered over that group only (a plain sum, like every stage-3
reduction). The optimizer divides every gradient by the data-parallel size (DeepSpeed's "average by
global dp", as at stages 0-2, :mod:`shardwise.zero.reduction_domain`): an expert's owner already
holds the sum over every expert-parallel rank's tokens (the all-to-all's backward), so the result is
the gradient of an ``ep_size=1`` run. The gradient norm needs nothing more: the dense shards
partition the data-parallel group and the expert shards partition each expert group over its
expert-data-parallel ranks, so the squared norms of the local shards, summed over the data-parallel
group, count every element of every expert once.

Expert parameters are always sharded (never kept whole as small "persistent" parameters, which are
all-reduced over the data-parallel group); what cannot be sharded that way is refused by name
(:func:`refuse_unshardable_experts`).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from torch import nn

from shardwise.comm.group_type import Group
from shardwise.zero.reduction_domain import expert_group_name
from shardwise.zero.wrap_policy import ModuleNode


@dataclass(frozen=True)
class ExpertSharding:
    """Where stage 3 shards expert parameters: the expert-data-parallel ``mesh`` (a DeviceMesh) and
    its ``group`` / ``size`` (the first rank of the group is the source of the start-up broadcast)."""

    mesh: Any
    group: Group
    size: int
    ep_size: int


def is_expert(param: nn.Parameter) -> bool:
    """An expert parameter (DeepSpeed's ``allreduce = False`` marker)."""
    return expert_group_name(param) is not None


def expert_roots(model: nn.Module, nodes: Mapping[str, ModuleNode]) -> list[str]:
    """The modules that become expert units, in registration order: the outermost modules whose
    parameters are all expert parameters (a container without a forward of its own -- a bare
    ``ModuleList`` -- gives its children instead).

    Raises:
        ValueError: a module holds expert and dense parameters directly, or an expert parameter is
            used outside its root (tied to a dense module), so no unit can hold it alone.
    """
    modules = dict(model.named_modules())
    all_expert: dict[str, bool] = {}
    for name, module in reversed(list(modules.items())):  # children first
        params = list(module.parameters())
        all_expert[name] = bool(params) and all(is_expert(p) for p in params)
        direct = [p for p in module._parameters.values() if p is not None]
        if any(is_expert(p) for p in direct) and not all(is_expert(p) for p in direct):
            raise ValueError(
                f"module {name or '<root>'!r} ({type(module).__name__}) registers expert parameters (allreduce=False) "
                "next to dense ones: at ZeRO stage 3 with expert parallelism the experts are sharded over their "
                "expert-data-parallel group and the rest over the data-parallel group, so they cannot share a "
                "module; fix: keep a MoE layer's experts in a module of their own (as deepspeed.moe and AutoEP do)"
            )
    roots: list[str] = []

    def visit(name: str) -> None:
        node = nodes[name]
        if all_expert.get(name) and name != "" and node.wrappable:
            if not node.confined:
                raise ValueError(
                    f"expert module {name!r}: one of its parameters is also used outside it (tied or registered "
                    "as external); at ZeRO stage 3 with expert parallelism an expert unit must own its "
                    "parameters; fix: untie the expert weights"
                )
            roots.append(name)
            return
        for child in node.children:
            visit(child)

    visit("")
    if all_expert.get(""):
        raise ValueError(
            "every parameter of the model is an expert parameter (allreduce=False): at ZeRO stage 3 with expert "
            "parallelism the experts must sit in a module of their own below the root; fix: wrap the MoE layer "
            "in a model with its dense parts"
        )
    return roots


def _inside(name: str, root: str) -> bool:
    return name == root or name.startswith(root + ".")


def merge_units(
    names: Sequence[str],
    numels: Sequence[int],
    roots: Sequence[str],
    nodes: Mapping[str, ModuleNode],
    registration: Sequence[str],
) -> tuple[list[str], list[int]]:
    """The unit list with the expert roots in it, in execution order, and each unit's own elements
    (``registration``: every module name in ``named_modules()`` order).

    Units the policy chose inside an expert root are dropped (the root is the unit); an expert root
    inside a chosen unit follows it (it runs within that unit's forward), and that unit's size no
    longer counts the experts, which it does not gather.
    """
    kept = [(n, k) for n, k in zip(names, numels) if not any(_inside(n, r) for r in roots)]
    placed: set[str] = set()
    out_names: list[str] = []
    out_numels: list[int] = []
    order = {name: i for i, name in enumerate(registration)}
    for name, numel in kept:
        inner = [r for r in roots if _inside(r, name) and r != name]
        out_names.append(name)
        out_numels.append(numel - sum(nodes[r].numel for r in inner))
        for root in inner:
            out_names.append(root)
            out_numels.append(nodes[root].numel)
            placed.add(root)
    loose = [r for r in roots if r not in placed]  # under the root unit: by registration order
    for root in sorted(loose, key=lambda r: order[r]):
        position = next((i for i, n in enumerate(out_names) if order[n] > order[root]), len(out_names))
        out_names.insert(position, root)
        out_numels.insert(position, nodes[root].numel)
    return out_names, out_numels


def refuse_unshardable_experts(named: Iterable[tuple[str, nn.Parameter]], *, zero_init: Any) -> None:
    """Expert parameters stage 3 cannot shard over their expert-data-parallel group, refused by name:
    scalars (FSDP2 keeps them whole on every rank), Muon's matrices (kept whole for its step) and
    parameters ``zero.Init`` already partitioned over the data-parallel group (``zero_init(p)`` is
    their stash)."""
    for name, param in named:
        if not is_expert(param):
            continue
        if zero_init(param) is not None:
            raise ValueError(
                f"expert parameter {name!r} was already partitioned by shardwise.zero.Init over the data-parallel "
                "group, but at ZeRO stage 3 with expert parallelism experts are partitioned over their "
                "expert-data-parallel group; fix: build the MoE layers (or the model AutoEP converts) outside "
                "zero.Init"
            )
        if param.dim() == 0:
            raise ValueError(
                f"expert parameter {name!r} is a scalar: FSDP2 cannot shard it, and a whole copy would be averaged "
                "over the data-parallel group with other ranks' experts; fix: give it shape [1]"
            )
        if getattr(param, "use_muon", False):
            raise ValueError(
                f"expert parameter {name!r} with the Muon optimizer at ZeRO stage 3 and expert parallelism: Muon keeps "
                "its matrices whole on every data-parallel rank; fix: use ZeRO stage 1 or 2 for Muon with experts"
            )


def refuse_zero3_expert_parallel(
    *, ep_size: int, sequence_parallel_size: int, quantized_gradients: bool, hpz_partition_size: int
) -> None:
    """The combinations ZeRO stage 3 with expert parallelism does not take, as DeepSpeed's AutoEP ZeRO-3
    gate refuses them (its phrases kept), each naming the key, the value and the fix. Raises
    :class:`~shardwise.config.errors.AssertedConfigError` (a ``ValueError`` and an ``AssertionError``)."""
    from shardwise.config.errors import AssertedConfigError

    context = f"expert parallelism (ep_size={ep_size}) with ZeRO Stage 3"
    if sequence_parallel_size != 1:
        raise AssertedConfigError(
            "sequence_parallel_size",
            f"{context} does not support sequence parallelism yet: sequence-parallel ranks would join the "
            "expert-data-parallel sharding of the experts",
            "set sequence_parallel_size to 1, or use ZeRO stage 1 or 2 with expert parallelism",
            value=sequence_parallel_size,
        )
    if quantized_gradients:
        raise AssertedConfigError(
            "zero_optimization.zero_quantized_gradients",
            f"{context} does not support zero_quantized_gradients yet (qgZ's all-to-all reduction runs over the "
            "data-parallel group, the experts reduce over their expert-data-parallel group)",
            "set zero_quantized_gradients to false",
            value=True,
        )
    if hpz_partition_size > 1:
        raise AssertedConfigError(
            "zero_optimization.zero_hpz_partition_size",
            f"{context} does not support hpZeRO secondary tensor groups yet (the secondary groups are runs of "
            "the data-parallel group, not of the experts' expert-data-parallel group)",
            "set zero_hpz_partition_size to 1",
            value=hpz_partition_size,
        )
