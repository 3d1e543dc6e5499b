"""The ``expert_parallel`` section (AutoEP): read, checked against the process layout and the
detected layers, and completed from a Hugging Face model config.

Every key DeepSpeed's AutoEP reads is read here into :class:`AutoEPConfig`, field for field under
DeepSpeed's names. What shardwise does not act on is refused by :func:`validate_autoep_config` with
the key, the value, the rule and the fix (``load_balance_coeff`` also by :func:`parse_autoep_config`:
the auxiliary-loss-free balancing it would turn on has no implementation in either library).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, NoReturn

from shardwise.autoep.experts import GATE_UP_IMPLS
from shardwise.autoep.folding import build_folding_spec, validate_folding_global

UNSET: Any = object()
"""A key left out of the section (``None`` can be a meaningful value, e.g. ``expert_w3: null``)."""

SCORE_APPLY = ("auto", "pre", "post")
SCORE_FUNCS = ("auto", "softmax", "sigmoid")
COMBINE_IMPLS = ("auto", "weighted_sum", "legacy_bmm")
EXPERT_ACTIVATIONS = ("swiglu", "geglu")


@dataclass
class AutoEPConfig:
    """The ``expert_parallel`` section, one attribute per DeepSpeed key (defaults as DeepSpeed's)."""

    enabled: bool = False
    autoep_size: int = 1
    expert_tensor_parallel_size: int = 1
    validate_folding_routing: Any = False
    async_split_plan: Any = False
    preset_model: str | None = None
    moe_layer_pattern: str | None = None
    expert_pattern: str | None = None
    router_pattern: str | None = None
    use_grouped_mm: bool = True
    disable_triton_grouped_mm: bool = False
    route_norm: bool | None = None
    route_scale: float = 1.0
    score_apply: str = "auto"
    combine_impl: str = "auto"
    row_weighting_impl: str = "auto"
    gate_up_impl: str = "separate"
    comm_backend: str = "comm"
    comm_num_sm: int = 12
    comm_qp_margin: int = 4
    comm_max_tokens_per_rank: int = 0
    num_expert_groups: int | None = None
    num_limited_groups: int | None = None
    score_func: str = "auto"
    top_k: Any = "auto"
    load_balance_coeff: Any = UNSET
    routed_scaling_factor: Any = "auto"
    expert_w1: str | None = None
    expert_w2: str | None = None
    expert_w3: Any = UNSET
    num_experts_attr: str | None = None
    top_k_attr: str | None = None
    has_shared_experts: bool | None = None
    shared_experts_pattern: str | None = None
    shared_experts_gate_pattern: str | None = None
    expert_activation: str | None = None
    _load_balance_coeff_explicit: bool = field(default=False, init=False, repr=False)

    def __post_init__(self) -> None:
        self._load_balance_coeff_explicit = self.load_balance_coeff is not UNSET
        if self.load_balance_coeff is UNSET:
            self.load_balance_coeff = None


def reject_load_balance_coeff(value: object) -> NoReturn:
    """``load_balance_coeff`` other than null: refused (no auxiliary-loss-free balancing here)."""
    raise ValueError(
        f"expert_parallel.load_balance_coeff = {value!r}: not supported (it would add a per-expert "
        "expert_bias to the routing scores, auxiliary-loss-free balancing, which AutoEP does not "
        "implement); fix: set load_balance_coeff to null or omit the key"
    )


_DEFAULTS = AutoEPConfig()


def parse_autoep_config(section: dict[str, Any] | None) -> AutoEPConfig:
    """The section as an :class:`AutoEPConfig`: every key read, defaults for the rest.

    Types and values are checked later (:func:`validate_autoep_config`), except ``load_balance_coeff``,
    refused here unless null.
    """
    config = AutoEPConfig()
    if not section:
        return config
    for name in AutoEPConfig.__dataclass_fields__:
        if name.startswith("_") or name == "load_balance_coeff" or name not in section:
            continue
        setattr(config, name, section[name])
    if "load_balance_coeff" in section:
        if section["load_balance_coeff"] is not None:
            reject_load_balance_coeff(section["load_balance_coeff"])
        config._load_balance_coeff_explicit = True
    return config


def _fail(key: str, value: object, rule: str, fix: str) -> ValueError:
    return ValueError(f"expert_parallel.{key} = {value!r}: {rule}; fix: {fix}")


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _check_choice(config: AutoEPConfig, key: str, choices: tuple[str, ...]) -> None:
    value = getattr(config, key)
    if value not in choices:
        raise _fail(key, value, f"one of {list(choices)}", "choose one of them or leave the key out")


def _check_name(config: AutoEPConfig, key: str) -> None:
    value = getattr(config, key)
    if value is None or value is UNSET:
        return
    if not isinstance(value, str) or not value or "." in value:
        raise _fail(key, value, "a direct attribute name (a non-empty string without dots)",
                    "name the child module or parameter as it appears on its parent")


def validate_autoep_config(
    config: AutoEPConfig,
    world_size: int,
    pp_size: int,
    tp_size: int,
    sp_size: int,
    *,
    zero_stage: int = 0,
    deepcompile_enabled: bool = False,
    tp_preset_model: str | None = None,
    use_data_before_expert_parallel: bool = False,
    mpu: Any = None,
    zero_offload_optimizer: bool = False,
    zero_offload_param: bool = False,
) -> None:
    """Check the section against itself and the process layout (``world_size`` ranks in ``pp_size``
    pipeline stages, ``tp_size`` tensor- and ``sp_size`` sequence-parallel); ValueError naming the key.

    With ``tp_size`` > 1 the experts fold over the tensor-parallel ranks, and the folding rules of
    :func:`shardwise.autoep.folding.validate_folding_global` apply (the keyword arguments feed them).
    """
    if config.load_balance_coeff is not None:
        reject_load_balance_coeff(config.load_balance_coeff)
    for key in ("validate_folding_routing", "async_split_plan"):
        if not isinstance(getattr(config, key), bool):
            raise _fail(key, getattr(config, key), "a boolean", "write true or false")
    if not config.enabled:
        return
    size = config.autoep_size
    if not _is_int(size) or size < 1:
        raise _fail("autoep_size", size, "an int >= 1", "set the number of ranks that share one layer's experts")
    if config.async_split_plan and size > 1 and tp_size > 1:
        raise _fail("async_split_plan", True, "not supported with AutoEP+AutoTP folding "
                    f"(tensor_parallel.autotp_size={tp_size})", "set async_split_plan to false")
    spec = build_folding_spec(world_size=world_size, pp_size=pp_size, tp_size=max(tp_size, 1), ep_size=size,
                              etp_size=config.expert_tensor_parallel_size, mp_mode="tp" if tp_size > 1 else "sp")
    validate_folding_global(
        spec, zero_stage=zero_stage, sp_size=sp_size, deepcompile_enabled=deepcompile_enabled,
        use_data_before_expert_parallel=use_data_before_expert_parallel, mpu=mpu, tp_preset=tp_preset_model,
        ep_preset=config.preset_model, zero_offload_optimizer=zero_offload_optimizer,
        zero_offload_param=zero_offload_param,
    )
    if config.preset_model is not None:
        from shardwise.autoep.presets import PRESET_MODELS

        if config.preset_model not in PRESET_MODELS:
            raise _fail("preset_model", config.preset_model, f"one of {sorted(PRESET_MODELS)}",
                        "name the model family or leave it out (detected from config.model_type)")
    _check_choice(config, "score_apply", SCORE_APPLY)
    _check_choice(config, "score_func", SCORE_FUNCS)
    _check_choice(config, "combine_impl", COMBINE_IMPLS)
    _check_choice(config, "gate_up_impl", GATE_UP_IMPLS)
    if config.gate_up_impl == "fused" and not config.use_grouped_mm:
        raise _fail("gate_up_impl", "fused", "runs the gate and up projections as one grouped product, but "
                    "use_grouped_mm=false selects the loop of one product per expert (DeepSpeed refuses it too)",
                    "set use_grouped_mm to true, or leave gate_up_impl out")
    for key, supported, why in (
        ("row_weighting_impl", ("auto", "eager"), "the combine weights rows in eager PyTorch"),
        ("comm_backend", ("comm",), "tokens travel over torch's all-to-all; DeepEP is a compiled extension"),
    ):
        if getattr(config, key) not in supported:
            raise _fail(key, getattr(config, key), f"shardwise supports {list(supported)} ({why})", "leave the key out")
    if config.expert_activation is not None and config.expert_activation not in EXPERT_ACTIVATIONS:
        raise _fail("expert_activation", config.expert_activation, f"one of {list(EXPERT_ACTIVATIONS)}",
                    "name the experts' activation or leave it out (the preset's)")
    for key in ("num_expert_groups", "num_limited_groups"):
        value = getattr(config, key)
        if value is not None and (not _is_int(value) or value < 1):
            raise _fail(key, value, "an int >= 1", "set the number of expert groups or leave it out")
    if (config.num_expert_groups is not None and config.num_limited_groups is not None
            and config.num_limited_groups > config.num_expert_groups):
        raise _fail("num_limited_groups", config.num_limited_groups,
                    f"at most num_expert_groups ({config.num_expert_groups})", "lower it")
    for key in ("expert_w1", "expert_w2", "expert_w3", "num_experts_attr", "top_k_attr", "router_pattern",
                "expert_pattern", "shared_experts_pattern", "shared_experts_gate_pattern"):
        _check_name(config, key)
    if config.has_shared_experts is not None and not isinstance(config.has_shared_experts, bool):
        raise _fail("has_shared_experts", config.has_shared_experts, "a boolean", "write true or false")
    if config.top_k != "auto" and (not _is_int(config.top_k) or config.top_k < 1):
        raise _fail("top_k", config.top_k, "an int >= 1 or 'auto'", "set how many experts each token goes to")
    if config.routed_scaling_factor != "auto":
        resolve_route_scale(config, None)


def validate_autoep_post_detection(config: AutoEPConfig, specs: list[Any]) -> None:
    """Check ``autoep_size`` and group routing against each detected layer (its ``num_experts``)."""
    if not config.enabled:
        return
    for spec in specs:
        where = f"layer {spec.moe_module_name!r} has {spec.num_experts} experts"
        divisors = [d for d in range(1, spec.num_experts + 1) if spec.num_experts % d == 0]
        if config.autoep_size > spec.num_experts:
            raise _fail("autoep_size", config.autoep_size, f"exceeds num_experts: {where}, and every rank "
                        "owns at least one expert", f"choose one of {divisors}")
        if spec.num_experts % config.autoep_size:
            raise _fail("autoep_size", config.autoep_size, f"must divide num_experts: {where}",
                        f"choose one of {divisors}")
        groups = spec.num_expert_groups if spec.num_expert_groups is not None else config.num_expert_groups
        limited = spec.num_limited_groups if spec.num_limited_groups is not None else config.num_limited_groups
        if groups is None and limited is not None:
            raise _fail("num_limited_groups", limited, f"needs num_expert_groups ({where})", "set both or neither")
        if groups is not None:
            if spec.num_experts % groups:
                raise _fail("num_expert_groups", groups, f"must divide num_experts: {where}", "choose a divisor")
            if limited is None or not 1 <= limited <= groups:
                raise _fail("num_limited_groups", limited, f"an int in [1, num_expert_groups={groups}] ({where})",
                            "set how many groups each token may use")


def fill_autoep_config_from_hf(config: AutoEPConfig, model_config: Any) -> None:
    """Fill what the section left out from a Hugging Face config: DeepSeek's ``n_group`` /
    ``topk_group`` (group-limited routing) and ``routed_scaling_factor`` (the score scale)."""
    if model_config is None:
        return
    if config.num_expert_groups is None:
        config.num_expert_groups = getattr(model_config, "n_group", None)
    if config.num_limited_groups is None:
        config.num_limited_groups = getattr(model_config, "topk_group", None)
    if config.routed_scaling_factor == "auto":
        scale = getattr(model_config, "routed_scaling_factor", None)
        if scale is not None:
            config.route_scale = float(scale)


def resolve_route_scale(config: AutoEPConfig, model_config: Any) -> float:
    """The factor on the routing scores: ``routed_scaling_factor`` when set (a finite number), else
    the model config's ``routed_scaling_factor``, else ``route_scale``."""
    value = config.routed_scaling_factor
    if value == "auto" and not isinstance(value, bool):
        value = getattr(model_config, "routed_scaling_factor", None)
        if value is None:
            value = config.route_scale
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise _fail("routed_scaling_factor", config.routed_scaling_factor, "a finite number or 'auto'",
                    "write the factor as a number, e.g. 2.5, or leave it out")
    return float(value)
