"""``deepspeed.runtime.constants``: each top-level ds_config key and its default, by DeepSpeed's names.

For every top-level setting of :class:`~shardwise.config.model.ShardwiseConfig` that is a plain value
(not a section), ``<KEY>`` is the key and ``<KEY>_DEFAULT`` its default, read from the model (the one
home of the defaults, which follow DeepSpeed 0.19.8): ``GRADIENT_CLIPPING == "gradient_clipping"``,
``GRADIENT_CLIPPING_DEFAULT == 1.0``, ``LOG_LEVEL_DEFAULT is None``. ``get_top_level_setting`` reads
one such key from a config dict the way DeepSpeed's ``get_*`` readers do (absent: the default).
"""

from __future__ import annotations

import typing
from typing import Any

from pydantic import BaseModel
from pydantic_core import PydanticUndefined

from shardwise.config.model import ShardwiseConfig


def _mentions_section(annotation: object) -> bool:
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return True
    return any(_mentions_section(arg) for arg in typing.get_args(annotation))


def _plain_defaults() -> dict[str, Any]:
    defaults = {}
    for key, field in ShardwiseConfig.model_fields.items():
        default = field.default
        if default is PydanticUndefined or _mentions_section(field.annotation):
            continue
        if default is None or isinstance(default, bool | int | float | str):
            defaults[key] = default
    return defaults


TOP_LEVEL_DEFAULTS: dict[str, Any] = _plain_defaults()
"""Each plain top-level key's default (``{"gradient_clipping": 1.0, "log_level": None, ...}``)."""

for _key, _default in TOP_LEVEL_DEFAULTS.items():
    globals()[_key.upper()] = _key
    globals()[f"{_key.upper()}_DEFAULT"] = _default


def get_top_level_setting(param_dict: dict[str, Any], key: str) -> Any:
    """``param_dict[key]``, or the key's default when absent (DeepSpeed's ``get_scalar_param``).

    Example:
        >>> get_top_level_setting({}, "gradient_clipping"), get_top_level_setting({"log_level": "info"}, "log_level")
        (1.0, 'info')
    """
    if key not in TOP_LEVEL_DEFAULTS:
        raise KeyError(f"{key!r} is not a plain top-level ds_config setting; known: {sorted(TOP_LEVEL_DEFAULTS)}")
    return param_dict.get(key, TOP_LEVEL_DEFAULTS[key])
