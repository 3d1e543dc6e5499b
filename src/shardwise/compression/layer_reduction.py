"""Layer reduction: a student initialised from chosen teacher layers.

``module_name_prefix`` names the layer list (``"bert.encoder.layer"``), ``teacher_layer`` the
teacher layers to keep (student layer ``i`` copies teacher layer ``teacher_layer[i]``), and
``other_module_name`` further modules copied whole (embeddings, pooler, head). With a
``teacher_model`` (DeepSpeed's flow) the student's parameters are copied from it; without one
the model is its own teacher: its layer list is cut down to the listed layers, in that order.
"""

from __future__ import annotations

import torch
from torch import nn

from shardwise.config.compression_settings import ROOT, LayerReductionSettings
from shardwise.config.errors import ConfigError

__all__ = ["reduce_layers"]

_KEY = f"{ROOT}.layer_reduction"


def _get(model: nn.Module, name: str, key: str, what: str) -> nn.Module:
    try:
        return model.get_submodule(name)
    except AttributeError:
        raise ConfigError(
            key, f"{what} has no module named {name!r}", "use a name from model.named_modules()", name
        ) from None


def _copy(student: nn.Module, teacher: nn.Module, where: str) -> None:
    target, source = student.state_dict(), teacher.state_dict()
    if any(t.is_meta for t in (*target.values(), *source.values())):
        raise ConfigError(
            _KEY,
            f"cannot copy {where}: the model holds zero.Init placeholders (no values on this rank)",
            "build the student and teacher outside shardwise.zero.Init for layer reduction, or leave "
            "teacher_model out (the model then keeps its own listed layers)",
        )
    if target.keys() != source.keys() or any(target[k].shape != source[k].shape for k in target):
        raise ConfigError(
            _KEY,
            f"student and teacher modules differ at {where}",
            "the student must mirror the teacher's layer structure",
        )
    with torch.no_grad():
        for k, value in target.items():
            value.copy_(source[k])


def reduce_layers(model: nn.Module, settings: LayerReductionSettings, teacher: nn.Module | None) -> None:
    """Initialise ``model`` from the listed teacher layers (see the module docstring).

    Raises:
        ConfigError: the prefix is not a layer list, an index is out of range, shapes differ.
    """
    prefix = settings.module_name_prefix
    if settings.teacher_layer and not prefix:
        raise ConfigError(
            f"{_KEY}.module_name_prefix",
            "teacher_layer needs the layer list's name",
            'e.g. "bert.encoder.layer"',
        )
    source = teacher if teacher is not None else model
    if settings.teacher_layer:
        layers = _get(source, prefix, f"{_KEY}.module_name_prefix", "the teacher")
        if not isinstance(layers, (nn.ModuleList, nn.Sequential)):
            raise ConfigError(
                f"{_KEY}.module_name_prefix", "must name an nn.ModuleList of layers", "", prefix
            )
        bad = [i for i in settings.teacher_layer if not 0 <= i < len(layers)]
        if bad:
            raise ConfigError(
                f"{_KEY}.teacher_layer",
                f"indices {bad} are outside the teacher's {len(layers)} layers",
                "",
                list(settings.teacher_layer),
            )
        if teacher is None:
            kept = (
                type(layers)(*[layers[i] for i in settings.teacher_layer])
                if isinstance(layers, nn.Sequential)
                else nn.ModuleList(layers[i] for i in settings.teacher_layer)
            )
            parent, _, leaf = prefix.rpartition(".")
            setattr(model.get_submodule(parent) if parent else model, leaf, kept)
        else:
            student_layers = _get(model, prefix, f"{_KEY}.module_name_prefix", "the student")
            if len(student_layers) != len(settings.teacher_layer):  # type: ignore[arg-type]
                raise ConfigError(
                    f"{_KEY}.keep_number_layer",
                    f"the student has {len(student_layers)} layers at {prefix!r}, the config keeps {len(settings.teacher_layer)}",  # type: ignore[arg-type]
                    "build the student with keep_number_layer layers",
                )
            for i, t in enumerate(settings.teacher_layer):
                _copy(student_layers[i], layers[t], f"{prefix}.{i} <- {prefix}.{t}")  # type: ignore[index]
    if teacher is not None:
        for name in settings.other_module_name:
            key = f"{_KEY}.other_module_name"
            _copy(_get(model, name, key, "the student"), _get(teacher, name, key, "the teacher"), name)
