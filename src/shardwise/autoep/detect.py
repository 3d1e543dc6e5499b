"""Finding a model's MoE blocks (``AutoEP.ep_parser``) and replacing each by an
:class:`~shardwise.autoep.layer.AutoEPMoELayer` (``AutoEP.replace_moe_layer``).

The family comes from ``expert_parallel.preset_model`` or the model's ``config.model_type``; a
block is a module whose dotted name matches the family's pattern and that has the router and
experts children with the family's weight names. The section's override keys (``router_pattern``,
``expert_w1``, ``top_k``...) take precedence over the family's values.
"""

from __future__ import annotations

import copy
import re
from typing import Any

from torch import nn

from shardwise.autoep.config import UNSET, AutoEPConfig, fill_autoep_config_from_hf, resolve_route_scale
from shardwise.autoep.fused_layout import classify_fused_gate_up_layout
from shardwise.autoep.layer import AutoEPMoELayer
from shardwise.autoep.presets import (
    PRESET_MODELS,
    MoELayerSpec,
    MoEModelPreset,
    get_preset_adapter,
    preset_name_for_hf_model_type,
    unsupported_preset_for_hf_model_type,
)

_resolve_route_scale = resolve_route_scale


def _shape(tensor: Any) -> tuple[int, ...]:
    """A tensor's full shape, also when ZeRO-3 construction partitioned it (``ds_shape``)."""
    return tuple(getattr(tensor, "ds_shape", tensor.shape))


def _weight(owner: Any, name: str | None) -> Any:
    value = getattr(owner, name, None) if name else None
    return value.weight if isinstance(value, nn.Module) and hasattr(value, "weight") else value


