"""The base for every section model: unknown keys are errors, values are validated.

A JSON ``true`` is never taken as a number: pydantic would read it as 1 in a numeric
field (``"min_loss_scale": true``), which hides a value written in the wrong place. Every
section rejects booleans in its integer and float fields.
"""

from __future__ import annotations

import types
import typing
from typing import Literal

from pydantic import BaseModel, ConfigDict, ValidationInfo, field_validator


def is_numeric_annotation(annotation: object) -> bool:
    """True for ``int``, ``float``, integer ``Literal``s and unions/optionals containing one.

    Example:
        >>> is_numeric_annotation(int | None), is_numeric_annotation(bool), is_numeric_annotation(str)
        (True, False, False)
    """
    if annotation in (int, float):
        return True
    origin = typing.get_origin(annotation)
    if origin is Literal:
        return any(type(arg) is int for arg in typing.get_args(annotation))
    if origin in (typing.Union, types.UnionType):
        return any(is_numeric_annotation(arg) for arg in typing.get_args(annotation))
    return False


def _reject_bool_numbers(cls: type[BaseModel], value: object, info: ValidationInfo) -> object:
    if isinstance(value, bool) and info.field_name is not None:
        annotation = cls.model_fields[info.field_name].annotation
        if is_numeric_annotation(annotation) and not _allows_bool(annotation):
            raise ValueError("must be a number, not a boolean (true/false)")
    return value


def _allows_bool(annotation: object) -> bool:
    if annotation is bool:
        return True
    if typing.get_origin(annotation) in (typing.Union, types.UnionType):
        return any(_allows_bool(arg) for arg in typing.get_args(annotation))
    return False


class Section(BaseModel):
    """A config section: unknown keys rejected (did-you-mean is added by the loader)."""

    model_config = ConfigDict(extra="forbid", populate_by_name=True, validate_default=False, frozen=False)

    @field_validator("*", mode="before")
    @classmethod
    def _no_bool_numbers(cls, value: object, info: ValidationInfo) -> object:
        return _reject_bool_numbers(cls, value, info)


class OpenSection(BaseModel):
    """A section whose extra keys are passed through to a component (e.g. apex amp options)."""

    model_config = ConfigDict(extra="allow", populate_by_name=True)

    @field_validator("*", mode="before")
    @classmethod
    def _no_bool_numbers(cls, value: object, info: ValidationInfo) -> object:
        return _reject_bool_numbers(cls, value, info)
