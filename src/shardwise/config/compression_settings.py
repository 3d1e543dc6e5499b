"""The ``compression_training`` section, read into plain settings with every documented key.

Each technique (except layer reduction) has ``shared_parameters`` and ``different_groups``
(``{name: {params, modules, related_modules}}``). :func:`read_settings` validates them with
DeepSpeed's defaults and raises :class:`~shardwise.config.errors.ConfigError` naming the key;
:func:`check_zero_stage` refuses the techniques that cannot run at the configured ZeRO stage.
Both need no model, so ``shardwise config check`` runs them (through :mod:`shardwise.preflight`)
as well as ``initialize``; the techniques themselves live in :mod:`shardwise.compression`.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from shardwise.config.errors import ConfigError, did_you_mean

__all__ = [
    "TECHNIQUES",
    "CompressionSettings",
    "GroupSettings",
    "TechniqueSettings",
    "check_zero_stage",
    "read_settings",
]

ROOT = "compression_training"
TECHNIQUES = (
    "weight_quantization",
    "activation_quantization",
    "sparse_pruning",
    "row_pruning",
    "head_pruning",
    "channel_pruning",
)

_SHARED_DEFAULTS: dict[str, dict[str, Any]] = {
    "weight_quantization": {
        "enabled": False,
        "quantizer_kernel": False,
        "schedule_offset": 0,
        "quantize_groups": 1,
        "quantize_verbose": False,
        "quantization_type": "symmetric",
        "rounding": "nearest",
        "quantize_weight_in_forward": False,
        "fp16_mixed_quantize": {"enabled": False, "quantize_change_ratio": 0.001},
    },
    "activation_quantization": {
        "enabled": False,
        "quantization_type": "symmetric",
        "range_calibration": "static",
        "schedule_offset": 1000,
    },
    "sparse_pruning": {
        "enabled": False,
        "schedule_offset": 1000,
        "schedule_offset_end": None,
        "schedule_offset_stride": 1,
        "method": "l1",
        "block_pattern": "4x1",
        "dense_ratio": 0.1,
        "excluded_modules": [],
    },
    "row_pruning": {"enabled": False, "schedule_offset": 1000, "method": "l1"},
    "head_pruning": {"enabled": False, "schedule_offset": 1000, "method": "topk", "num_heads": None},
    "channel_pruning": {"enabled": False, "schedule_offset": 1000, "method": "l1"},
}

_GROUP_DEFAULTS: dict[str, dict[str, Any]] = {
    "weight_quantization": {"start_bits": None, "target_bits": None, "quantization_period": 1},
    "activation_quantization": {"bits": 8},
    "sparse_pruning": {"dense_ratio": None},
    "row_pruning": {"dense_ratio": None},
    "head_pruning": {"dense_ratio": None},
    "channel_pruning": {"dense_ratio": None},
}

_CHOICES = {
    "quantization_type": ("symmetric", "asymmetric"),
    "rounding": ("nearest", "stochastic"),
    "range_calibration": ("dynamic", "static"),
}
_METHODS = {
    "sparse_pruning": ("l1", "topk", "snip_momentum"),
    "row_pruning": ("l1", "topk"),
    "head_pruning": ("topk",),
    "channel_pruning": ("l1", "topk"),
}


@dataclass(frozen=True)
class GroupSettings:
    """One entry of ``different_groups``.

    Attributes:
        name: the group's name (its key).
        params: the group's params merged over the technique's defaults.
        modules: module-name patterns (regular expressions searched in each name; ``"*"``: all).
        related_modules: per matched pattern, the related modules' patterns (or None).
    """

    name: str
    params: dict[str, Any]
    modules: tuple[str, ...]
    related_modules: tuple[tuple[str, ...], ...] | None


@dataclass(frozen=True)
class TechniqueSettings:
    """One technique: its shared parameters (defaults filled) and its groups."""

    name: str
    shared: dict[str, Any]
    groups: tuple[GroupSettings, ...]

    @property
    def enabled(self) -> bool:
        """``shared_parameters.enabled``."""
        return bool(self.shared["enabled"])

    @property
    def key(self) -> str:
        """The dotted path of the technique in the config."""
        return f"{ROOT}.{self.name}"


@dataclass(frozen=True)
class LayerReductionSettings:
    """``compression_training.layer_reduction``."""

    enabled: bool = False
    keep_number_layer: int | None = None
    module_name_prefix: str = ""
    teacher_layer: tuple[int, ...] = ()
    other_module_name: tuple[str, ...] = ()


@dataclass(frozen=True)
class CompressionSettings:
    """The whole section: layer reduction plus the six techniques (enabled or not)."""

    layer_reduction: LayerReductionSettings
    techniques: dict[str, TechniqueSettings] = field(default_factory=dict)

    def enabled(self) -> list[TechniqueSettings]:
        """The enabled techniques, in DeepSpeed's order."""
        return [t for t in self.techniques.values() if t.enabled]

    @property
    def any_enabled(self) -> bool:
        """Something in the section acts."""
        return self.layer_reduction.enabled or bool(self.enabled())