class AutoEP:
    """The AutoEP conversion of one model under one :class:`AutoEPConfig`."""

    def __init__(self, model: nn.Module, config: AutoEPConfig) -> None:
        self.model, self.config = model, config
        self.model_config = getattr(model, "config", None)

    def _resolve_presets(self) -> list[tuple[str, MoEModelPreset]]:
        """The families to look for: the configured one, or the one of ``config.model_type``
        (a type a family names as not convertible is refused with its note), else every family."""
        if self.config.preset_model is not None:
            name = self.config.preset_model
            if name not in PRESET_MODELS:
                raise ValueError(f"expert_parallel.preset_model = {name!r}: one of {sorted(PRESET_MODELS)}; "
                                 "fix: name the model family or leave it out")
            return [(name, PRESET_MODELS[name])]
        model_type = getattr(self.model_config, "model_type", None)
        detected = preset_name_for_hf_model_type(model_type)
        if detected is not None:
            return [(detected, PRESET_MODELS[detected])]
        unsupported = unsupported_preset_for_hf_model_type(model_type)
        if unsupported is not None:
            family, preset = unsupported
            raise ValueError(f"expert_parallel: model_type {model_type!r} is not converted by the '{family}' "
                             f"family: {preset.unsupported_hf_model_type_notes[str(model_type)]}")
        return list(PRESET_MODELS.items())

    def _layer_config(self) -> AutoEPConfig:
        config = copy.copy(self.config)
        fill_autoep_config_from_hf(config, self.model_config)
        return config

    def _spec(self, name: str, block: nn.Module, family: str, preset: MoEModelPreset,
              config: AutoEPConfig) -> MoELayerSpec | None:
        router_name = config.router_pattern or preset.router_pattern
        experts_name = config.expert_pattern or preset.experts_pattern
        router, experts = getattr(block, router_name, None), getattr(block, experts_name, None)
        if router is None or experts is None or getattr(router, "weight", None) is None:
            return None
        w1 = config.expert_w1 or preset.expert_w1
        w2 = config.expert_w2 or preset.expert_w2
        w3 = preset.expert_w3 if config.expert_w3 is UNSET else config.expert_w3
        storage = "module_list" if isinstance(experts, nn.ModuleList) else "fused_3d"
        first = experts[0] if storage == "module_list" and len(experts) else experts
        if _weight(first, w1) is None or _weight(first, w2) is None:
            return None
        w1_shape = _shape(_weight(first, w1))
        if storage == "module_list":
            num_from_weights, hidden, ffn = len(experts), w1_shape[1], w1_shape[0]
        elif w3 is None:  # gate and up fused in w1: the layout says which dimension is which
            w2_shape = _shape(_weight(first, w2))
            layout = classify_fused_gate_up_layout(w1_shape, w2_shape)
            if layout is None:
                raise ValueError(
                    f"AutoEP layer {name!r}: expert_w3 is None but {w1} {w1_shape} and {w2} {w2_shape} are "
                    "not a fused gate/up pair; rule: [E, 2F, H] with [E, H, F] or [E, H, 2F] with [E, F, H]; "
                    "fix: set expert_parallel.expert_w3 to the up projection, or use a preset for the model")
            num_from_weights, hidden, ffn = w1_shape[0], layout.hidden_size, layout.ffn_hidden_size
        else:
            num_from_weights, hidden, ffn = w1_shape[0], w1_shape[2], w1_shape[1]
        attr = config.num_experts_attr or preset.num_experts_attr
        num_experts = int(getattr(self.model_config, attr, None) or num_from_weights)
        if num_experts != num_from_weights:
            raise ValueError(f"AutoEP layer {name!r}: config.{attr} = {num_experts} but its experts hold "
                             f"{num_from_weights}; fix: make the config match the weights")
        top_k: Any
        if isinstance(config.top_k, int) and not isinstance(config.top_k, bool):
            top_k = config.top_k
        else:
            top_k = getattr(self.model_config, config.top_k_attr or preset.top_k_attr, None) or getattr(
                block, "top_k", None) or getattr(router, "top_k", None)
        if not top_k:
            raise ValueError(f"AutoEP layer {name!r}: no top_k (expert_parallel.top_k, config."
                             f"{preset.top_k_attr} or the block's top_k); fix: set expert_parallel.top_k")
        route_norm = getattr(self.model_config, "norm_topk_prob", preset.route_norm)
        has_shared = preset.has_shared_experts if config.has_shared_experts is None else config.has_shared_experts
        shared_name = config.shared_experts_pattern or preset.shared_experts_pattern
        shared_gate = config.shared_experts_gate_pattern or preset.shared_experts_gate_pattern
        has_shared = bool(has_shared and shared_name and getattr(block, shared_name, None) is not None)
        capture = "router" if (preset.router_logits_capture == "router"
                               and type(self.model).__module__.startswith("transformers.")) else "none"
        return MoELayerSpec(
            moe_module_name=name, model_family=family, router_name=router_name, experts_name=experts_name,
            expert_storage=storage, expert_w1_name=w1, expert_w2_name=w2, expert_w3_name=w3,
            num_experts=num_experts, top_k=int(top_k), hidden_size=int(hidden), ffn_hidden_size=int(ffn),
            score_func=preset.score_func if config.score_func == "auto" else config.score_func,
            score_apply=preset.score_apply, route_norm=bool(route_norm),
            gate_bias=preset.gate_bias or getattr(router, "bias", None) is not None,
            return_router_logits=False, router_logits_capture_target=capture,
            router_logits_capture_index=0 if capture == "router" else None, router_logits_capture_layer_name=None,
            has_shared_experts=has_shared, shared_experts_name=shared_name if has_shared else "",
            checkpoint_router_alias=router_name if preset.router_logits_capture == "router" and "." not in router_name
            and router_name not in ("router", "experts", "shared_experts") else None,
            shared_experts_gate_name=shared_gate if has_shared and getattr(block, shared_gate or "-", None)
            is not None else "",
            route_scale=resolve_route_scale(config, self.model_config),
            num_expert_groups=config.num_expert_groups, num_limited_groups=config.num_limited_groups,
            supports_expert_bias=preset.supports_expert_bias,
            unsupported_router_bias_names=preset.unsupported_router_bias_names, preset_adapter=preset.preset_adapter,
            expert_activation=config.expert_activation or preset.expert_activation,
        )

    def ep_parser(self) -> list[MoELayerSpec]:
        """Every MoE block of the model, in module order, as a :class:`MoELayerSpec` (no change yet)."""
        config = self._layer_config()
        for family, preset in self._resolve_presets():
            pattern = re.compile(config.moe_layer_pattern or preset.moe_layer_pattern)
            specs = [spec for name, block in self.model.named_modules() if pattern.fullmatch(name)
                     if (spec := self._spec(name, block, family, preset, config)) is not None]
            if specs:
                get_preset_adapter(preset.preset_adapter if preset.preset_adapter in PRESET_MODELS
                                   else family).check_environment(self.model)
                return specs
        return []

    def replace_moe_layer(self, spec: MoELayerSpec, ep_size: int, ep_rank: int) -> AutoEPMoELayer:
        """Put an :class:`AutoEPMoELayer` (this rank's experts) in place of the block ``spec`` names."""
        parent_name, _, child = spec.moe_module_name.rpartition(".")
        parent = self.model.get_submodule(parent_name) if parent_name else self.model
        layer = AutoEPMoELayer(spec, getattr(parent, child), ep_size, ep_rank, self._layer_config())
        setattr(parent, child, layer)
        return layer
