"""``ModelCompiler``: what ``engine.compile()`` and ``engine.is_compiled`` do, and the ``compile``
config section's keys that act.

Each target of the :class:`~shardwise.compilation.plan.CompilePlan` gets its ``forward`` replaced by
``torch.compile(forward)``. The module itself stays where it is (parameter and state-dict names do
not change, unlike wrapping it in an ``OptimizedModule``) and its hooks stay eager: ``nn.Module.compile``
would compile ``_call_impl`` and trace the hooks too, and a hook that synchronises or reads a value
(``overlap_comm``'s wait for its gathered bucket, a profiler) breaks the graph every call.

Keys of the ``compile`` section that act here:

- ``deepcompile``: a forward before ``engine.compile()`` warns once, as DeepSpeed 0.19.8 does (the
  flag selects no other behaviour: there are no DeepCompile passes, see ``config/compile_rules.py``);
- ``debug_log``: ``engine.compile()`` turns on torch's graph-break and recompile logs;
- ``autoep_non_moe``: expert-parallel layers inside the blocks stay eager (``torch.compiler.disable``);
- ``disable: false`` (the pre-0.17 spelling): ``initialize`` compiles with ``backend`` and ``kwargs``.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from torch import nn

from shardwise.compilation.options import checked_backend, torch_compile_kwargs
from shardwise.compilation.plan import CompilePlan, plan_compile
from shardwise.config.sections.features import CompileConfig
from shardwise.utils.logging import logger

DEEPCOMPILE_NOT_COMPILED = (
    "DeepCompile is enabled but engine.compile() has not been called; executing without DeepCompile "
    "until compile() runs."
)
"""DeepSpeed 0.19.8's warning (rank 0, once) for ``compile.deepcompile`` without ``engine.compile()``."""


class ModelCompiler:
    """Compiles one engine's module, once, and acts on its ``compile`` section.

    Example:
        >>> from shardwise.testing.models import GPTConfig, TinyGPT
        >>> model = TinyGPT(GPTConfig(n_layer=2, n_embd=32))
        >>> compiler = ModelCompiler(CompileConfig())
        >>> compiler.compile(model, backend="eager")
        >>> compiler.is_compiled, compiler.plan.targets
        (True, ['blocks.0', 'blocks.1'])
    """

    def __init__(self, section: CompileConfig) -> None:
        self.section = section
        self.plan: CompilePlan | None = None
        self._reminded = False

    @property
    def is_compiled(self) -> bool:
        """Whether :meth:`compile` ran."""
        return self.plan is not None

    def compile(
        self,
        module: nn.Module,
        backend: str | Callable[..., Any] = "inductor",
        compile_kwargs: Mapping[str, Any] | None = None,
        schedule: object = None,
        compiled_autograd_enabled: bool = False,
    ) -> None:
        """Compile ``module``'s blocks (DeepSpeed's ``engine.compile`` arguments); a second call does
        nothing, as in DeepSpeed.

        Raises:
            NotImplementedError: a DeepCompile ``schedule``, or ``compiled_autograd_enabled``.
            ValueError: an unknown backend or ``torch.compile`` argument.
        """
        if schedule is not None:
            raise NotImplementedError(
                "engine.compile(schedule=...) runs DeepCompile's graph passes, which shardwise does not have: "
                "call engine.compile(backend=..., compile_kwargs=...) without schedule"
            )
        if compiled_autograd_enabled:
            raise NotImplementedError(
                "engine.compile(compiled_autograd_enabled=True): compiled autograd would trace ZeRO's gradient "
                "hooks (which start collectives) into the backward graph; shardwise keeps them eager and "
                "compiles each block's forward and backward with AOT autograd instead: leave it False"
            )
        if self.plan is not None:
            return
        kwargs = torch_compile_kwargs(compile_kwargs)
        backend = checked_backend(backend)
        self._apply_section()
        plan = plan_compile(module, keep_moe_eager=self.section.autoep_non_moe)
        if plan.whole_module:
            logger.warning(plan.describe(module))
        else:
            logger.info(plan.describe(module))
        _apply(module, plan, backend, kwargs)
        self.plan = plan

    def _apply_section(self) -> None:
        if self.section.debug_log:
            import torch._logging

            torch._logging.set_logs(graph_breaks=True, recompiles=True)
            logger.info("compile.debug_log: torch's graph-break and recompile logs are on")
        if self.section.deepcompile:
            logger.info(
                "compile.deepcompile: shardwise runs no DeepCompile graph passes; each block is compiled "
                "with torch.compile and ZeRO gathers and reduces outside the graph"
            )

    def before_forward(self) -> None:
        """Called by the engine before each forward: DeepSpeed's warning for ``deepcompile`` without
        ``engine.compile()``, once."""
        if self.section.deepcompile and self.plan is None and not self._reminded:
            self._reminded = True
            logger.warning(DEEPCOMPILE_NOT_COMPILED)


def _apply(module: nn.Module, plan: CompilePlan, backend: Any, kwargs: dict[str, Any]) -> None:
    import torch

    if plan.own_compile:
        module.compile(backend=backend, **kwargs)
        return
    for name in plan.eager:
        sub = module.get_submodule(name)
        sub.forward = torch.compiler.disable(sub.forward)
    for name in plan.targets:
        sub = module.get_submodule(name)
        sub.forward = torch.compile(sub.forward, backend=backend, **kwargs)