def _merge(key: str, given: Mapping[str, Any], defaults: dict[str, Any]) -> dict[str, Any]:
    out = dict(defaults)
    for name, value in given.items():
        if name not in defaults:
            hint = did_you_mean(name, defaults)
            raise ConfigError(
                f"{key}.{name}",
                f"unknown key; the documented keys are {', '.join(sorted(defaults))}",
                f'did you mean "{hint}"?' if hint else "remove it",
                value,
            )
        if isinstance(defaults[name], dict) and isinstance(value, Mapping):
            value = _merge(f"{key}.{name}", value, defaults[name])
        out[name] = value
    return out


def _check_shared(tech: str, key: str, shared: dict[str, object]) -> None:
    for name, choices in _CHOICES.items():
        if name in shared and shared[name] not in choices:
            raise ConfigError(f"{key}.{name}", f"must be one of {', '.join(choices)}", "", shared[name])
    if tech in _METHODS and shared["method"] not in _METHODS[tech]:
        raise ConfigError(
            f"{key}.method",
            f"{tech} supports {', '.join(_METHODS[tech])}",
            "pick one of them",
            shared["method"],
        )
    offset = shared.get("schedule_offset")
    if not isinstance(offset, int) or offset < 0:
        raise ConfigError(f"{key}.schedule_offset", "must be an integer >= 0", "", offset)
    if tech == "weight_quantization":
        groups = shared["quantize_groups"]
        if not isinstance(groups, int) or groups < 1:
            raise ConfigError(f"{key}.quantize_groups", "must be an integer >= 1", "", groups)
    if tech == "head_pruning" and shared["enabled"]:
        heads = shared["num_heads"]
        if not isinstance(heads, int) or heads < 1:
            raise ConfigError(
                f"{key}.num_heads", "head pruning needs the number of attention heads", "set it", heads
            )
    if tech == "sparse_pruning" and shared["method"] == "snip_momentum" and shared["enabled"]:
        end = shared["schedule_offset_end"]
        if not isinstance(end, int) or end < offset:
            raise ConfigError(
                f"{key}.schedule_offset_end",
                f"snip_momentum needs an end step >= schedule_offset ({offset})",
                "set the step at which pruning stops",
                end,
            )
        stride = shared["schedule_offset_stride"]
        if not isinstance(stride, int) or stride < 1:
            raise ConfigError(f"{key}.schedule_offset_stride", "must be an integer >= 1", "", stride)
        _check_ratio(f"{key}.dense_ratio", shared["dense_ratio"])


def _check_ratio(key: str, ratio: object) -> None:
    if not isinstance(ratio, (int, float)) or not 0.0 < float(ratio) <= 1.0:
        raise ConfigError(key, "the kept fraction must be in (0, 1]", "e.g. 0.5 keeps half", ratio)


def _check_group(tech: str, key: str, params: dict[str, Any], shared: dict[str, Any]) -> None:
    if tech == "weight_quantization":
        start, target = params["start_bits"], params["target_bits"]
        for name, bits in (("start_bits", start), ("target_bits", target)):
            if not isinstance(bits, int) or not 1 <= bits <= 32:
                raise ConfigError(f"{key}.params.{name}", "must be an integer from 1 to 32", "", bits)
        if target > start:
            raise ConfigError(f"{key}.params.target_bits", f"must be <= start_bits ({start})", "", target)
        period = params["quantization_period"]
        if not isinstance(period, int) or period < 0:
            raise ConfigError(f"{key}.params.quantization_period", "must be an integer >= 0", "", period)
    elif tech == "activation_quantization":
        bits = params["bits"]
        if not isinstance(bits, int) or not 2 <= bits <= 32:
            raise ConfigError(f"{key}.params.bits", "must be an integer from 2 to 32", "", bits)
    elif not (tech == "sparse_pruning" and shared["method"] == "snip_momentum"):
        _check_ratio(f"{key}.params.dense_ratio", params["dense_ratio"])


