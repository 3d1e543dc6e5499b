"""The engine's progress counters, one ``Stateful`` object (no torch here).

``global_steps``, ``global_samples``, ``micro_steps`` and ``skipped_steps`` have DeepSpeed's
names and meanings. :class:`EngineCounters` holds them; the engine exposes each as an
attribute of the same name (:class:`CounterAttribute`), and checkpoints save and restore
the object through ``state_dict`` / ``load_state_dict`` (the saved dict is unchanged from
the format's first version: the four names mapping to ints).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, overload

__all__ = ["COUNTER_NAMES", "CounterAttribute", "EngineCounters"]

COUNTER_NAMES = ("global_steps", "global_samples", "skipped_steps", "micro_steps")
"""The counters, in the order a checkpoint lists them."""


@dataclass
class EngineCounters:
    """How far training has come.

    Attributes:
        global_steps: optimizer steps taken (applied or skipped) at accumulation boundaries.
        global_samples: samples over all data-parallel ranks in those steps.
        skipped_steps: steps whose update was skipped (non-finite gradients).
        micro_steps: ``engine.step()`` calls that followed a backward (micro batches).

    Example:
        >>> counters = EngineCounters(global_steps=3, global_samples=24)
        >>> counters.state_dict()
        {'global_steps': 3, 'global_samples': 24, 'skipped_steps': 0, 'micro_steps': 0}
        >>> restored = EngineCounters()
        >>> restored.load_state_dict({"global_steps": 3})  # missing names keep their value
        >>> restored.global_steps, restored.global_samples
        (3, 0)
    """

    global_steps: int = 0
    global_samples: int = 0
    skipped_steps: int = 0
    micro_steps: int = 0

    def state_dict(self) -> dict[str, int]:
        """The four counters by name (the checkpoint's ``counters`` entry)."""
        return {name: int(getattr(self, name)) for name in COUNTER_NAMES}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore the counters ``state`` names; others keep their value, unknown names are ignored
        (a DeepSpeed checkpoint carries only some of them)."""
        self.global_steps = int(state.get("global_steps", self.global_steps))
        self.global_samples = int(state.get("global_samples", self.global_samples))
        self.skipped_steps = int(state.get("skipped_steps", self.skipped_steps))
        self.micro_steps = int(state.get("micro_steps", self.micro_steps))


class CounterAttribute:
    """An attribute of the owner that reads and writes ``owner.counters.<same name>``.

    Example:
        >>> class Run:
        ...     global_steps = CounterAttribute()
        ...     def __init__(self): self.counters = EngineCounters()
        >>> run = Run(); run.global_steps = 5
        >>> run.counters.global_steps
        5
    """

    name = ""

    def __set_name__(self, owner: type, name: str) -> None:
        if name not in COUNTER_NAMES:
            raise AttributeError(f"{name!r} is not an engine counter (one of {', '.join(COUNTER_NAMES)})")
        self.name = name

    @overload
    def __get__(self, obj: None, owner: type | None = None) -> CounterAttribute: ...

    @overload
    def __get__(self, obj: object, owner: type | None = None) -> int: ...

    def __get__(self, obj: object | None, owner: type | None = None) -> int | CounterAttribute:
        if obj is None:
            return self
        return int(getattr(obj.counters, self.name))  # type: ignore[attr-defined]

    def __set__(self, obj: object, value: int) -> None:
        setattr(obj.counters, self.name, int(value))  # type: ignore[attr-defined]
