"""Model families AutoEP knows: where a family keeps its MoE blocks, router and experts, how it
routes, and which Hugging Face ``model_type`` names it covers (the preset registry).

:class:`MoEModelPreset` describes a family; :class:`MoELayerSpec` is one detected layer (what
:class:`~shardwise.autoep.detect.AutoEP` finds and :class:`~shardwise.autoep.layer.AutoEPMoELayer`
is built from). A :class:`PresetAdapter` holds a family's check of the installed transformers.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class MoEModelPreset:
    """One model family's MoE layout and routing."""

    moe_layer_pattern: str
    router_pattern: str
    experts_pattern: str
    expert_storage: str  # "fused_3d": [E, ...] tensors on the experts module; "module_list": one module per expert
    expert_w1: str
    expert_w2: str
    expert_w3: str | None  # None: w1 holds gate and up projections fused ([E, 2F, H])
    num_experts_attr: str
    top_k_attr: str
    score_func: str
    score_apply: str
    route_norm: bool
    gate_bias: bool
    has_shared_experts: bool = False
    shared_experts_pattern: str = ""
    shared_experts_gate_pattern: str = ""
    expert_activation: str = "swiglu"
    supports_expert_bias: bool = True
    unsupported_router_bias_names: tuple[str, ...] = ()
    preset_adapter: str = "default"
    hf_model_types: tuple[str, ...] = ()
    unsupported_hf_model_type_notes: dict[str, str] = field(default_factory=dict)
    min_transformers_version: str | None = None
    router_logits_capture: str = "none"  # "router": transformers records the router's logits


@dataclass
class MoELayerSpec:
    """One detected MoE layer: names of its parts, its sizes and its routing."""

    moe_module_name: str
    model_family: str
    router_name: str
    experts_name: str
    expert_storage: str
    expert_w1_name: str
    expert_w2_name: str
    expert_w3_name: str | None
    num_experts: int
    top_k: int
    hidden_size: int
    ffn_hidden_size: int
    score_func: str
    score_apply: str
    route_norm: bool
    gate_bias: bool
    return_router_logits: bool
    router_logits_capture_target: str
    router_logits_capture_index: int | None
    router_logits_capture_layer_name: str | None
    has_shared_experts: bool
    shared_experts_name: str
    shared_experts_gate_name: str = ""
    route_scale: float = 1.0
    num_expert_groups: int | None = None
    num_limited_groups: int | None = None
    group_score_func: str = "top2_sum"
    supports_expert_bias: bool = True
    unsupported_router_bias_names: tuple[str, ...] = ()
    preset_adapter: str = "default"
    expert_activation: str = "swiglu"
    # The name DeepSpeed's AutoEP layer also registers its router under (transformers' router-logits
    # recorder looks there), so DeepSpeed's state dict holds the router twice; checkpoint files in
    # DeepSpeed's layout carry both (checkpoint/deepspeed_moe_save.py). None: no second name.
    checkpoint_router_alias: str | None = None


_LAYERS = r"model\.layers\.\d+\.mlp"

