"""What ``engine.compile()`` compiles: the model's repeated blocks, or the whole model's forward.

Example:
    >>> from shardwise.testing.models import GPTConfig, TinyGPT
    >>> plan = plan_compile(TinyGPT(GPTConfig(n_layer=2, n_embd=32)))
    >>> plan.targets, plan.whole_module
    (['blocks.0', 'blocks.1'], False)
"""

from __future__ import annotations

from dataclasses import dataclass

from torch import nn

from shardwise.zero.wrap_policy import describe_modules, repeated_blocks


@dataclass(frozen=True)
class CompilePlan:
    """The modules whose ``forward`` is compiled.

    Attributes:
        targets: module names (``""``: the root), in registration order.
        whole_module: no repeated block exists, so the root's forward is compiled.
        own_compile: the model's class defines ``compile`` itself (a ``PipelineModule``: every
            layer); it is called, and ``targets`` is empty.
        eager: modules inside the targets kept out of the graph (``compile.autoep_non_moe``).
    """

    targets: list[str]
    whole_module: bool = False
    own_compile: bool = False
    eager: tuple[str, ...] = ()

    def describe(self, model: nn.Module) -> str:
        """One line for the log: what is compiled and why."""
        kind = type(model).__name__
        if self.own_compile:
            return f"{kind} defines compile() itself (every layer): calling it"
        if self.whole_module:
            return f"no repeated block found in {kind}: compiling the whole module's forward"
        classes = sorted({type(model.get_submodule(n)).__name__ for n in self.targets})
        line = f"compiling {len(self.targets)} blocks of {kind} ({', '.join(classes)}) one by one"
        if self.eager:
            line += f"; kept eager inside them: {', '.join(self.eager)}"
        return line


def _moe_layer_types() -> tuple[type[nn.Module], ...]:
    from shardwise.autoep.layer import AutoEPMoELayer
    from shardwise.moe.layer import MOELayer

    return (MOELayer, AutoEPMoELayer)


def plan_compile(model: nn.Module, keep_moe_eager: bool = False) -> CompilePlan:
    """The compile plan of ``model``.

    Args:
        model: the engine's module (at stage 3, already sharded with FSDP2: its blocks are the
            shard units; the FSDP2 class swap does not change what a block is).
        keep_moe_eager: keep the expert-parallel layers (``MOELayer``, AutoEP's
            ``AutoEPMoELayer``: routing, token all-to-alls, experts) out of the graph.
    """
    if type(model).compile is not nn.Module.compile:
        return CompilePlan([], own_compile=True)
    blocks = repeated_blocks(describe_modules(model))
    targets = blocks or [""]
    eager: tuple[str, ...] = ()
    if keep_moe_eager:
        moe = _moe_layer_types()
        eager = tuple(
            name
            for name, sub in model.named_modules()
            if isinstance(sub, moe) and any(_inside(name, t) for t in targets)
        )
    return CompilePlan(targets, whole_module=not blocks, eager=eager)


def _inside(name: str, target: str) -> bool:
    return target == "" or name == target or name.startswith(target + ".")
