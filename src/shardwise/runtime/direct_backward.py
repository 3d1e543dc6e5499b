"""A backward the caller runs itself on what ``engine(x)`` returned: ``loss.backward()``,
``engine.scale(loss).backward()`` or ``out.backward(grad)``, as DeepSpeed 0.19.8 allows.

``engine.backward(loss)`` divides the loss by ``gradient_accumulation_steps``, tells the ZeRO
strategy a micro step's backward begins (``prepare_backward``: is it the window's boundary, which
units stay gathered) and ends (``after_backward``: its reductions complete), and counts it for the
next ``step()``. A backward started by the caller skips all of that unless something else does it,
and the step then trains on wrong gradients (stage 3) or is not taken at all.

:class:`DirectBackward` does it from the autograd graph. The engine's forward hands it its outputs
(:meth:`watch`), and it puts a gradient hook on each floating output that requires grad. The first
hook to fire in a backward the engine did not start opens the micro step (the hook runs before any
node of the model, which all lie upstream of the outputs) and queues its close for the end of that
backward with autograd's ``queue_callback``. Every output's gradient is divided by the accumulation
steps there, where ``engine.backward`` divides the loss instead: the same quotient, bit for bit when
the steps are a power of two, else within one rounding of each output gradient.

Loss scaling (fp16) needs the loss multiplied before autograd runs; a caller-run backward of an
unscaled loss is refused (``engine.scale(loss).backward()`` is the manual form), as DeepSpeed
refuses it. DeepSpeed also refuses every caller-run backward at ZeRO stage 0; shardwise's stage 0 has
the same strategy interface as stages 1-3, so it runs there too. Under ``torch.func`` transforms the
hooks stand aside, as the engine's own ``backward`` is not involved there either.

Written here rather than with ``nn.Module.register_full_backward_pre_hook``: that hook does not fire
when no module input requires grad (the usual case for token ids), and it has no end-of-backward
counterpart.
"""

from __future__ import annotations

import contextlib
import functools
from collections import deque
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import torch

__all__ = ["DirectBackward", "functorch_transforming"]

_MAX_NESTING = 8  # how deep watch() looks into nested outputs (tuples of dicts of tensors...)
_MAX_GRAPH_NODES = 256  # how far watch() walks back from an output to find a parameter's gradient node


def functorch_transforming() -> bool:
    """True inside ``torch.func.grad`` / ``vmap`` / ``jacrev``: the engine's bookkeeping stays out."""
    functorch = getattr(torch._C, "_functorch", None)
    peek = getattr(functorch, "peek_interpreter_stack", None)
    return peek is not None and peek() is not None


def _output_tensors(outputs: Any, depth: int = 0) -> Iterator[torch.Tensor]:
    if isinstance(outputs, torch.Tensor):
        if outputs.requires_grad and outputs.is_floating_point():
            yield outputs
    elif depth < _MAX_NESTING:
        if isinstance(outputs, Mapping):
            for value in outputs.values():
                yield from _output_tensors(value, depth + 1)
        elif isinstance(outputs, (list, tuple)):
            for value in outputs:
                yield from _output_tensors(value, depth + 1)


def _parameter_gradient_node(output_node: Any) -> Any:
    """The gradient-accumulation node of a parameter the output (whose ``grad_fn`` is ``output_node``)
    depends on, the nearest one, or None.

    A backward accumulates into parameters exactly when autograd will run such a node; one that does
    not (``torch.autograd.grad(out, x)``, e.g. a gradient penalty, or ``backward(inputs=[x])``) is not
    a training micro step, and the hooks leave it alone.
    """
    queue: deque[Any] = deque([output_node])
    seen: set[Any] = set()
    while queue and len(seen) < _MAX_GRAPH_NODES:
        node = queue.popleft()
        if node is None or node in seen:
            continue
        seen.add(node)
        if isinstance(getattr(node, "variable", None), torch.nn.Parameter):
            return node
        queue.extend(next_node for next_node, _ in node.next_functions)
    return None


def _accumulates_into(node: Any) -> bool:
    if node is None:
        return True  # no parameter found near the output: every backward through it counts
    will_execute = getattr(torch._C, "_will_engine_execute_node", None)
    return True if will_execute is None else bool(will_execute(node))


class DirectBackward:
    """Opens and closes the engine's micro step around a backward the caller runs.

    Args:
        begin: what ``engine.backward`` does before autograd runs (the strategy's ``prepare_backward``).
        end: what it does after (the strategy's ``after_backward``, counting the backward).
        accumulation_steps: the current ``gradient_accumulation_steps``.
        loss_must_be_scaled: whether autograd must start from a scaled loss (fp16 loss scaling).
    """

    def __init__(
        self,
        begin: Callable[[], None],
        end: Callable[[], None],
        accumulation_steps: Callable[[], int],
        loss_must_be_scaled: Callable[[], bool],
    ) -> None:
        self._begin = begin
        self._end = end
        self._accumulation_steps = accumulation_steps
        self._loss_must_be_scaled = loss_must_be_scaled
        self._engine_driven = False  # inside engine.backward: it does the bookkeeping itself
        self._open = False  # a caller-run backward reached the outputs and has not ended yet
        self._scaled_loss_expected = False  # engine.scale() ran: the next caller-run backward is scaled
        self.enabled = True

    @contextlib.contextmanager
    def engine_backward(self) -> Iterator[None]:
        """The engine's own backward runs inside: the hooks leave its gradients and bookkeeping alone."""
        self._engine_driven = True
        try:
            yield
        finally:
            self._engine_driven = False

    def expect_scaled_loss(self) -> None:
        """``engine.scale(loss)`` ran: the caller's next backward starts from a scaled loss."""
        self._scaled_loss_expected = True

    def watch(self, outputs: Any) -> None:
        """Hook every floating output of a forward that requires grad (nested in tuples, lists and
        mappings such as transformers' ``ModelOutput``)."""
        if not self.enabled or not torch.is_grad_enabled() or functorch_transforming():
            return
        for tensor in _output_tensors(outputs):
            tensor.register_hook(functools.partial(self._on_output_grad, tensor.grad_fn))

    def _on_output_grad(self, output_node: Any, grad: torch.Tensor) -> torch.Tensor | None:
        if self._engine_driven or functorch_transforming():
            return None
        if not self._open:
            # only a caller-run backward gets here, so engine.backward's pays no graph walk
            if not _accumulates_into(_parameter_gradient_node(output_node)):
                return None
            self._open_micro_step()
        steps = self._accumulation_steps()
        return None if steps == 1 else grad / steps

    def _open_micro_step(self) -> None:
        if self._loss_must_be_scaled() and not self._scaled_loss_expected:
            raise RuntimeError(
                "loss.backward() on the engine's output with fp16 loss scaling: the loss must be scaled "
                "before autograd runs. Call engine.backward(loss), or engine.scale(loss).backward()"
            )
        self._begin()
        self._open = True
        torch.autograd.Variable._execution_engine.queue_callback(self._close_micro_step)

    def _close_micro_step(self) -> None:
        self._open = False
        self._scaled_loss_expected = False
        self._end()
