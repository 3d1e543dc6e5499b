"""Read a resolved config like DeepSpeed's ``engine.config`` dict: ``get``, ``[]``, ``in``, ``keys``.

Clients treat ``engine.config`` as the config dict (transformers' ``Trainer.save_model``:
``engine.config.get("zero_optimization", {}).get("stage")``). :class:`DeepSpeedKeyView` answers
with DeepSpeed's key names from the fully resolved values (``to_ds_dict``), read-only.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any


class DeepSpeedKeyView:
    """Mapping reads over ``self.to_ds_dict()`` (mixed into ``ResolvedConfig``)."""

    def to_ds_dict(self) -> dict[str, Any]:  # pragma: no cover - provided by the class it is mixed into
        raise NotImplementedError

    def get(self, key: str, default: object = None) -> Any:
        """The resolved value of top-level key ``key`` (DeepSpeed's spelling), or ``default``."""
        return self.to_ds_dict().get(key, default)

    def __getitem__(self, key: str) -> Any:
        return self.to_ds_dict()[key]

    def __contains__(self, key: object) -> bool:
        return key in self.to_ds_dict()

    def keys(self) -> Any:
        """The top-level keys, DeepSpeed's spelling."""
        return self.to_ds_dict().keys()

    def __iter__(self) -> Iterator[str]:
        return iter(self.to_ds_dict())
