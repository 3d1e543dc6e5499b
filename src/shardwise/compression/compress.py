"""``init_compression`` and ``redundancy_clean`` with DeepSpeed's names and arguments.

Example:
    >>> import torch
    >>> model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
    >>> cfg = {"compression_training": {"row_pruning": {
    ...     "shared_parameters": {"enabled": True, "schedule_offset": 0, "method": "l1"},
    ...     "different_groups": {"rp1": {"params": {"dense_ratio": 0.5}, "modules": ["^0$"],
    ...                                  "related_modules": [["^2$"]]}}}}}
    >>> model = init_compression(model, cfg)
    >>> model = redundancy_clean(model, cfg)
    >>> model[0].weight.shape, model[2].weight.shape
    (torch.Size([8, 8]), torch.Size([4, 8]))
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from torch import nn

from shardwise.compression.activation_quant import ActivationQuantization
from shardwise.compression.channel_pruning import ChannelPruning
from shardwise.compression.head_pruning import HeadPruning
from shardwise.compression.layer_reduction import reduce_layers
from shardwise.compression.layers import CompressedModule, make_compressed
from shardwise.compression.matching import match_any_modules, match_modules
from shardwise.compression.row_pruning import RowPruning
from shardwise.compression.scheduler import CompressionScheduler
from shardwise.compression.sparse_pruning import SparsePruning
from shardwise.compression.weight_quant import WeightQuantization
from shardwise.config.compression_settings import (
    CompressionSettings,
    GroupSettings,
    TechniqueSettings,
    read_settings,
)
from shardwise.config.errors import ConfigError
from shardwise.utils.logging import logger

__all__ = ["compression_scheduler", "compression_settings", "init_compression", "redundancy_clean"]

_TECHNIQUE_CLASSES: dict[str, Any] = {
    "weight_quantization": WeightQuantization,
    "activation_quantization": ActivationQuantization,
    "sparse_pruning": SparsePruning,
    "row_pruning": RowPruning,
    "head_pruning": HeadPruning,
    "channel_pruning": ChannelPruning,
}
_TARGETS: dict[str, tuple[type[nn.Module], ...]] = {
    "weight_quantization": (nn.Linear, nn.Conv2d, nn.Embedding),
    "activation_quantization": (nn.Linear, nn.Conv2d),
    "sparse_pruning": (nn.Linear, nn.Conv2d),
    "row_pruning": (nn.Linear,),
    "head_pruning": (nn.Linear,),
    "channel_pruning": (nn.Conv2d,),
}


@dataclass
class CompressionRecord:
    """What ``init_compression`` left on a model: the settings it applied and the scheduler."""

    fingerprint: str
    settings: CompressionSettings
    scheduler: CompressionScheduler
    related: dict[tuple[str, str], list[str]]


def compression_settings(deepspeed_config: object) -> CompressionSettings:
    """Read ``compression_training`` from a path, a JSON string, a dict or a loaded config."""
    if isinstance(deepspeed_config, (str, os.PathLike, Mapping)):
        from shardwise.config.loading import read_config_source

        raw, _ = read_config_source(deepspeed_config)
        return read_settings(raw.get("compression_training") or {})
    root = getattr(deepspeed_config, "config", deepspeed_config)  # LoadedConfig or ShardwiseConfig
    return read_settings(getattr(root, "compression_training", None) or {})


def _fingerprint(settings: CompressionSettings) -> str:
    return json.dumps(repr(settings), sort_keys=True)


def compression_scheduler(model: nn.Module) -> CompressionScheduler | None:
    """The scheduler ``init_compression`` attached to ``model`` (None when it was not prepared)."""
    record = getattr(model, "_shardwise_compression", None)
    return record.scheduler if isinstance(record, CompressionRecord) else None


def _targets(model: nn.Module, tech: TechniqueSettings, patterns: tuple[str, ...], key: str) -> list[str]:
    excluded = tech.shared.get("excluded_modules") or ()
    names = match_modules(model, patterns, excluded=excluded, key=key)
    return [n for n in names if isinstance(model.get_submodule(n), _TARGETS[tech.name])]


def _attach(model: nn.Module, tech: TechniqueSettings, related: dict[tuple[str, str], list[str]]) -> None:
    groups = tech.groups
    if not groups:  # snip_momentum may leave the groups out: every Linear/Conv2d, excluded_modules aside
        from shardwise.config.compression_settings import GroupSettings

        groups = (GroupSettings("all", {"dense_ratio": None}, ("*",), None),)
    for group in groups:
        key = f"{tech.key}.different_groups.{group.name}"
        for index, pattern in enumerate(group.modules):
            names = _targets(model, tech, (pattern,), f"{key}.modules")
            if not names:
                raise ConfigError(
                    f"{key}.modules",
                    f"pattern {pattern!r} matches no {'/'.join(t.__name__ for t in _TARGETS[tech.name])} module",
                    "patterns are regular expressions searched in the names of model.named_modules()",
                    list(group.modules),
                )
            partners = _related(model, group, index, names, key)
            for position, name in enumerate(names):
                module = make_compressed(model.get_submodule(name))
                if tech.name in module.compression:
                    raise ConfigError(
                        f"{key}.modules",
                        f"module {name!r} is matched twice for {tech.name} (by two patterns or two groups)",
                        "make the patterns disjoint",
                    )
                module.compression[tech.name] = _TECHNIQUE_CLASSES[tech.name](
                    tech.shared, group.params, key, module
                )
                related[(name, tech.name)] = [found[position] for found in partners]


def _related(model: nn.Module, group: GroupSettings, index: int, names: list[str], key: str) -> list[list[str]]:
    """For pattern ``index`` of the group: per related pattern, the matched modules paired by order."""
    if not group.related_modules or index >= len(group.related_modules):
        return []
    out = []
    for pattern in group.related_modules[index]:
        found = match_any_modules(model, (pattern,), f"{key}.related_modules")
        if len(found) != len(names):
            raise ConfigError(
                f"{key}.related_modules",
                f"pattern {pattern!r} matches {len(found)} modules but {group.modules[index]!r} matches "
                f"{len(names)}; each module is paired with the related module at the same position",
                "write patterns that match one related module per pruned module",
                [list(r) for r in group.related_modules],
            )
        out.append(found)
    return out


def init_compression(
    model: nn.Module, deepspeed_config: object, teacher_model: nn.Module | None = None, mpu: object = None
) -> nn.Module:
    """Prepare ``model`` for compression training as ``compression_training`` describes.

    Layer reduction runs first (from ``teacher_model``, or the model itself), then the matched
    ``Linear``/``Conv2d``/``Embedding`` modules become compression-aware and the scheduler is
    set to step 0. Calling it again on a model it prepared with the same section changes nothing.

    Args:
        model: the model (changed in place and returned).
        deepspeed_config: a path, JSON string, dict or loaded config holding ``compression_training``.
        teacher_model: the teacher for layer reduction.
        mpu: accepted for DeepSpeed compatibility (tensor-parallel layers are not compressed).

    Raises:
        ConfigError: a key is wrong, a pattern matches nothing, or the model was prepared with other settings.
    """
    settings = compression_settings(deepspeed_config)
    record = getattr(model, "_shardwise_compression", None)
    if isinstance(record, CompressionRecord):
        if record.fingerprint != _fingerprint(settings):
            raise ConfigError(
                "compression_training",
                "this model was already prepared by init_compression with a different section",
                "pass the same config to init_compression and initialize",
            )
        return model
    if settings.techniques["weight_quantization"].shared.get("quantizer_kernel"):
        logger.info(
            "compression_training.weight_quantization.shared_parameters.quantizer_kernel: DeepSpeed's CUDA "
            "quantizer kernel is not used; shardwise quantizes in the forward with the same formulas"
        )
    if settings.layer_reduction.enabled:
        reduce_layers(model, settings.layer_reduction, teacher_model)
    related: dict[tuple[str, str], list[str]] = {}
    for tech in settings.enabled():
        _attach(model, tech, related)
    verbose = bool(settings.techniques["weight_quantization"].shared.get("quantize_verbose"))
    scheduler = CompressionScheduler(model, verbose=verbose)
    scheduler.step(0)
    object.__setattr__(
        model,
        "_shardwise_compression",
        CompressionRecord(_fingerprint(settings), settings, scheduler, related),
    )
    return model


def redundancy_clean(model: nn.Module, deepspeed_config: object, mpu: object = None) -> nn.Module:
    """Bake quantized weights and remove pruned rows, heads and channels (see :mod:`.clean`).

    Raises:
        ConfigError: the model was not prepared by ``init_compression``.
    """
    from shardwise.compression.clean import clean_model

    record = getattr(model, "_shardwise_compression", None)
    if not isinstance(record, CompressionRecord):
        init_compression(model, deepspeed_config, mpu=mpu)
        record = model._shardwise_compression
    assert isinstance(record, CompressionRecord)
    clean_model(model, record.related, record.scheduler.training_steps)
    if not any(isinstance(m, CompressedModule) for m in model.modules()):
        object.__delattr__(model, "_shardwise_compression")
    return model
