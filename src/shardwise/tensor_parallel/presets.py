"""Built-in layer specs for common model families (``tensor_parallel.preset_model``) and the
plan a ``tensor_parallel`` section asks for.

The presets split attention and MLP projections the way DeepSpeed's AutoTP presets do:
query/key/value and the MLP's up/gate projections by column, the attention output and the MLP's
down projection by row, MoE routers left whole. Fused projections carry a ``shape`` so each
packed sub-parameter is split on its own.

Example:
    >>> [s.partition_type for s in preset("llama").specs]
    ['row', 'column', 'row', 'column']
    >>> resolve_plan(preset_model="qwen2", partition_config=None).find("model.layers.3.mlp.up_proj.weight").partition_type
    'column'
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from shardwise.tensor_parallel.specs import LayerSpec, PartitionPlan, merge_plans, plan_from_dict

__all__ = ["PRESETS", "preset", "resolve_plan"]


def _s(kind: str, *patterns: str, **extra: Any) -> LayerSpec:
    return LayerSpec(patterns=patterns, partition_type=kind, **extra)


def _llama_like() -> PartitionPlan:
    return PartitionPlan(specs=(
        _s("row", r".*\.self_attn\.o_proj\.weight$"),
        _s("column", r".*\.self_attn\.[qkv]_proj\.weight$"),
        _s("row", r".*\.mlp\.down_proj\.weight$"),
        _s("column", r".*\.mlp\.(up|gate)_proj\.weight$"),
    ))


def _bloom() -> PartitionPlan:
    return PartitionPlan(specs=(
        _s("row", r".*\.self_attention\.dense\.weight$"),
        _s("column", r".*\.self_attention\.query_key_value\.weight$"),  # heads interleaved: no reshape
        _s("row", r".*\.mlp\.dense_4h_to_h\.weight$"),
        _s("column", r".*\.mlp\.dense_h_to_4h\.weight$"),
    ))


def _chatglm() -> PartitionPlan:
    return PartitionPlan(specs=(
        _s("row", r".*\.self_attention\.dense\.weight$"),
        _s("column", r".*\.self_attention\.query_key_value\.weight$", shape=(3, -1), partition_dim=0),
        _s("row", r".*\.mlp\.dense_4h_to_h\.weight$"),
        _s("column", r".*\.mlp\.dense_h_to_4h\.weight$", shape=(2, -1), partition_dim=0),
    ))


def _mixtral() -> PartitionPlan:
    return PartitionPlan(specs=(
        _s("row", r".*\.self_attn\.o_proj\.weight$"),
        _s("column", r".*\.self_attn\.[qkv]_proj\.weight$"),
        _s("row", r".*\.block_sparse_moe\.experts\.\d+\.w2\.weight$"),
        _s("column", r".*\.block_sparse_moe\.experts\.\d+\.w[13]\.weight$"),
        _s("skip", r".*\.block_sparse_moe\.gate\.weight$"),
    ))


def _deepseek_v2() -> PartitionPlan:
    return PartitionPlan(specs=(
        _s("row", r".*\.self_attn\.o_proj\.weight$"),
        _s("skip", r".*\.self_attn\.(q_a_proj|kv_a_proj_with_mqa)\.weight$"),
        _s("column", r".*\.self_attn\.(q_b_proj|kv_b_proj)\.weight$"),
        _s("row", r".*\.mlp\.experts\.\d+\.down_proj\.weight$"),
        _s("column", r".*\.mlp\.experts\.\d+\.(up|gate)_proj\.weight$"),
        _s("skip", r".*\.mlp\.gate\.weight$"),
        _s("row", r".*\.mlp\.shared_experts\.down_proj\.weight$"),
        _s("column", r".*\.mlp\.shared_experts\.(up|gate)_proj\.weight$"),
    ))


def _phi3() -> PartitionPlan:
    return PartitionPlan(specs=(
        _s("row", r".*\.self_attn\.o_proj\.weight$"),
        _s("column", r".*\.self_attn\.qkv_proj\.weight$", shape=(3, -1), partition_dim=0),
        _s("row", r".*\.mlp\.down_proj\.weight$"),
        _s("column", r".*\.mlp\.gate_up_proj\.weight$", shape=(2, -1), partition_dim=0),
    ))


PRESETS: Mapping[str, Callable[[], PartitionPlan]] = {
    "llama": _llama_like,
    "bloom": _bloom,
    "chatglm": _chatglm,
    "mixtral": _mixtral,
    "deepseek_v2": _deepseek_v2,
    "qwen2": _llama_like,
    "phi3": _phi3,
}


def preset(name: str) -> PartitionPlan:
    """The preset plan called ``name`` (case-insensitive).

    Raises:
        ValueError: an unknown name, listing the known ones.
    """
    make = PRESETS.get(name.lower())
    if make is None:
        raise ValueError(
            f"tensor_parallel.preset_model = {name!r}: not a known preset; use one of "
            f"{', '.join(sorted(PRESETS))}, or describe the layers in tensor_parallel.partition_config.layer_specs"
        )
    return make()


def resolve_plan(*, preset_model: str | None, partition_config: Mapping[str, Any] | None) -> PartitionPlan | None:
    """The plan a ``tensor_parallel`` section asks for: the preset, the custom specs (before the
    preset's when ``use_default_specs``), or None when it names neither (then the model's own
    ``_tp_plan`` or the name heuristic decides)."""
    base = preset(preset_model) if preset_model else None
    if partition_config is None:
        return base
    custom = plan_from_dict(partition_config)
    if base is not None and custom.use_default_specs:
        return merge_plans(base, custom)
    return custom
