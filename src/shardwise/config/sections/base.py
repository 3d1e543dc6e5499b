"""The base for every section model: unknown keys are errors, values are validated."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict


class Section(BaseModel):
    """A config section: unknown keys rejected (did-you-mean is added by the loader)."""

    model_config = ConfigDict(extra="forbid", populate_by_name=True, validate_default=False, frozen=False)


class OpenSection(BaseModel):
    """A section whose extra keys are passed through to a component (e.g. apex amp options)."""

    model_config = ConfigDict(extra="allow", populate_by_name=True)
