"""DeepSpeed's MoE model files, written into a shardwise save of a model with MoE layers.

DeepSpeed users and tools read a MoE checkpoint's ``mp_rank_00_model_states.pt`` (the non-expert
weights, ``num_experts``, ``ds_autoep_layers``) and its ``layer_{L}_expert_{E}_mp_rank_00_model_states.pt``
files (:mod:`~shardwise.checkpoint.deepspeed_moe`). With ``"checkpoint": {"deepspeed_moe_files": true}``
(the default; a shardwise key) ``engine.save_checkpoint`` writes them next to its own files, in the
training dtype, as DeepSpeed does at ZeRO stages 0-2: the first expert-data-parallel rank of each
expert-parallel rank writes its experts' files, rank 0 the main file. shardwise itself loads its own
files (they come first); real DeepSpeed loads these weights with ``load_module_only=True`` (or
``load_optimizer_states=False``); ``shardwise checkpoint to-deepspeed`` writes a checkpoint DeepSpeed
resumes with its optimizer.

Not written (and said once in the log): at ZeRO stage 3 (DeepSpeed keeps AutoEP experts in its
partitioned optimizer files there), with tensor, model or pipeline parallelism (one ``mp_rank_00``
file holds the whole model here), except for AutoEP folded over AutoTP, whose per-lane files with
their layout record :mod:`~shardwise.checkpoint.folded_files` writes.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

from shardwise import comm
from shardwise.checkpoint import folded_files
from shardwise.checkpoint import universal_names as names
from shardwise.checkpoint.deepspeed_moe import (
    MoELayerRecord,
    add_router_aliases,
    autoep_metadata,
    expert_ckpt_name,
    moe_layers,
    split_experts,
)
from shardwise.checkpoint.folded_files import FoldedRun
from shardwise.comm import groups
from shardwise.moe.naming import global_expert_names
from shardwise.utils.logging import logger

MODEL_STATES_FILE = "mp_rank_00_model_states.pt"
_said: set[str] = set()


def _say_once(reason: str) -> None:
    if reason not in _said:
        _said.add(reason)
        logger.info("DeepSpeed's MoE files (checkpoint.deepspeed_moe_files) are not written: %s", reason)


def _first_experts(module: nn.Module, layers: list[MoELayerRecord]) -> dict[int, int]:
    """``layer_id -> global index of this rank's first expert``."""
    modules = dict(module.named_modules())
    out = {}
    for record in layers:
        layer = modules[record.module_path]
        ep_rank = layer.deepspeed_moe.ep_rank if record.kind == "moe" else layer.ep_rank
        out[record.layer_id] = int(ep_rank) * (record.num_experts // record.ep_size)
    return out


def side_files(
    module: nn.Module, *, zero_stage: int, mp_world_size: int, dp_world_size: int, common: Mapping[str, Any],
    folding: FoldedRun | None = None, optimizer: Any = None,
) -> dict[str, dict[str, Any]]:
    """This rank's DeepSpeed MoE files of ``module``: ``{file name: what torch.save writes}`` (CPU
    copies, so an asynchronous save may write them later); ``{}`` without MoE layers or where they
    are not written (see the module docstring). ``common`` is the save's common state (counters,
    scheduler, client state, config). A folded AutoEP+AutoTP run (``folding``) writes one set per
    tensor-parallel lane, with the layout record (:mod:`~shardwise.checkpoint.folded_files`;
    ``optimizer``: its torch optimizer, for stage 0's optimizer file)."""
    layers = moe_layers(module)
    if not layers:
        return {}
    if zero_stage == 3:
        _say_once("ZeRO stage 3 (use `shardwise checkpoint to-deepspeed` or to-universal)")
        return {}
    if folding is not None:
        state = {global_expert_names(module).get(k, k): v for k, v in module.state_dict().items()}
        main, experts = split_experts(folded_files.local_copies(state), layers, _first_experts(module, layers))
        add_router_aliases(main, layers)
        main_file = _main_file(module, main, layers, dp_world_size, common) if folding.model_writer else None
        return folded_files.side_files(folding, module, layers, main, experts, main_file, optimizer, zero_stage)
    if mp_world_size > 1 or groups.get_pipeline_parallel_world_size() > 1:  # (AutoEP's own cuts of the stacked
        _say_once("tensor, model or pipeline parallelism")  # expert weights are not tensor parallelism)
        return {}
    renames = global_expert_names(module)
    state = {renames.get(k, k): v.detach().to("cpu", copy=True) for k, v in module.state_dict().items()}
    main, experts = split_experts(state, layers, _first_experts(module, layers))
    add_router_aliases(main, layers)
    out: dict[str, dict[str, Any]] = {}
    if groups.get_expert_data_parallel_rank() == 0:
        for (layer_id, expert), tensors in experts.items():
            out[expert_ckpt_name("", layer_id, expert, None)] = tensors
    if comm.get_rank() == 0:
        out[MODEL_STATES_FILE] = _main_file(module, main, layers, dp_world_size, common)
        if "written" not in _said:
            _said.add("written")
            logger.info("each save also writes DeepSpeed's MoE model files (mp_rank_00_model_states.pt and "
                        "layer_L_expert_E_*: the weights once more, %d tensors); checkpoint.deepspeed_moe_files "
                        "= false leaves them out", len(main) + sum(len(t) for t in experts.values()))
    return out


def _main_file(module: nn.Module, main: dict[str, torch.Tensor], layers: list[MoELayerRecord],
               dp_world_size: int, common: Mapping[str, Any]) -> dict[str, Any]:
    from shardwise.checkpoint.universal_write import _model_states

    params = {n for n, _ in module.named_parameters(remove_duplicate=False)}
    ds_config = dict(common.get("ds_config") or {})
    states = _model_states(main, [], {}, common.get("counters", {}), ds_config, common.get("lr_scheduler"),
                           common.get("client_state"), dp_world_size, [n for n in main if n not in params])
    states.pop(names.UNIVERSAL_INFO, None)
    first = _first_experts(module, layers)
    ep_rank = {r.layer_id: first[r.layer_id] // max(1, r.num_experts // r.ep_size) for r in layers}
    autoep = autoep_metadata(layers)
    for entry in autoep or []:  # rank 0's own place, as DeepSpeed's main file records it
        local = entry["num_local_experts"]
        entry.update(ep_rank=ep_rank[entry["moe_layer_id"]], global_expert_start=first[entry["moe_layer_id"]],
                     global_expert_end=first[entry["moe_layer_id"]] + local)
    states.update(param_shapes=None, frozen_param_shapes=None, shared_params=None,
                  num_experts=[r.num_experts for r in layers], ds_autoep_layers=autoep)
    return states
