"""Where each resolved value came from, for ``config explain`` and error messages."""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum


class Source(str, Enum):
    """The origin of one resolved config value."""

    FILE = "file"
    DEFAULT = "default"
    DERIVED = "derived"
    AUTO = "auto-rule"
    OVERRIDE = "override"


@dataclass(frozen=True)
class Provenance:
    """Origin of a value plus a short human note (the rule used, the legacy spelling...)."""

    source: Source
    note: str = ""

    def describe(self) -> str:
        """``"derived (train_batch_size // ...)"``-style text."""
        return f"{self.source.value} ({self.note})" if self.note else self.source.value
