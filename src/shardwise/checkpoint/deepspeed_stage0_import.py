"""Stage 0 of a DeepSpeed checkpoint: the optimizer state saved in ``mp_rank_00_model_states.pt``.

At stage 0 DeepSpeed saves a plain torch optimizer's state dict, or its 16-bit wrapper around one
(bf16/fp16: fp32 masters as one flat tensor per group, or per parameter for Muon), keyed by
position. :func:`stage0_optimizer` names it back (:func:`stage0_group_names`: which parameters
each saved group holds) in ``OptimizerState.full_state_dict`` form. Read by
:class:`~shardwise.checkpoint.deepspeed_import.DeepSpeedCheckpoint`.

Example:
    >>> # full = stage0_optimizer(DeepSpeedCheckpoint(tag_dir), trainable_names)
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

import torch

from shardwise.checkpoint import keys
from shardwise.checkpoint.deepspeed_moe import MOE_EXPERTS
from shardwise.utils.logging import logger

if TYPE_CHECKING:
    from shardwise.checkpoint.deepspeed_import import DeepSpeedCheckpoint


def stage0_optimizer(ckpt: DeepSpeedCheckpoint, trainable_names: Sequence[str]) -> dict[str, Any] | None:
    """Stage 0: a plain torch optimizer's state dict, or DeepSpeed's 16-bit wrapper around one.

    The bf16/fp16 wrappers save ``optimizer_state_dict`` (the inner optimizer's) with the fp32
    masters either as one flat tensor per group (``fp32_groups_flat``: the fused wrapper, whose
    inner state is flat too) or per parameter (``fp32_groups``: the unfused wrapper, which
    DeepSpeed uses for Muon).
    """
    if ckpt.moe is not None and ckpt.moe.optim_files:
        trainable = set(trainable_names)
        module = ckpt.model["module"]
        return ckpt.moe.stage0_optimizer([n for n in module if n in trainable and MOE_EXPERTS not in n], module)
    saved = ckpt.model.get("optimizer")
    wrapper = saved if isinstance(saved, dict) and "optimizer_state_dict" in saved else None
    inner = wrapper["optimizer_state_dict"] if wrapper is not None else saved
    if not isinstance(inner, dict) or "state" not in inner or "param_groups" not in inner:
        logger.warning(
            "%s: the stage-0 optimizer state is neither a torch optimizer state dict nor DeepSpeed's "
            "16-bit wrapper around one; only the weights are imported",
            ckpt.tag_dir,
        )
        return None
    module = ckpt.model["module"]
    flat = wrapper.get("fp32_groups_flat") if wrapper is not None else None
    groups_names = stage0_group_names(
        ckpt, inner["param_groups"], trainable_names, None if flat is None else [t.numel() for t in flat]
    )
    if groups_names is None:
        return None
    out: dict[str, Any] = {}
    groups = []
    for g, (group, members) in enumerate(zip(inner["param_groups"], groups_names)):
        shapes = {n: tuple(module[n].shape) for n in members}
        if wrapper is not None and "fp32_groups_flat" in wrapper:  # one flat group, flat state
            out.update(_split_flat(wrapper["fp32_groups_flat"][g], shapes, "master/{}"))
            state = inner["state"].get(group["params"][0], {}) if group["params"] else {}
            for key, value in state.items():
                if torch.is_tensor(value) and value.numel() == wrapper["fp32_groups_flat"][g].numel():
                    out.update(_split_flat(value, shapes, f"optim/{{}}/{key}"))
                else:
                    out.update({f"optim/{n}/{key}": value for n in members})
        else:
            masters = (
                wrapper["fp32_groups"][g] if wrapper is not None and "fp32_groups" in wrapper else None
            )
            for position, (index, name) in enumerate(zip(group["params"], members)):
                master = masters[position] if masters is not None else module[name]
                out[f"master/{name}"] = master.detach().float().reshape(shapes[name])
                for key, value in inner["state"].get(index, {}).items():
                    if torch.is_tensor(value) and key != "step" and tuple(value.shape) != shapes[name]:
                        raise ValueError(
                            f"{ckpt.tag_dir}: optimizer state {key} of {name} has the wrong shape "
                            f"{tuple(value.shape)} (the parameter's is {shapes[name]})"
                        )
                    out[f"optim/{name}/{key}"] = value
            if "bias_correction" in group:
                _one_step_per_group(out, members)
        groups.append({**{k: v for k, v in group.items() if k != "params"}, keys.PARAM_NAMES: members})
    out[keys.PARAM_GROUPS] = groups
    return out

def stage0_group_names(
    ckpt: DeepSpeedCheckpoint,
    param_groups: Sequence[Mapping[str, Any]],
    trainable_names: Sequence[str],
    flat_numels: Sequence[int] | None = None,
) -> list[list[str]] | None:
    """The parameter names of each saved group, in the group's order.

    Groups take the trainable parameters in module order (a flat group, ``flat_numels``,
    as many as fill its size), except DeepSpeed's Muon halves
    (``use_muon`` in the group): a Muon group takes the next Muon matrices (DeepSpeed's rule)
    sorted by shape, largest first, as DeepSpeed's Muon optimizer reorders them; an Adam
    half takes the next other parameters.
    """
    from shardwise.optim.muon_groups import uses_muon

    module = ckpt.model["module"]
    params = [n for n in module if n not in ckpt.buffer_names]
    counts = [len(group["params"]) for group in param_groups]
    if flat_numels is not None:
        counts, position = [], 0
        for numel in flat_numels:
            start = position
            while position < len(trainable_names) and numel > 0:
                numel -= math.prod(module[trainable_names[position]].shape)
                position += 1
            counts.append(position - start if numel == 0 else -1)
        if min(counts, default=0) < 0:
            logger.warning(
                "%s: the flat fp32 groups do not add up to the trainable parameters; only the weights "
                "are imported",
                ckpt.tag_dir,
            )
            return None
    names = list(trainable_names) if sum(counts) == len(trainable_names) else params
    if sum(counts) != len(names):
        logger.warning(
            "%s: the optimizer has %d parameters, which matches neither the %d trainable nor all %d parameters; "
            "only the weights are imported",
            ckpt.tag_dir,
            sum(counts),
            len(trainable_names),
            len(params),
        )
        return None
    pools = {
        None: list(names),
        True: [n for n in names if uses_muon(n, tuple(module[n].shape))],
        False: [n for n in names if not uses_muon(n, tuple(module[n].shape))],
    }
    out = []
    for group, count in zip(param_groups, counts):
        kind = group.get("use_muon")
        pool = pools[None if kind is None else bool(kind)]
        members, pool[:] = pool[:count], pool[count:]
        if kind:
            members = sorted(members, key=lambda n: tuple(module[n].shape), reverse=True)
        out.append(members)
    return out


def _split_flat(
    flat: torch.Tensor, shapes: Mapping[str, tuple[int, ...]], key: str
) -> dict[str, torch.Tensor]:
    """Cut a flat tensor into the named shapes, back to back (``key`` formats each name)."""
    out, offset = {}, 0
    for name, shape in shapes.items():
        numel = math.prod(shape)
        out[key.format(name)] = flat.reshape(-1)[offset : offset + numel].float().view(shape).clone()
        offset += numel
    return out


def _one_step_per_group(state: dict[str, Any], members: Sequence[str]) -> None:
    """DeepSpeed's FusedAdam (its ``bias_correction`` group key) steps a whole group with one count,
    but advances only the last parameter's ``state['step']`` (the others keep their initial 0):
    the group's step is the largest, and every parameter gets it (torch's Adam keeps one each)."""
    found = [state[f"optim/{n}/step"] for n in members if f"optim/{n}/step" in state]
    if not found:
        return
    step = max(found, key=lambda v: float(v))
    for name in members:
        if f"optim/{name}/step" in state:
            state[f"optim/{name}/step"] = step.clone() if torch.is_tensor(step) else step
