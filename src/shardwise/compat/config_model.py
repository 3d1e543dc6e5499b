"""``deepspeed.runtime.config_utils.DeepSpeedConfigModel``: the base of DeepSpeed's config models.

A pydantic model that refuses unknown keys and booleans in numeric fields (shardwise's
:class:`~shardwise.config.sections.base.Section`), takes a field by name or by alias, and moves a
deprecated field to its replacement: a field declared with
``json_schema_extra={"deprecated": True, "new_param": "x", "new_param_fn": f}`` given a value sets
``x`` to ``f(value)`` (with a warning naming both); giving both the old and the new field is an error.
"""

from __future__ import annotations

from typing import Any

from pydantic import ConfigDict, model_validator

from shardwise.config.sections.base import Section
from shardwise.utils.logging import logger


class DeepSpeedConfigModel(Section):
    """A config section with DeepSpeed's deprecated-field migration (see the module docstring)."""

    model_config = ConfigDict(extra="forbid", populate_by_name=True, validate_assignment=True,
                              arbitrary_types_allowed=True, protected_namespaces=())

    def __init__(self, strict: bool = False, **data: Any) -> None:
        self._refuse_old_and_new(data)
        super().__init__(**{k: v for k, v in data.items() if k != "auto" and v != "auto"})

    @classmethod
    def _refuse_old_and_new(cls, data: dict[str, Any]) -> None:
        """A deprecated field and its replacement both given: ``AssertionError`` naming both (as DeepSpeed)."""
        for name, field in cls.model_fields.items():
            extra = field.json_schema_extra if isinstance(field.json_schema_extra, dict) else {}
            new = extra.get("new_param")
            if not extra.get("deprecated") or not new or name not in data:
                continue
            alias = cls.model_fields[str(new)].alias
            assert str(new) not in data and (alias is None or alias not in data), (
                f"{name} is deprecated, use {new} instead; both were given: keep only {new}"
            )

    @model_validator(mode="before")
    @classmethod
    def _migrate_deprecated(cls, data: Any) -> Any:
        if not isinstance(data, dict):
            return data
        data = dict(data)
        for name, field in cls.model_fields.items():
            extra = field.json_schema_extra if isinstance(field.json_schema_extra, dict) else {}
            if not extra.get("deprecated") or name not in data:
                continue
            new = extra.get("new_param")
            if not new or not extra.get("set_new_param", True):
                logger.warning("Config parameter %s is deprecated", name)
                continue
            function = extra.get("new_param_fn", lambda value: value)
            data[str(new)] = function(data[name])  # type: ignore[misc,operator]
            logger.warning("Config parameter %s is deprecated, use %s instead", name, new)
        return data
