"""``to-deepspeed`` for a model with MoE layers (``deepspeed.moe`` or AutoEP): DeepSpeed's per-expert files at ZeRO 0.

DeepSpeed saves such a model (stage 0) as (:mod:`~shardwise.checkpoint.deepspeed_moe`):

* ``mp_rank_00_model_states.pt``: the non-expert weights, ``num_experts`` (one count per MoE layer),
  ``ds_autoep_layers`` (the AutoEP layers, or None) and the usual counters, scheduler and config;
* ``layer_{L}_expert_{E}_mp_rank_00_model_states.pt``: each expert's weights by global index;
* ``expp_rank_{R}_mp_rank_00_optim_states.pt``: ``{"optimizer": ...}``, the torch optimizer state
  of expert-parallel rank ``R``, whose parameters are the dense ones and its own experts
  ``R * L .. R * L + L - 1`` (``L = num_experts / ep_size``) under their local names.

DeepSpeed builds that optimizer from ``configure_moe_param_groups``: each client group keeps its
dense parameters, and its expert parameters follow in a group of their own (``"name":
"ep_size_<N>"``, ``"moe": True``), in module order, cut at DeepSpeed's 178956971-element cap. The
optimizer files are written for the expert-parallel size the DeepSpeed run will use
(``ep_size``: one file per expert-parallel rank); the weight files do not depend on it.

Each rank's optimizer entry is what the stage-0 exporter writes for a model of that rank's parameters
(fp32: torch's state dict; 16-bit: DeepSpeed's fused or unfused wrapper). An AutoEP layer's stacked
``w1``/``w2``/``w3`` (and their element-wise state) are cut to the rank's rows; DeepSpeed's second name
of its router is added to the main file's module.
"""

from __future__ import annotations

import collections
import math
import re
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch

from shardwise.checkpoint import keys
from shardwise.checkpoint.deepspeed_moe import (
    AUTOEP_WEIGHTS,
    MOE_EXPERTS,
    MoELayerRecord,
    add_router_aliases,
    autoep_metadata,
    expert_ckpt_name,
    optim_ckpt_name,
    records_from_json,
    split_experts,
)

MAX_MOE_GROUP_NUMEL = 178956971  # DeepSpeed's default cap on one expert group's elements
_GLOBAL = re.compile(rf"^(?P<layer>.*?){re.escape(MOE_EXPERTS)}(?P<index>\d+)\.(?P<rest>.+)$")


def saved_moe_layers(summary: Mapping[str, Any], module: Mapping[str, torch.Tensor]) -> list[MoELayerRecord]:
    """The MoE layers of a shardwise checkpoint: its summary's record, else (older saves) the
    ``deepspeed.moe`` layers its tensor names show (expert-parallel size unknown: 1)."""
    if summary.get("moe_layers") is not None:
        return records_from_json(summary["moe_layers"])
    counts: dict[str, set[int]] = {}
    for name in module:
        match = _GLOBAL.match(name)
        if match:
            counts.setdefault(match.group("layer").rstrip("."), set()).add(int(match.group("index")))
    return [MoELayerRecord(i, path, "moe", len(found), 1) for i, (path, found) in enumerate(counts.items())]


def _expert_template(names: Sequence[str], layers: Sequence[MoELayerRecord]) -> dict[str, list[str]]:
    """Per MoE layer, the names of one expert's tensors after ``<index>.`` (in saved order)."""
    out: dict[str, list[str]] = {}
    for name in names:
        match = _GLOBAL.match(name)
        if match:
            rests = out.setdefault(match.group("layer"), [])
            if match.group("rest") not in rests:
                rests.append(match.group("rest"))
    wanted = {r.expert_prefix[: -len(MOE_EXPERTS)] for r in layers if r.kind == "moe"}
    return {layer: rests for layer, rests in out.items() if layer in wanted}


Member = tuple[str, str, "tuple[int, int] | None"]
"""One parameter of a rank's group: (its name there, its name in the checkpoint, the rows of a stacked
AutoEP weight it holds, or None for the whole tensor)."""


def _autoep_rows(layers: Sequence[MoELayerRecord], ep_size: int, ep_rank: int) -> dict[str, tuple[int, int]]:
    """``stacked expert weight name -> (first row, end row)`` of ``ep_rank``'s experts."""
    out = {}
    for record in layers:
        if record.kind == "autoep":
            local = record.num_experts // ep_size
            for weight in AUTOEP_WEIGHTS:
                out[f"{record.expert_prefix}{weight}"] = (ep_rank * local, (ep_rank + 1) * local)
    return out