PRESET_MODELS: dict[str, MoEModelPreset] = {
    "mixtral": MoEModelPreset(
        _LAYERS, "gate", "experts", "fused_3d", "gate_up_proj", "down_proj", None, "num_local_experts",
        "num_experts_per_tok", "softmax", "post", True, False, preset_adapter="mixtral",
        hf_model_types=("mixtral",), min_transformers_version="5.0.0", router_logits_capture="router",
    ),
    "qwen3_moe": MoEModelPreset(
        _LAYERS, "gate", "experts", "fused_3d", "gate_up_proj", "down_proj", None, "num_experts",
        "num_experts_per_tok", "softmax", "post", True, False, has_shared_experts=True,
        shared_experts_pattern="shared_expert", shared_experts_gate_pattern="shared_expert_gate",
        preset_adapter="qwen3_moe", hf_model_types=("qwen3_moe", "qwen2_moe"), min_transformers_version="5.0.0",
        router_logits_capture="router",
    ),
    "qwen3_5_moe": MoEModelPreset(
        _LAYERS, "gate", "experts", "fused_3d", "gate_up_proj", "down_proj", None, "num_experts",
        "num_experts_per_tok", "softmax", "post", True, False, has_shared_experts=True,
        shared_experts_pattern="shared_expert", shared_experts_gate_pattern="shared_expert_gate",
        preset_adapter="qwen3_5_moe", hf_model_types=("qwen3_5_moe_text",),
        unsupported_hf_model_type_notes={
            "qwen3_5_moe": "the multimodal qwen3_5_moe wrapper is not converted; convert its text model "
            "(model_type 'qwen3_5_moe_text') instead",
        },
        min_transformers_version="5.0.0", router_logits_capture="router",
    ),
    "deepseek_v2": MoEModelPreset(
        _LAYERS, "gate", "experts", "module_list", "gate_proj", "down_proj", "up_proj", "n_routed_experts",
        "num_experts_per_tok", "softmax", "post", False, False, has_shared_experts=True,
        shared_experts_pattern="shared_experts", supports_expert_bias=False, preset_adapter="deepseek_v2",
        hf_model_types=("deepseek_v2",), min_transformers_version="5.0.0",
    ),
    "deepseek_v3": MoEModelPreset(
        _LAYERS, "gate", "experts", "module_list", "gate_proj", "down_proj", "up_proj", "n_routed_experts",
        "num_experts_per_tok", "sigmoid", "post", True, False, has_shared_experts=True,
        shared_experts_pattern="shared_experts", preset_adapter="deepseek_v3", hf_model_types=("deepseek_v3",),
        min_transformers_version="5.0.0",
    ),
}
"""The families, by preset name (``expert_parallel.preset_model``)."""


def preset_name_for_hf_model_type(model_type: str | None) -> str | None:
    """The preset covering a transformers ``config.model_type`` (None when none does)."""
    for name, preset in PRESET_MODELS.items():
        if model_type in preset.hf_model_types:
            return name
    return None


def unsupported_preset_for_hf_model_type(model_type: str | None) -> tuple[str, MoEModelPreset] | None:
    """``(preset name, preset)`` of a family that names ``model_type`` as not convertible, with why."""
    for name, preset in PRESET_MODELS.items():
        if model_type in preset.unsupported_hf_model_type_notes:
            return name, preset
    return None


def available_preset_names() -> list[str]:
    """The preset names, sorted."""
    return sorted(PRESET_MODELS)


class PresetAdapter:
    """A family's check of the environment before its layers are converted: transformers at least
    the preset's ``min_transformers_version`` when the model is a transformers model (a model of
    the family's layout built by hand needs no transformers)."""

    def __init__(self, name: str) -> None:
        self.name = name

    def _installed_transformers_version(self) -> str | None:
        """transformers' version, None when it is not installed."""
        try:
            import transformers
        except ImportError:
            return None
        return str(transformers.__version__)

    def check_environment(self, model: object) -> None:
        """Raise when the model comes from transformers older than the preset was written for."""
        preset = PRESET_MODELS[self.name]
        needs = preset.min_transformers_version
        from_transformers = type(model).__module__.startswith("transformers.")
        if needs is None or not from_transformers:
            return
        installed = self._installed_transformers_version()
        if installed is None or _version(installed) < _version(needs):
            raise ValueError(
                f"expert_parallel.preset_model = {self.name!r}: needs transformers >= {needs} (its MoE "
                f"layout), installed: {installed or 'none'}; fix: upgrade transformers"
            )


def _version(text: str) -> tuple[int, ...]:
    parts = []
    for piece in text.split(".")[:3]:
        digits = "".join(ch for ch in piece if ch.isdigit())
        parts.append(int(digits) if digits else 0)
    return tuple(parts)


_ADAPTERS = {name: PresetAdapter(name) for name in PRESET_MODELS}


def get_preset_adapter(name: str) -> PresetAdapter:
    """The adapter of preset ``name`` (one object per preset, so a test can patch it)."""
    return _ADAPTERS[name]
