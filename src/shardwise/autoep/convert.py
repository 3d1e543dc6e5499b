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
from shardwise.comm import mesh
from shardwise.comm.topology import Topology

Replacements = dict[int, list[nn.Parameter]]
"""``id(old parameter) -> the parameters that replace it`` (empty: it left this rank)."""



def autoep_config(section: Mapping[str, Any] | None, topology: Topology) -> AutoEPConfig | None:
    """The checked section when it enables AutoEP, else None (a bad key is refused either way)."""
    config = parse_autoep_config(dict(section) if section else None)
    dims = topology.dims
    validate_autoep_config(config, world_size=topology.world_size, pp_size=dims.pp, tp_size=dims.tp,
                           sp_size=topology.sp_size)
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
    group, ep_rank = None, 0
    if config.autoep_size > 1:
        layout = mesh.ensure_layout(ep=config.autoep_size, source="expert_parallel.autoep_size")
        group, ep_rank = layout.group_of("ep"), layout.rank_in("ep")
    replaced: Replacements = {}
    for spec in specs:
        source = model.get_submodule(spec.moe_module_name)
        old = _old_params(source, spec)
        layer = auto_ep.replace_moe_layer(spec, config.autoep_size, ep_rank)
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

