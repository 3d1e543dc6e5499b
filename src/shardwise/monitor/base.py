"""The monitor interface: a backend receives ``(name, value, step)`` events.

Every backend (TensorBoard, CSV, Weights & Biases, Comet) implements
:class:`Monitor`; :class:`shardwise.monitor.master.MonitorMaster` fans events out to the
enabled ones on rank 0. The step axis is ``global_samples``, as in DeepSpeed (spec 11.3).
Optional packages are imported only when their backend is enabled, through
:func:`import_optional`, which turns a missing package into a config error that says
what to install.
"""

from __future__ import annotations

import importlib
from abc import ABC, abstractmethod
from collections.abc import Iterable
from types import ModuleType
from typing import Any

from shardwise.config.errors import ConfigError

# (name, value, step): value a number (or a 0-d tensor), step the global sample count.
Event = tuple[str, Any, int]


def event_value(value: Any) -> float:
    """A plain float from a number or a one-element tensor.

    Raises:
        ValueError: the value is not a number (a string, a tensor with several elements).

    Example:
        >>> event_value(3), event_value(True)
        (3.0, 1.0)
    """
    if hasattr(value, "item") and callable(value.item):
        if getattr(value, "numel", lambda: 1)() != 1:
            raise ValueError(
                f"a monitor event value must be a scalar, got a tensor of shape {tuple(value.shape)}"
            )
        value = value.item()
    if isinstance(value, bool | int | float):
        return float(value)
    raise ValueError(f"a monitor event value must be a number, got {type(value).__name__} {value!r}")


def check_events(events: Iterable[Event]) -> list[tuple[str, float, int]]:
    """Validate and normalise a batch of events: ``(str, number, int)`` each.

    Raises:
        ValueError: an event that is not a ``(name, value, step)`` triple of the right types.

    Example:
        >>> check_events([("Train/Samples/lr", 0.1, 8)])
        [('Train/Samples/lr', 0.1, 8)]
    """
    out: list[tuple[str, float, int]] = []
    for event in events:
        if not isinstance(event, tuple | list) or len(event) != 3:
            raise ValueError(f"a monitor event is a (name, value, step) triple, got {event!r}")
        name, value, step = event
        if not isinstance(name, str) or not name:
            raise ValueError(f"a monitor event name must be a non-empty string, got {name!r}")
        if hasattr(step, "item"):
            step = step.item()
        if isinstance(step, bool) or not isinstance(step, int):
            raise ValueError(f"the step of event {name!r} must be an int (global samples), got {step!r}")
        out.append((name, event_value(value), step))
    return out


def import_optional(module: str, section: str, pip_name: str) -> ModuleType:
    """Import an optional backend package, or explain how to get it.

    Raises:
        ConfigError: the package is not installed; names the section and the install command.

    Example:
        >>> import_optional("json", "csv_monitor", "json").__name__
        'json'
    """
    try:
        return importlib.import_module(module)
    except ImportError as exc:
        raise ConfigError(
            f"{section}.enabled",
            f"the {section} monitor needs the '{pip_name}' package, which is not installed ({exc})",
            f'pip install {pip_name}, or set "{section}": {{"enabled": false}}',
            value=True,
        ) from exc


class Monitor(ABC):
    """One monitoring backend. Constructed only on the rank that writes (rank 0)."""

    name: str = "monitor"

    @abstractmethod
    def write_events(self, events: list[tuple[str, float, int]]) -> None:
        """Record already-validated ``(name, value, step)`` events."""

    def flush(self) -> None:  # noqa: B027 - most backends flush inside write_events
        """Push buffered events to storage."""

    def close(self) -> None:  # noqa: B027 - backends without resources keep the default
        """Release files and connections; the monitor writes nothing afterwards."""
