"""Which modules become FSDP2 shard units, and how each unit prefetches and reshards.

A *shard unit* is a module ``fully_shard`` is applied to: its parameters are gathered
with one all-gather and their gradients reduced with one reduce-scatter. The automatic
policy:

1. ``leaf_module`` matches (class path, bare class name, module name or name suffix)
   are one unit each and are not split further;
2. *blocks*: children of a container (``ModuleList``, ``Sequential``, ``ModuleDict``)
   whose class occurs at least twice among the siblings (transformer layers) are one
   unit each;
3. with ``stage3_module_granularity_threshold`` set, a module whose elements per
   descendant fall below it is one unit (not split);
4. leaves (modules without children holding parameters) outside blocks with at least
   ``leaf_unit_min_numel`` elements are one unit each;
5. the root holds everything else.

A module can only be a unit when every parameter under it is used by modules under it
alone: a parameter tied to a module outside (tied embeddings) or registered as external
stays with a common ancestor, ultimately the root, so ties are never split between units.

Then, in execution (registration) order:

- :func:`reshard_plan`: a unit stays gathered between its forward and its backward
  (``reshard_after_forward=False``) when its reuse distance (elements gathered by the
  units after it, forward and backward) is within ``stage3_max_reuse_distance`` and the
  units kept so far still fit in ``stage3_max_live_parameters``.
- :func:`prefetch_plan`: how many following units each unit prefetches within
  ``stage3_prefetch_bucket_size`` elements.

The decisions are pure functions over :class:`ModuleNode` descriptions; only
:func:`describe_modules` looks at a real ``nn.Module``.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass

from torch import nn

from shardwise.comm.fsdp_internals import is_fully_shard_class


@dataclass(frozen=True)
class ModuleNode:
    """One module, as the policy sees it.

    Attributes:
        name: fully qualified name (``""`` for the root).
        class_path: ``module.__qualname__`` of its class, prefixed by the class's module.
        numel: elements of the (shardable) parameters in its subtree, each counted once.
        children: names of its direct children, in registration order.
        descendants: number of modules below it.
        is_container: a ``ModuleList``/``ModuleDict`` (no forward; FSDP2 cannot wrap it) or
            ``Sequential`` (its children are candidate blocks).
        wrappable: FSDP2 may wrap it (it has a forward of its own).
        confined: no parameter under it is used by a module outside it, or is external.
    """

    name: str
    class_path: str
    numel: int
    children: tuple[str, ...]
    descendants: int
    is_container: bool
    wrappable: bool
    confined: bool


@dataclass(frozen=True)
class WrapRules:
    """What the automatic policy needs from the config."""

    leaf_classes: tuple[str, ...] = ()
    leaf_names: tuple[str, ...] = ()
    leaf_suffixes: tuple[str, ...] = ()
    granularity_threshold: int = 0
    leaf_unit_min_numel: int = 1 << 20


def _is_leaf_match(node: ModuleNode, rules: WrapRules) -> bool:
    bare = node.class_path.rsplit(".", 1)[-1]
    if node.class_path in rules.leaf_classes or bare in rules.leaf_classes:
        return True
    if node.name in rules.leaf_names:
        return True
    return any(node.name.endswith(s) for s in rules.leaf_suffixes if s)


def choose_units(nodes: Mapping[str, ModuleNode], rules: WrapRules) -> list[str]:
    """Names of the shard units below the root, in registration (execution) order.

    Units never nest: a unit is not searched for further units.

    Example:
        >>> def n(name, cls, numel, children=(), container=False):
        ...     return ModuleNode(name, cls, numel, tuple(children), len(children), container, not container, True)
        >>> nodes = {
        ...     "": n("", "m.GPT", 30, ["emb", "layers"]),
        ...     "emb": n("emb", "torch.nn.Embedding", 10),
        ...     "layers": n("layers", "torch.nn.ModuleList", 20, ["layers.0", "layers.1"], container=True),
        ...     "layers.0": n("layers.0", "m.Block", 10),
        ...     "layers.1": n("layers.1", "m.Block", 10),
        ... }
        >>> choose_units(nodes, WrapRules(leaf_unit_min_numel=100))
        ['layers.0', 'layers.1']
    """
    units: list[str] = []

    def usable(node: ModuleNode) -> bool:
        return node.name != "" and node.wrappable and node.confined and node.numel > 0

    def visit(name: str) -> None:
        node = nodes[name]
        if usable(node) and _is_leaf_match(node, rules):
            units.append(name)
            return
        if (
            usable(node)
            and rules.granularity_threshold > 0
            and node.descendants > 0
            and node.numel / node.descendants < rules.granularity_threshold
        ):
            units.append(name)
            return
        if not node.children:
            if usable(node) and node.numel >= rules.leaf_unit_min_numel:
                units.append(name)
            return
        blocks = block_children(node, nodes)
        for child in node.children:
            if child in blocks and usable(nodes[child]):
                units.append(child)
            else:
                visit(child)

    visit("")
    return units


def block_children(node: ModuleNode, nodes: Mapping[str, ModuleNode]) -> set[str]:
    """The *blocks* among ``node``'s children: in a container (``ModuleList``, ``Sequential``,
    ``ModuleDict``), the children whose class occurs at least twice among the siblings (transformer
    layers). The one definition of a block: stage 3 shards each as a unit (:func:`choose_units`) and
    ``engine.compile`` compiles each (:func:`repeated_blocks`)."""
    if not node.is_container:
        return set()
    counts: dict[str, int] = {}
    for child in node.children:
        counts[nodes[child].class_path] = counts.get(nodes[child].class_path, 0) + 1
    return {c for c in node.children if counts[nodes[c].class_path] >= 2}


def repeated_blocks(nodes: Mapping[str, ModuleNode]) -> list[str]:
    """The outermost blocks (:func:`block_children`) of the model, in registration order.

    A block counts when it has a forward of its own, parameters, and submodules: a repeated bare
    layer (the two ``Linear`` of an MLP ``Sequential``) is one op, not a block. Blocks never nest:
    the search does not go below a block.

    Example:
        >>> def n(name, cls, numel, children=(), container=False):
        ...     return ModuleNode(name, cls, numel, tuple(children), len(children), container, not container, True)
        >>> nodes = {
        ...     "": n("", "m.GPT", 30, ["emb", "layers"]),
        ...     "emb": n("emb", "torch.nn.Embedding", 10),
        ...     "layers": n("layers", "torch.nn.ModuleList", 20, ["layers.0", "layers.1"], container=True),
        ...     "layers.0": n("layers.0", "m.Block", 10, ["layers.0.fc"]),
        ...     "layers.0.fc": n("layers.0.fc", "torch.nn.Linear", 10),
        ...     "layers.1": n("layers.1", "m.Block", 10, ["layers.1.fc"]),
        ...     "layers.1.fc": n("layers.1.fc", "torch.nn.Linear", 10),
        ... }
        >>> repeated_blocks(nodes)
        ['layers.0', 'layers.1']
    """
    found: list[str] = []

    def visit(name: str) -> None:
        node = nodes[name]
        blocks = block_children(node, nodes)
        for child in node.children:
            sub = nodes[child]
            if child in blocks and sub.wrappable and sub.numel > 0 and sub.children:
                found.append(child)
            else:
                visit(child)

    visit("")
    return found


def reshard_plan(unit_numels: list[int], max_live_numel: int, max_reuse_distance: int) -> list[bool]:
    """``reshard_after_forward`` per unit (execution order), DeepSpeed's two limits applied.

    Unit ``i`` is reused in backward after the units behind it have been gathered in
    forward and backward: its reuse distance is ``2 * sum(unit_numels[i+1:])``. Units are
    considered from the last (shortest distance) to the first; a unit stays gathered when
    its distance is within ``max_reuse_distance`` and the kept units (all gathered at the
    end of forward) still fit in ``max_live_numel``.

    Example:
        >>> reshard_plan([10, 10, 10], max_live_numel=25, max_reuse_distance=1000)
        [True, False, False]
        >>> reshard_plan([10, 10, 10], max_live_numel=1000, max_reuse_distance=15)
        [True, True, False]
    """
    plan = [True] * len(unit_numels)
    live = 0
    behind = 0
    for i in reversed(range(len(unit_numels))):
        distance = 2 * behind
        if distance <= max_reuse_distance and live + unit_numels[i] <= max_live_numel:
            plan[i] = False
            live += unit_numels[i]
        behind += unit_numels[i]
    return plan


def prefetch_plan(unit_numels: list[int], bucket_numel: int) -> list[int]:
    """How many following units unit ``i`` prefetches: as many as fit in ``bucket_numel``.

    Example:
        >>> prefetch_plan([4, 4, 4, 4], bucket_numel=9)
        [2, 2, 1, 0]
        >>> prefetch_plan([4, 4], bucket_numel=3)
        [0, 0]
    """
    out = []
    for i in range(len(unit_numels)):
        total = count = 0
        for numel in unit_numels[i + 1 :]:
            if total + numel > bucket_numel:
                break
            total += numel
            count += 1
        out.append(count)
    return out


def choose_persistent(numels: list[int], threshold: int, model_threshold: int) -> list[int]:
    """Indices of parameters kept unsharded: below ``threshold``, smallest first, at most
    ``model_threshold`` elements in total.

    Example:
        >>> choose_persistent([5, 100, 3, 7], threshold=10, model_threshold=10)
        [0, 2]
    """
    small = sorted((n, i) for i, n in enumerate(numels) if n < threshold)
    chosen = []
    total = 0
    for numel, index in small:
        if total + numel > model_threshold:
            break
        total += numel
        chosen.append(index)
    return sorted(chosen)


# --------------------------------------------------------------------------- torch adapter


def _class_path(module: nn.Module) -> str:
    cls = type(module)
    # fully_shard swaps the class for an FSDP subclass; describe the user's class
    for base in cls.__mro__:
        if not is_fully_shard_class(base):
            cls = base
            break
    return f"{cls.__module__}.{cls.__qualname__}"


def describe_modules(
    model: nn.Module,
    counted: Callable[[nn.Parameter], bool] = lambda p: True,
    external: Iterable[nn.Parameter] = (),
) -> dict[str, ModuleNode]:
    """:class:`ModuleNode` for every module of ``model`` (shared modules under their first name).

    Args:
        model: the root module.
        counted: which parameters count towards sizes (the sharded ones).
        external: parameters used outside the module that registers them; the modules
            registering them are not confined.
    """
    named = list(model.named_modules())
    external_ids = {id(p) for p in external}
    # parameter id -> names of every module that registers it
    owners: dict[int, list[str]] = {}
    for name, module in named:
        for p in module._parameters.values():
            if p is not None:
                owners.setdefault(id(p), []).append(name)
    by_name = dict(named)
    nodes: dict[str, ModuleNode] = {}
    for name, module in reversed(named):  # children first, so descendant counts are known
        prefix = f"{name}." if name else ""
        children = tuple(
            f"{prefix}{child}" for child, _ in module.named_children() if f"{prefix}{child}" in by_name
        )
        seen: set[int] = set()
        numel = 0
        confined = True
        for p in module.parameters():
            if id(p) in seen:
                continue
            seen.add(id(p))
            if counted(p):
                numel += p.numel()
            if id(p) in external_ids or any(not _inside(o, name) for o in owners.get(id(p), ())):
                confined = False  # used outside this subtree: it must stay with an ancestor
        container = isinstance(module, nn.ModuleList | nn.ModuleDict | nn.Sequential)
        no_forward = (
            isinstance(module, nn.ModuleList | nn.ModuleDict) and type(module).forward is nn.Module.forward
        )
        nodes[name] = ModuleNode(
            name=name,
            class_path=_class_path(module),
            numel=numel,
            children=children,
            descendants=sum(1 + nodes[c].descendants for c in children if c in nodes),
            is_container=container,
            wrappable=not no_forward,
            confined=confined,
        )
    return nodes


def _inside(owner: str, name: str) -> bool:
    return name == "" or owner == name or owner.startswith(name + ".")
