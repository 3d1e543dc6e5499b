"""Layer specifications of a PipelineModule: build a layer only on the stage that owns it.

:class:`LayerSpec` keeps a module class and its arguments; :class:`TiedLayerSpec` adds a key, and
every spec with the same key shares one module per stage (the tied copies on different stages are
kept equal: the engine sums their gradients over the stages that hold them).

Example:
    >>> from torch import nn
    >>> spec = LayerSpec(nn.Linear, 4, 2, bias=False)
    >>> spec.build().weight.shape
    torch.Size([2, 4])
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from torch import nn


def _call_text(name: str, args: Sequence[Any], kwargs: dict[str, Any]) -> str:
    parts = [repr(a) for a in args] + [f"{k}={v!r}" for k, v in kwargs.items()]
    return f"{name}({', '.join(parts)})"


class LayerSpec:
    """A layer to build later: ``typename(*module_args, **module_kwargs)``.

    Raises:
        RuntimeError: ``typename`` is not an ``nn.Module`` subclass (DeepSpeed's error).
    """

    def __init__(self, typename: type, *module_args: Any, **module_kwargs: Any) -> None:
        if not (isinstance(typename, type) and issubclass(typename, nn.Module)):
            raise RuntimeError(f"LayerSpec({typename!r}): the first argument must be an nn.Module subclass (the class, not an instance)")
        self.typename = typename
        self.module_args = module_args
        self.module_kwargs = module_kwargs
        self.global_rank = _global_rank()

    def __repr__(self) -> str:
        return _call_text(self.typename.__name__, self.module_args, self.module_kwargs)

    def build(self, log: bool = False) -> nn.Module:
        """Construct the layer."""
        return self.typename(*self.module_args, **self.module_kwargs)


class TiedLayerSpec(LayerSpec):
    """A layer shared by every spec with the same ``key`` (e.g. input embedding and output head).

    Args:
        key: the tie's name; all specs with it use one module per stage.
        typename, module_args, module_kwargs: as :class:`LayerSpec` (the first spec of a key builds it).
        forward_fn: ``forward_fn(module, x)`` used instead of ``module(x)`` at this position.
        tied_weight_attr: the attribute(s) (dotted paths allowed) whose tensors are tied.
    """

    def __init__(
        self,
        key: str,
        typename: type,
        *module_args: Any,
        forward_fn: Callable[[Any, Any], Any] | None = None,
        tied_weight_attr: str | Sequence[str] = ("weight",),
        **module_kwargs: Any,
    ) -> None:
        super().__init__(typename, *module_args, **module_kwargs)
        self.key = key
        self.forward_fn = forward_fn
        self.tied_weight_attr = (
            [tied_weight_attr] if isinstance(tied_weight_attr, str) else list(tied_weight_attr)
        )


def _global_rank() -> int:
    from shardwise.comm import init

    return init.get_rank() if init.is_initialized() else -1