def _patterns(key: str, value: object) -> tuple[str, ...]:
    if isinstance(value, str):
        return (value,)
    if not isinstance(value, (list, tuple)) or not all(isinstance(v, str) for v in value):
        raise ConfigError(key, "must be a list of module-name patterns", 'e.g. ["attention.output"]', value)
    return tuple(value)


def _technique(tech: str, raw: Mapping[str, Any]) -> TechniqueSettings:
    key = f"{ROOT}.{tech}"
    shared = _merge(f"{key}.shared_parameters", raw.get("shared_parameters") or {}, _SHARED_DEFAULTS[tech])
    _check_shared(tech, f"{key}.shared_parameters", shared)
    groups = []
    for name, group in (raw.get("different_groups") or {}).items():
        gkey = f"{key}.different_groups.{name}"
        params = _merge(f"{gkey}.params", group.get("params") or {}, _GROUP_DEFAULTS[tech])
        if shared["enabled"]:
            _check_group(tech, gkey, params, shared)
        related = group.get("related_modules")
        groups.append(
            GroupSettings(
                name,
                params,
                _patterns(f"{gkey}.modules", group.get("modules", ["*"])),
                None if related is None else tuple(_patterns(f"{gkey}.related_modules", r) for r in related),
            )
        )
    if (
        shared["enabled"]
        and not groups
        and not (tech == "sparse_pruning" and shared["method"] == "snip_momentum")
    ):
        raise ConfigError(
            f"{key}.different_groups",
            f"{tech} is enabled but names no group of modules",
            'add e.g. {"g1": {"params": {...}, "modules": ["dense"]}}',
        )
    return TechniqueSettings(tech, shared, tuple(groups))


def _as_dict(section: Any) -> dict[str, Any]:
    if hasattr(section, "model_dump"):
        return dict(section.model_dump(exclude_unset=False))
    return dict(section or {})


def read_settings(section: object) -> CompressionSettings:
    """Read ``compression_training`` (a dict or the validated section model).

    Raises:
        ConfigError: an unknown key, a value out of range, a missing required key.

    Example:
        >>> s = read_settings({"row_pruning": {"shared_parameters": {"enabled": True, "schedule_offset": 5},
        ...     "different_groups": {"rp1": {"params": {"dense_ratio": 0.5}, "modules": ["fc1"]}}}})
        >>> [t.name for t in s.enabled()], s.techniques["row_pruning"].shared["method"]
        (['row_pruning'], 'l1')
    """
    raw = _as_dict(section)
    lr_raw = _as_dict(raw.get("layer_reduction") or {})
    layer = LayerReductionSettings(
        enabled=bool(lr_raw.get("enabled", False)),
        keep_number_layer=lr_raw.get("keep_number_layer"),
        module_name_prefix=lr_raw.get("module_name_prefix") or "",
        teacher_layer=tuple(lr_raw.get("teacher_layer") or ()),
        other_module_name=tuple(lr_raw.get("other_module_name") or ()),
    )
    if (
        layer.enabled
        and layer.keep_number_layer is not None
        and layer.keep_number_layer != len(layer.teacher_layer)
    ):
        raise ConfigError(
            f"{ROOT}.layer_reduction.teacher_layer",
            f"must list keep_number_layer ({layer.keep_number_layer}) teacher layers",
            "list one teacher layer index per kept layer",
            list(layer.teacher_layer),
        )
    techniques = {tech: _technique(tech, _as_dict(raw.get(tech) or {})) for tech in TECHNIQUES}
    return CompressionSettings(layer, techniques)


_PRUNING = ("sparse_pruning", "row_pruning", "head_pruning", "channel_pruning")


def check_zero_stage(settings: CompressionSettings, zero_stage: int) -> None:
    """Raise ConfigError when an enabled technique cannot run at ``zero_stage``.

    Quantization and layer reduction work at every stage (the forward quantizes the gathered
    weight). The pruning techniques compute masks from whole weights and cut related modules,
    which ZeRO stage 3 partitions: at stage 3 they are refused with the keys to change.
    """
    if zero_stage != 3:
        return
    for tech in settings.enabled():
        if tech.name in _PRUNING:
            raise ConfigError(
                f"{ROOT}.{tech.name}.shared_parameters.enabled",
                f"{tech.name} cannot run with zero_optimization.stage 3: its masks are computed from whole "
                "weights and related modules, which stage 3 partitions across ranks",
                "train the pruning phase at zero_optimization.stage 0, 1 or 2 (then clean and continue "
                f"at stage 3), or set {ROOT}.{tech.name}.shared_parameters.enabled to false",
                True,
            )
