"""What ``initialize`` does with the ``expert_parallel`` section: read and check it, declare
``ep = autoep_size`` to the process layout, replace the model's MoE blocks, and say which new
parameters stand for the old ones (parameter lists and optimizers built before are re-pointed).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from torch import Tensor, nn

from shardwise.autoep.config import (
    AutoEPConfig,
    parse_autoep_config,
    validate_autoep_config,
    validate_autoep_post_detection,
)
from shardwise.autoep.detect import AutoEP
from shardwise.autoep.folding import FoldingGroupHandles, build_folding_spec, local_folding_ranks
from shardwise.comm import mesh
from shardwise.comm.init import get_rank
from shardwise.comm.topology import Topology

Replacements = dict[int, list[nn.Parameter]]
"""``id(old parameter) -> the parameters that replace it`` (empty: it left this rank)."""



def _section(raw: Mapping[str, Any], key: str) -> Mapping[str, Any]:
    value = raw.get(key)
    return value if isinstance(value, Mapping) else {}


def _offloaded(zero: Mapping[str, Any], key: str) -> bool:
    """Whether ``zero_optimization.<key>`` moves something off the device (a device other than none)."""
    device = _section(zero, key).get("device")
    return device not in (None, "none")


def autoep_config(raw: Mapping[str, Any], topology: Topology, mpu: Any = None) -> AutoEPConfig | None:
    """The checked ``expert_parallel`` section of the whole config ``raw`` when it enables AutoEP, else
    None (a bad key is refused either way). The settings the folding rules read (ZeRO stage and
    offload, DeepCompile, AutoTP's preset, ``use_data_before_expert_parallel_``, an mpu) come from
    ``raw`` too."""
    section = raw.get("expert_parallel")
    config = parse_autoep_config(dict(section) if section else None)
    dims = topology.dims
    zero = _section(raw, "zero_optimization")
    stage = zero.get("stage", 0)
    validate_autoep_config(
        config, world_size=topology.world_size, pp_size=dims.pp, tp_size=dims.tp, sp_size=topology.sp_size,
        zero_stage=stage if isinstance(stage, int) else 0,
        deepcompile_enabled=bool(_section(raw, "compile").get("deepcompile", False)),
        tp_preset_model=_section(raw, "tensor_parallel").get("preset_model"),
        use_data_before_expert_parallel=bool(raw.get("use_data_before_expert_parallel_", False)),
        mpu=mpu if config.enabled else None,
        zero_offload_optimizer=_offloaded(zero, "offload_optimizer"),
        zero_offload_param=_offloaded(zero, "offload_param"),
    )
    return config if config.enabled else None


def _old_params(layer_source: nn.Module, spec: Any) -> dict[str, list[Tensor]]:
    gate = getattr(layer_source, spec.router_name)
    experts = getattr(layer_source, spec.experts_name)
    found: dict[str, list[Tensor]] = {"router": [p for p in gate.parameters(recurse=False)]}
    if spec.expert_storage == "module_list":
        found["experts"] = [p for p in experts.parameters()]
    else:
        found["experts"] = [p for p in experts.parameters(recurse=False)]
    return found


def folding_group_handles(layout: Topology) -> FoldingGroupHandles:
    """This rank's folded groups (AutoEP over AutoTP) as the layout built them, checked against the
    folding spec's rank tables (RuntimeError naming the group that differs)."""
    spec = build_folding_spec(world_size=layout.world_size, pp_size=layout.size_of("pp"),
                              tp_size=layout.size_of("tp"), ep_size=layout.size_of("ep"))
    expected = local_folding_ranks(get_rank(), spec)
    for name, dim in (("tp", "tp"), ("dense_dp", "dp"), ("ep", "ep"), ("edp", "edp")):
        if tuple(layout.ranks_of(dim)) != expected[name]:
            raise RuntimeError(
                f"the process layout's {dim} group {tuple(layout.ranks_of(dim))} is not the folding spec's "
                f"{expected[name]} (tp={spec.tp_size}, ep={spec.ep_size}, world={spec.world_size}); the layout "
                "was built without fold_ep: declare expert parallelism through the expert_parallel section only"
            )
    return FoldingGroupHandles(
        spec=spec, tp_group=layout.group_of("tp"), dense_dp_group=layout.group_of("dp"),
        ep_group=layout.group_of("ep"), edp_group=layout.group_of("edp"), ep_group_name=f"ep_size_{spec.ep_size}",
        tp_ranks=expected["tp"], dense_dp_ranks=expected["dense_dp"], ep_ranks=expected["ep"],
        edp_ranks=expected["edp"],
    )


def convert_model(model: nn.Module, config: AutoEPConfig, topology: Topology | None) -> Replacements:
    """Replace every detected MoE block of ``model`` by an :class:`AutoEPMoELayer` holding this rank's
    experts (collective when ``autoep_size > 1``: the layout's ``ep`` group is declared)."""
    auto_ep = AutoEP(model, config)
    specs = auto_ep.ep_parser()
    if not specs:
        raise ValueError(
            "expert_parallel.enabled = true: no MoE block found in the model (families tried: "
            f"{config.preset_model or 'every preset'}); fix: set expert_parallel.preset_model to the model's "
            "family, or moe_layer_pattern / router_pattern / expert_pattern to its layout, or disable the section"
        )
    validate_autoep_post_detection(config, specs)
    group, ep_rank, handles = None, 0, None
    if config.autoep_size > 1:
        folded = topology is not None and topology.size_of("tp") > 1
        layout = mesh.ensure_layout(ep=config.autoep_size, fold_ep=folded or None,
                                    source="expert_parallel.autoep_size")
        group, ep_rank = layout.group_of("ep"), layout.rank_in("ep")
        handles = folding_group_handles(layout) if folded else None
    replaced: Replacements = {}
    for spec in specs:
        source = model.get_submodule(spec.moe_module_name)
        old = _old_params(source, spec)
        layer = auto_ep.replace_moe_layer(spec, config.autoep_size, ep_rank)
        if handles is not None:
            layer.set_deepspeed_parallelism(folding_group_handles=handles)
        else:
            layer.set_ep_group(group)
        router_new = list(layer.router.parameters())
        for i, param in enumerate(old["router"]):
            replaced[id(param)] = [router_new[i]] if i < len(router_new) else []
        new_experts = [layer.experts.w1, layer.experts.w2, layer.experts.w3]
        for i, param in enumerate(old["experts"]):
            replaced[id(param)] = new_experts if i == 0 else []
    return replaced


def repoint(params: Any, replaced: Replacements) -> Any:
    """``model_parameters`` (tensors or groups) with converted parameters swapped for their
    replacements (other entries as they were, each new parameter once)."""
    if isinstance(params, dict):
        return {**params, "params": repoint(list(params["params"]), replaced)}
    if isinstance(params, (list, tuple)):
        out: list[Any] = []
        seen: set[int] = set()
        for item in params:
            if isinstance(item, Tensor) and id(item) in replaced:
                for new in replaced[id(item)]:
                    if id(new) not in seen:
                        seen.add(id(new))
                        out.append(new)
            else:
                out.append(repoint(item, replaced) if isinstance(item, dict) else item)
        return out if isinstance(params, list) else tuple(out)
    return params

