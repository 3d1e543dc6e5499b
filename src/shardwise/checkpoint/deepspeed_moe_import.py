"""Reading a DeepSpeed checkpoint of a model with MoE layers: its per-expert files and, at ZeRO
stage 0, its per-expert-parallel-rank optimizer files (layout: :mod:`~shardwise.checkpoint.deepspeed_moe`).

The importer (:class:`~shardwise.checkpoint.deepspeed_import.DeepSpeedCheckpoint`) merges the expert
files into the main file's module state under shardwise's names (experts by global index, AutoEP's
stacked), so every later step reads one whole state dict. The stage-0 optimizer state of expert-parallel
rank ``R`` names its parameters by position: DeepSpeed's groups hold the dense parameters, then the
rank's own experts (local indices ``0 .. L-1`` = global ``R * L ..``) in module order;
:func:`moe_stage0_optimizer` names them back and joins the ranks.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
from torch import nn

from shardwise.checkpoint import keys
from shardwise.checkpoint.deepspeed_moe import (
    AUTOEP_WEIGHTS,
    MOE_EXPERTS,
    MoELayerRecord,
    drop_router_aliases,
    expert_files,
    layers_from_deepspeed,
    merge_expert_files,
)
from shardwise.moe.naming import global_expert_names, held_elsewhere
from shardwise.utils.logging import logger

_OPTIM_FILE = re.compile(r"^expp_rank_(\d+)_mp_rank_00_optim_states\.pt$")


class DeepSpeedMoEFiles:
    """A DeepSpeed tag directory's MoE files: the layers, their experts and the optimizer files."""

    def __init__(self, tag_dir: Path, model_states: Mapping[str, Any], load: Any) -> None:
        self.tag_dir, self._load = Path(tag_dir), load
        self.files = {where: load(path) for where, path in sorted(expert_files(self.tag_dir, load).items())}
        self.layers: list[MoELayerRecord] = layers_from_deepspeed(model_states, self.files)
        optim = {int(m.group(1)): p for p in self.tag_dir.glob("expp_rank_*_optim_states.pt")
                 if (m := _OPTIM_FILE.match(p.name))}
        self.optim_files = [optim[r] for r in sorted(optim)]

    @classmethod
    def open(cls, tag_dir: Path, model_states: Mapping[str, Any], load: Any) -> DeepSpeedMoEFiles | None:
        """The MoE files of ``tag_dir``, or None when the checkpoint has no MoE layers."""
        if not isinstance(model_states.get("num_experts"), list) or not expert_files(Path(tag_dir), load):
            return None
        return cls(tag_dir, model_states, load)

    def merged_module(self, module: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """The main file's module state with every expert added (shardwise's names)."""
        out = dict(module)
        merge_expert_files(out, self.files, self.layers)
        drop_router_aliases(out, self.layers)
        return out

    def _rank_names(self, dense: Sequence[str], ep_rank: int, ep_size: int) -> list[str]:
        """Expert parameter names of ``ep_rank``, global, in module order."""
        names = []
        for record in self.layers:
            if record.kind == "autoep":  # one stacked weight each (expert-parallel size 1 only)
                names += [f"{record.expert_prefix}{weight}" for weight in AUTOEP_WEIGHTS]
                continue
            local = record.num_experts // ep_size
            for expert in range(ep_rank * local, (ep_rank + 1) * local):
                names += [k for k in self.files[(record.layer_id, expert)] if MOE_EXPERTS in k]
        return names

    def stage0_optimizer(self, dense: Sequence[str], module: Mapping[str, torch.Tensor]) -> dict[str, Any] | None:
        """The torch optimizer state of every expert-parallel rank, by parameter name
        (``full_state_dict`` form, the fp32 ``module`` weights as masters); ``dense`` are the trainable
        non-expert names in module order.

        Raises:
            ValueError: a rank's groups do not hold its dense and expert parameters.
        """
        if not self.optim_files:
            return None
        ep_size = len(self.optim_files)
        if ep_size > 1 and any(r.kind == "autoep" for r in self.layers):
            logger.warning("%s: the stage-0 optimizer state of AutoEP layers saved with expert parallelism is not "
                           "imported (each rank holds rows of the stacked weights); only the weights are imported. "
                           "To keep it, convert with DeepSpeed's ds_to_universal and load with "
                           "checkpoint.load_universal", self.tag_dir)
            return None
        stacked = {f"{r.expert_prefix}{w}" for r in self.layers if r.kind == "autoep" for w in AUTOEP_WEIGHTS}
        dense = [n for n in dense if n not in stacked]
        out: dict[str, Any] = {}
        groups: list[dict[str, Any]] = []
        for ep_rank, path in enumerate(self.optim_files):
            inner = self._load(path)["optimizer"]
            flats = inner.get("fp32_groups_flat") if isinstance(inner, dict) else None
            masters = inner.get("fp32_groups") if isinstance(inner, dict) else None
            if flats is not None or masters is not None:  # DeepSpeed's fused / unfused 16-bit wrapper
                inner = inner["optimizer_state_dict"]
            if not isinstance(inner, dict) or "param_groups" not in inner:
                logger.warning("%s: this 16-bit optimizer wrapper around expert groups is not imported; only the "
                               "weights are imported", path)
                return None
            pools = {False: list(dense), True: self._rank_names(dense, ep_rank, ep_size)}
            for g, group in enumerate(inner["param_groups"]):
                pool = pools[bool(group.get("moe"))]
                count = len(group["params"]) if flats is None else _count_filling(pool, module, flats[g].numel())
                if count < 0 or count > len(pool):
                    raise ValueError(f"{path}: group {g} does not match the next "
                                     f"{'expert' if group.get('moe') else 'dense'} parameters ({len(pool)} left)")
                members, pool[:] = pool[:count], pool[count:]
                if flats is not None:
                    out.update(_split_flat_group(flats[g], inner["state"].get(group["params"][0], {}), members, module))
                else:
                    for position, (index, name) in enumerate(zip(group["params"], members)):
                        for key, value in inner["state"].get(index, {}).items():
                            out[f"{keys.OPTIM}{name}/{key}"] = value
                        if masters is not None:  # the unfused wrapper: one fp32 master per parameter
                            out[f"{keys.MASTER}{name}"] = masters[g][position].float().view(module[name].shape)
                hyper = {k: v for k, v in group.items() if k not in ("params", "name", "moe")}
                # an expert group joins the first group with its hyperparameters: shardwise's engine
                # keeps a client's group whole (its reducer tells expert parameters apart by themselves)
                home = next((h for h in groups if _hyper(h) == hyper), None)
                if home is None:
                    groups.append({**hyper, keys.PARAM_NAMES: list(members)})
                else:
                    home[keys.PARAM_NAMES] += [n for n in members if n not in home[keys.PARAM_NAMES]]
        out[keys.PARAM_GROUPS] = groups
        for group in groups:  # fp32 at stage 0: the weights are the masters
            for name in group[keys.PARAM_NAMES]:
                out.setdefault(f"{keys.MASTER}{name}", module[name].detach().float())
        return out


    # ------------------------------------------------------------------ ZeRO 1-2 expert groups
    def global_name(self, local_name: str, ep_rank: int, ep_size: int) -> str:
        """A rank's local expert tensor name as its global one (other names unchanged)."""
        for record in self.layers:
            head = record.expert_prefix
            if record.kind == "moe" and local_name.startswith(head):
                index, _, rest = local_name[len(head):].partition(".")
                return f"{head}{ep_rank * (record.num_experts // ep_size) + int(index)}.{rest}"
        return local_name

    def expert_group_ranks(self, world_size: int, partition_count: int) -> list[list[int]]:
        """Per expert-parallel rank ``R``, the ranks that partition its expert groups, in order:
        DeepSpeed's layout puts expert-parallel ranks side by side (``R, R + ep, R + 2 ep, ...``)."""
        ep_size = world_size // partition_count
        return [[r + ep_size * i for i in range(partition_count)] for r in range(ep_size)]

    def assemble_expert_group(self, per_rank: Sequence[Sequence[torch.Tensor]], group: int,
                              shapes: Mapping[str, Any], mappings: Sequence[Any], partition_count: int,
                              fragment: Any) -> dict[str, torch.Tensor]:
        """One ZeRO-1/2 expert group's flat partitions as whole tensors under global names: each
        expert-parallel rank's group is partitioned over its expert-data-parallel ranks only."""
        import math

        out: dict[str, torch.Tensor] = {}
        owners = self.expert_group_ranks(len(per_rank), partition_count)
        for ep_rank, ranks in enumerate(owners):
            pieces: dict[str, list[torch.Tensor]] = {name: [] for name in shapes}
            for r in ranks:
                for name, address in mappings[r][group].items():
                    start, numel = fragment(address)
                    pieces.setdefault(name, []).append(per_rank[r][group].reshape(-1)[start:start + numel])
            for name, shape in shapes.items():
                whole = torch.cat(pieces[name]) if pieces[name] else torch.empty(0)
                if whole.numel() != math.prod(shape):
                    raise ValueError(f"{self.tag_dir}: expert tensor {name} of expert-parallel rank {ep_rank} has "
                                     f"{whole.numel()} elements in the ZeRO partitions, its shape {tuple(shape)}")
                out[self.global_name(name, ep_rank, len(owners))] = whole.view(shape)
        return out


def _count_filling(pool: Sequence[str], module: Mapping[str, torch.Tensor], numel: int) -> int:
    """How many of ``pool``'s first parameters fill ``numel`` elements exactly (-1: none do)."""
    count = 0
    while numel > 0 and count < len(pool):
        numel -= module[pool[count]].numel()
        count += 1
    return count if numel == 0 else -1


def _split_flat_group(flat: torch.Tensor, state: Mapping[str, Any], members: Sequence[str],
                      module: Mapping[str, torch.Tensor]) -> dict[str, Any]:
    """One fused group's masters and state by parameter name: flat tensors cut back to back."""
    out: dict[str, Any] = {}
    offset = 0
    for name in members:
        shape, numel = module[name].shape, module[name].numel()
        out[f"{keys.MASTER}{name}"] = flat[offset:offset + numel].float().view(shape).clone()
        for key, value in state.items():
            whole = torch.is_tensor(value) and value.numel() == flat.numel() and key != "step"
            out[f"{keys.OPTIM}{name}/{key}"] = value[offset:offset + numel].view(shape).clone() if whole else value
        offset += numel
    return out


def _hyper(group: Mapping[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in group.items() if k != keys.PARAM_NAMES}


def local_expert_state(module: nn.Module, whole: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A whole state (experts by global index) as ``module`` names it under expert parallelism:
    this rank's experts under their local names, the other ranks' left out."""
    renames = global_expert_names(module)
    if not renames:
        return whole
    foreign = held_elsewhere(module)
    out = {k: v for k, v in whole.items() if not foreign(k)}
    for global_name in renames.values():
        out.pop(global_name, None)
    for local, global_name in renames.items():
        if global_name in whole:
            out[local] = whole[global_name]
    return out
