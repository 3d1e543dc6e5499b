"""``optimizer`` and ``scheduler`` sections (spec 3.2, 3.3).

Only the shape is checked here; whether ``type`` names a real optimizer and whether
its ``params`` fit the constructor is checked against the registries in ``optim`` and
``schedulers`` by ``shardwise.config.checks``.
"""

from __future__ import annotations

from typing import Any

from pydantic import Field, field_validator

from shardwise.config.sections.base import Section


class OptimizerConfig(Section):
    """``optimizer``: ``{"type": name, "params": {...}}``."""

    type: str
    params: dict[str, Any] = Field(default_factory=dict)
    legacy_fusion: bool = False

    @field_validator("params", mode="before")
    @classmethod
    def _none_is_empty(cls, value: object) -> object:
        return {} if value is None else value


class SchedulerConfig(Section):
    """``scheduler``: ``{"type": name, "params": {...}}``."""

    type: str
    params: dict[str, Any] = Field(default_factory=dict)

    @field_validator("params", mode="before")
    @classmethod
    def _none_is_empty(cls, value: object) -> object:
        return {} if value is None else value