def _rank_groups(
    groups: Sequence[Mapping[str, Any]],
    param_order: Sequence[str],
    layers: Sequence[MoELayerRecord],
    ep_size: int,
    ep_rank: int,
    shapes: Mapping[str, torch.Size],
) -> list[tuple[Mapping[str, Any], list[Member], bool]]:
    """DeepSpeed's optimizer groups on expert-parallel rank ``ep_rank``: per saved group, its dense
    parameters, then (appended after all of them) its expert parameters (:data:`Member`), in module
    order, cut at the element cap. Returns ``(saved group, members, is_moe)``."""
    template = _expert_template(param_order, layers)
    stacked = _autoep_rows(layers, ep_size, ep_rank)
    local_count = {r.expert_prefix[: -len(MOE_EXPERTS)]: r.num_experts // ep_size for r in layers if r.kind == "moe"}
    out: list[tuple[Mapping[str, Any], list[Member], bool]] = []
    added: list[tuple[Mapping[str, Any], list[Member], bool]] = []
    for group in groups:
        members = set(group[keys.PARAM_NAMES])
        dense: list[Member] = [(n, n, None) for n in param_order
                               if n in members and not _GLOBAL.match(n) and n not in stacked]
        expert_layers = [lay for lay in template if any(_GLOBAL.match(n) and n.startswith(lay) for n in members)]
        experts: list[Member] = []
        for lay in expert_layers:
            count = local_count[lay]
            for local in range(count):
                for rest in template[lay]:
                    global_name = f"{lay}{MOE_EXPERTS}{ep_rank * count + local}.{rest}"
                    experts.append((f"{lay}{MOE_EXPERTS}{local}.{rest}", global_name, None))
        experts += [(n, n, stacked[n]) for n in param_order if n in members and n in stacked]
        out.append((group, dense, False))
        run: list[Member] = []
        size = 0
        for local_name, global_name, rows in experts:
            numel = math.prod(shapes[global_name]) // (1 if rows is None else ep_size)
            if run and size + numel > MAX_MOE_GROUP_NUMEL:
                added.append((group, run, True))
                run, size = [], 0
            run.append((local_name, global_name, rows))
            size += numel
        if run:
            added.append((group, run, True))
    return out + added


def _rows_of(value: Any, whole: torch.Tensor, rows: tuple[int, int] | None) -> Any:
    """``value`` (a parameter's weight or element-wise state) cut to a rank's rows of a stacked weight."""
    if rows is None or not torch.is_tensor(value) or value.numel() != whole.numel() or value.dim() == 0:
        return value
    return value.reshape(whole.shape)[rows[0]:rows[1]]


def _entries_by_name(optimizer: Mapping[str, Any]) -> dict[str, list[tuple[str, str, Any]]]:
    """``name -> [(prefix, rest, value)]`` of the ``master/<name>`` and ``optim/<name>/<key>`` entries."""
    out: dict[str, list[tuple[str, str, Any]]] = {}
    for key, value in optimizer.items():
        if key.startswith(keys.MASTER):
            out.setdefault(key[len(keys.MASTER):], []).append((keys.MASTER, "", value))
        elif key.startswith(keys.OPTIM) and key != keys.PARAM_GROUPS:
            name, _, sub = key[len(keys.OPTIM):].rpartition("/")
            out.setdefault(name, []).append((keys.OPTIM, f"/{sub}", value))
    return out


def moe_stage0_files(
    full: Mapping[str, Any], states: dict[str, Any], layers: Sequence[MoELayerRecord], ep_size: int,
    staging: Path, *, rank_optimizer: Callable[[dict[str, torch.Tensor], dict[str, Any]], dict[str, Any]],
    model_states_file: str,
) -> None:
    """Write DeepSpeed's stage-0 MoE files of ``full`` (``read_full_checkpoint``'s dict) into
    ``staging``; ``states`` is the main file's dict without ``module`` and ``optimizer`` yet.
    ``rank_optimizer(module, optimizer)`` is the stage-0 exporter's writer of one optimizer entry
    (given one expert-parallel rank's parameters under their local names), ``model_states_file`` its
    main file's name.

    Raises:
        ValueError: an expert count ``ep_size`` does not divide.
    """
    for record in layers:
        if record.num_experts % ep_size:
            raise ValueError(f"--ep-size {ep_size}: the MoE layer {record.module_path!r} has {record.num_experts} "
                             "experts; rule: ep_size divides every layer's expert count; fix: choose a divisor")
    module, optimizer = full["module"], full["optimizer"]
    main, files = split_experts(module, layers)
    add_router_aliases(main, layers)
    params = [n for n in module if n not in set(full["buffer_names"])]
    shapes = {n: module[n].shape for n in params}
    entries = _entries_by_name(optimizer)
    per_rank = []
    for ep_rank in range(ep_size):  # each rank's parameters under its own (local) names, then the stage-0 writer
        view_module: dict[str, torch.Tensor] = {}
        view_optimizer: dict[str, Any] = {}
        view_groups = []
        for group, members, is_moe in _rank_groups(optimizer[keys.PARAM_GROUPS], params, layers, ep_size,
                                                   ep_rank, shapes):
            hyper = {k: v for k, v in group.items() if k not in ("params", keys.PARAM_NAMES)}
            if is_moe:
                hyper.update(name=f"ep_size_{ep_size}", moe=True)
            view_groups.append({**hyper, keys.PARAM_NAMES: [local for local, _, _ in members]})
            for local, global_name, rows in members:
                whole = module[global_name]
                view_module[local] = _rows_of(whole, whole, rows)
                for prefix, sub, value in entries.get(global_name, []):
                    view_optimizer[f"{prefix}{local}{sub}"] = _rows_of(value, whole, rows)
        view_optimizer[keys.PARAM_GROUPS] = view_groups
        per_rank.append(rank_optimizer(view_module, view_optimizer))
    for (layer_id, expert), tensors in files.items():
        torch.save(tensors, Path(expert_ckpt_name(staging.parent, layer_id, expert, staging.name)))
    for ep_rank, inner in enumerate(per_rank):
        torch.save({"optimizer": inner}, Path(optim_ckpt_name(staging.parent, staging.name, ep_rank)))
    states.update(
        module=collections.OrderedDict(main),
        optimizer=per_rank[0],
        num_experts=[r.num_experts for r in layers],
        ds_autoep_layers=autoep_metadata(layers, ep_size),
        param_shapes=None,
        frozen_param_shapes=None,
        shared_params=None,
    )
    torch.save(states, staging / model_states_file)
