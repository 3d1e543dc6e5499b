"""When a ``step()`` ends a gradient-accumulation window (the engine asks; it keeps no rule of its own).

Managed (``managed_gradient_accumulation: true``, DeepSpeed's default): the engine counts micro
batches and every ``gradient_accumulation_steps``-th ``step()`` is the boundary, unless the script
forces it with ``set_gradient_accumulation_boundary``. Unmanaged (``false``, DeepSpeed's caller-owned
mode): the script decides by calling ``step()``; each ``step()`` is a boundary after any number of
``backward()`` calls, and ``is_gradient_accumulation_boundary()`` is true only while ``step()`` runs.
An optimizer step then counts ``(train_batch_size / gradient_accumulation_steps)`` samples per
``backward()`` since the previous step, not ``train_batch_size``.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

from shardwise.config.errors import AssertedValueError

__all__ = ["AccumulationWindow"]


class AccumulationWindow:
    """The accumulation boundary of one engine.

    Example:
        >>> window = AccumulationWindow(managed=False)
        >>> window.count_backward(); window.count_backward()
        >>> window.is_boundary(micro_steps=0, accumulation_steps=4)
        False
        >>> with window.stepping():
        ...     window.is_boundary(micro_steps=0, accumulation_steps=4)
        True
        >>> window.samples(train_batch_size=32, accumulation_steps=4)  # two backwards of 8
        16
    """

    def __init__(self, managed: bool = True) -> None:
        self.managed = managed
        self._override: bool | None = None
        self._stepping = False
        self._backwards = 0  # backward() calls since the last optimizer step (unmanaged)

    def is_boundary(self, micro_steps: int, accumulation_steps: int) -> bool:
        """Whether the current micro batch ends the window (the next ``step()`` updates)."""
        if not self.managed:
            return self._stepping
        if self._override is not None:
            return self._override
        return (micro_steps + 1) % accumulation_steps == 0

    def force(self, is_boundary: bool | None) -> None:
        """``set_gradient_accumulation_boundary``: force the boundary (None: stop forcing); sticky.

        Raises:
            AssertedValueError: in unmanaged mode, where every ``step()`` is the boundary.
        """
        if not self.managed:
            raise AssertedValueError(
                "set_gradient_accumulation_boundary() does nothing with managed_gradient_accumulation=false: "
                "every step() ends the accumulation window; fix: call step() where the window should end, "
                "or set managed_gradient_accumulation to true"
            )
        self._override = is_boundary

    def count_backward(self) -> None:
        """One more ``backward()`` in this window."""
        self._backwards += 1

    @contextlib.contextmanager
    def stepping(self) -> Iterator[None]:
        """The span of ``step()``: the boundary, in unmanaged mode."""
        self._stepping = True
        try:
            yield
        finally:
            self._stepping = False

    def samples(self, train_batch_size: int, accumulation_steps: int) -> int:
        """Samples the optimizer step that ends this window trained on; starts the next window."""
        backwards, self._backwards = self._backwards, 0
        if self.managed:
            return train_batch_size
        return train_batch_size // accumulation_steps * backwards
