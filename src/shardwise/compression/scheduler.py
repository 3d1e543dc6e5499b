"""The compression scheduler: switches the techniques on at their step and advances their schedules.

It walks the model's compression-aware modules (:class:`~shardwise.compression.layers.CompressedModule`)
and calls each attached technique's ``update`` with the number of optimizer steps taken, as
DeepSpeed's ``compression_scheduler`` does after every step (and once at step 0, so a
``schedule_offset`` of 0 acts from the first forward).
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Any

from torch import nn

from shardwise.compression.layers import CompressedModule, ModuleTechnique
from shardwise.utils.logging import logger

__all__ = ["CompressionScheduler"]


class CompressionScheduler:
    """Advances every technique of ``model`` (see the module docstring).

    Args:
        model: the model ``init_compression`` prepared.
        verbose: log when a technique switches on and when weight bits change.
    """

    def __init__(self, model: nn.Module, verbose: bool = False) -> None:
        self.model = model
        self.verbose = verbose
        self.training_steps = 0

    def entries(self) -> Iterator[tuple[str, CompressedModule, ModuleTechnique]]:
        """``(module name, module, technique)`` for every attached technique, in model order."""
        for name, module in self.model.named_modules():
            if isinstance(module, CompressedModule):
                for technique in module.compression.values():
                    yield name, module, technique

    def step(self, training_steps: int | None = None) -> None:
        """Bring every technique to ``training_steps`` (default: one more than before)."""
        self.training_steps = self.training_steps + 1 if training_steps is None else int(training_steps)
        for name, module, technique in self.entries():
            was_active, bits = technique.active, getattr(technique, "bits", None)
            technique.update(module, self.training_steps)
            if self.verbose and (technique.active != was_active or getattr(technique, "bits", None) != bits):
                logger.info(
                    "compression: %s on %s %s at step %d%s",
                    technique.name,
                    name,
                    "active" if technique.active else "inactive",
                    self.training_steps,
                    f", {technique.bits} bits" if hasattr(technique, "bits") else "",
                )

    def state_dict(self) -> dict[str, Any]:
        """The step count and each technique's plain state, keyed ``"<module>/<technique>"``."""
        return {
            "training_steps": self.training_steps,
            "techniques": {f"{name}/{t.name}": t.state_dict() for name, _, t in self.entries()},
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore :meth:`state_dict` and re-apply the schedule at the saved step."""
        saved = state.get("techniques", {})
        for name, _, technique in self.entries():
            if f"{name}/{technique.name}" in saved:
                technique.load_state_dict(saved[f"{name}/{technique.name}"])
        self.step(int(state.get("training_steps", 0)))
