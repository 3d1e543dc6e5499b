"""Write a shardwise checkpoint as DeepSpeed's native ZeRO-stage-0 checkpoint (``to-deepspeed``).

DeepSpeed 0.19.8 cannot resume a universal checkpoint at stage 0 (with ``load_universal`` its
engine skips the module and hands its optimizer an empty entry), so a stage-0 DeepSpeed run
resumes only its own native layout, loaded without ``load_universal``:
``<out>/<tag>/mp_rank_00_model_states.pt`` and ``<out>/latest``. The file holds ``module`` (the
training dtype) and ``optimizer``:

* fp32: the torch optimizer's state dict: ``state`` keyed by the parameter's index over the
  groups, ``param_groups`` with ``params`` as those indices;
* bf16/fp16 with Adam-like optimizers: DeepSpeed's fused 16-bit wrapper: ``optimizer_state_dict``
  whose groups hold one flat fp32 parameter each (element-wise state flat too), the masters as
  ``fp32_groups_flat``, ``clip_grad`` and the loss-scale values;
* bf16/fp16 with Muon (a group with ``use_muon``) or ``"torch_adam": true`` (DeepSpeed then steps
  torch's Adam, not its fused one): DeepSpeed's unfused wrapper: per-parameter state and the masters
  as ``fp32_groups`` (one list per group).

DeepSpeed's Muon groups hold their matrices sorted by shape, largest first, so a ``use_muon``
group is written in that order. Adam-like groups get ``bias_correction`` and ``step`` (DeepSpeed's
FusedAdam reads both); every other saved group hyperparameter is kept. Steps are written as
shardwise counted them: DeepSpeed's fused wrapper counts one extra step at construction, and
:mod:`~shardwise.checkpoint.deepspeed_import` keeps that count on the way in, so the next update
uses the same bias correction on both sides. This is the inverse of that importer's stage-0 path.

Example:
    >>> # shardwise checkpoint to-deepspeed ckpts/ ds_ckpts/
    >>> # export_deepspeed_stage0("ckpts", "ds_ckpts")   # -> Path("ds_ckpts/global_step10")
"""

from __future__ import annotations

import collections
import math
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch

from shardwise.checkpoint import keys, layout
from shardwise.checkpoint import universal_names as names
from shardwise.checkpoint.deepspeed_moe_export import moe_stage0_files, saved_moe_layers

MODEL_STATES_FILE = "mp_rank_00_model_states.pt"
OPTIMIZER_STATE_DICT = "optimizer_state_dict"  # the 16-bit wrappers' inner optimizer state


def _int_step(value: Any) -> int | float:
    if torch.is_tensor(value):
        value = value.item()
    return int(value) if float(value).is_integer() else float(value)


def _group_members(group: Mapping[str, Any], module: Mapping[str, torch.Tensor]) -> list[str]:
    members = list(group[keys.PARAM_NAMES])
    if group.get("use_muon"):  # DeepSpeed's Muon orders its matrices by shape, largest first
        members = sorted(members, key=lambda n: tuple(module[n].shape), reverse=True)
    return members


def _ds_group(group: Mapping[str, Any], params: list[int]) -> dict[str, Any]:
    hyper = {k: v for k, v in group.items() if k not in ("params", keys.PARAM_NAMES)}
    if "betas" in hyper:  # DeepSpeed's FusedAdam reads both from every group
        hyper["betas"] = list(hyper["betas"])
        hyper.setdefault("bias_correction", True)
        hyper.setdefault("step", 0)
    return {**hyper, "params": params}


def _master(optimizer: Mapping[str, Any], module: Mapping[str, torch.Tensor], name: str) -> torch.Tensor:
    master = optimizer.get(keys.master_key(name))
    if master is None:
        master = module.get(name)
    if master is None:
        raise ValueError(f"no fp32 value for the trainable parameter {name!r} (neither master/ nor module)")
    return master.detach().float().reshape(module[name].shape).contiguous()


def _param_state(optimizer: Mapping[str, Any], name: str, shape: torch.Size) -> dict[str, Any]:
    """``name``'s optimizer state as torch keeps it: element-wise tensors in the parameter's shape."""
    prefix = f"{keys.OPTIM}{name}/"
    state: dict[str, Any] = {}
    for key, value in optimizer.items():
        if key.startswith(prefix):
            sub = key[len(prefix) :]
            if sub == names.STEP:
                value = _int_step(value)
            elif torch.is_tensor(value) and value.dim() > 0 and value.numel() == math.prod(shape):
                value = value.detach().reshape(shape).contiguous()
            state[sub] = value
    return state


def _flat_group_state(
    optimizer: Mapping[str, Any], members: Sequence[str], module: Mapping[str, torch.Tensor]
) -> dict[str, Any]:
    """One fused group's state: element-wise tensors concatenated flat, the largest step."""
    states = [_param_state(optimizer, n, module[n].shape) for n in members]
    out: dict[str, Any] = {}
    for key in dict.fromkeys(k for s in states for k in s):
        values = [s.get(key) for s in states]
        if key == names.STEP:
            out[key] = max(v for v in values if v is not None)
        elif all(
            torch.is_tensor(v) and v.numel() == math.prod(module[n].shape) for v, n in zip(values, members)
        ):
            out[key] = torch.cat([v.detach().float().reshape(-1) for v in values if v is not None])
        else:
            raise ValueError(
                f"optimizer state {key!r} is not element-wise for every parameter of the group {list(members)}; "
                "DeepSpeed's fused 16-bit optimizer keeps only flat state"
            )
    return out


def _loss_scale(loss_scaler: Any, ds_config: Mapping[str, Any]) -> dict[str, Any]:
    scaler = loss_scaler if isinstance(loss_scaler, dict) else {}
    dynamic = scaler.get("kind") == "dynamic"
    out: dict[str, Any] = {
        "dynamic_loss_scale": dynamic,
        "cur_scale": float(scaler.get("cur_scale", 1.0)),
        "cur_iter": int(scaler.get("cur_iter", 0)),
    }
    if dynamic:
        fp16 = ds_config.get("fp16") or {}
        out.update(
            last_overflow_iter=int(scaler.get("last_overflow_iter", -1)),
            scale_factor=2.0,
            scale_window=int(fp16.get("loss_scale_window", 1000)),
        )
    return out


def stage0_optimizer_state(
    module: Mapping[str, torch.Tensor],
    optimizer: Mapping[str, Any],
    *,
    ds_config: Mapping[str, Any],
    loss_scaler: Any = None,
) -> dict[str, Any]:
    """The ``optimizer`` entry of DeepSpeed's stage-0 model states (see the module docstring)."""
    groups = optimizer[keys.PARAM_GROUPS]
    trainable = [n for g in groups for n in g[keys.PARAM_NAMES]]
    sixteen = {module[n].dtype for n in trainable} & {torch.bfloat16, torch.float16}
    memberships = [_group_members(g, module) for g in groups]
    torch_adam = bool(((ds_config.get("optimizer") or {}).get("params") or {}).get("torch_adam"))
    if not sixteen or torch_adam or any(g.get("use_muon") for g in groups):
        state, ds_groups, index = {}, [], 0
        for group, members in zip(groups, memberships):
            for name in members:
                state[index] = _param_state(optimizer, name, module[name].shape)
                index += 1
            ds_groups.append(_ds_group(group, list(range(index - len(members), index))))
        inner = {"state": state, "param_groups": ds_groups}
        if not sixteen:  # fp32: the torch optimizer's own state dict
            return inner
        wrapper = _loss_scale(loss_scaler, ds_config)  # Muon: DeepSpeed's unfused 16-bit wrapper
        wrapper[OPTIMIZER_STATE_DICT] = inner
        wrapper["fp32_groups"] = [[_master(optimizer, module, n) for n in m] for m in memberships]
        return wrapper
    wrapper = _loss_scale(loss_scaler, ds_config)
    flat_state = {g: _flat_group_state(optimizer, m, module) for g, m in enumerate(memberships)}
    wrapper[OPTIMIZER_STATE_DICT] = {
        "state": flat_state,
        "param_groups": [_ds_group(group, [g]) for g, group in enumerate(groups)],
    }
    wrapper["fp32_groups_flat"] = [
        torch.cat([_master(optimizer, module, n).reshape(-1) for n in m]) for m in memberships
    ]
    wrapper["clip_grad"] = float(ds_config.get("gradient_clipping", 1.0))
    return wrapper


def export_deepspeed_stage0(
    checkpoint: str | os.PathLike[str],
    out_dir: str | os.PathLike[str],
    *,
    tag: str | None = None,
    out_tag: str | None = None,
    ep_size: int | None = None,
) -> Path:
    """Write a shardwise checkpoint (any stage, any world size) as DeepSpeed's native stage-0 one.

    DeepSpeed resumes it with ``load_checkpoint(out_dir)`` at ZeRO stage 0 and *without*
    ``"checkpoint": {"load_universal": true}``; shardwise's own importer reads it back too.

    Args:
        checkpoint: a shardwise save directory (its ``latest`` tag) or a tag directory.
        out_dir: where ``<tag>/mp_rank_00_model_states.pt`` and ``latest`` are written.
        tag: the tag to convert instead of ``latest``.
        out_tag: the output tag (default: the converted tag's name).
        ep_size: with ``deepspeed.moe`` layers, the expert-parallel size of the DeepSpeed run that
            resumes (one optimizer file per expert-parallel rank; default: the saved run's); the
            experts go to DeepSpeed's per-expert files (:mod:`~shardwise.checkpoint.deepspeed_moe_export`).

    Raises:
        CheckpointIntegrityError: the checkpoint is damaged (checked before anything is written).
        ValueError: not a shardwise checkpoint, tensor-parallel shards, no optimizer state, or
            16-bit state DeepSpeed's fused wrapper cannot hold.

    Example:
        >>> # export_deepspeed_stage0("ckpts", "ds_ckpts")
    """
    from shardwise.checkpoint.universal_write import _model_states, read_full_checkpoint

    tag_dir = layout.resolve(checkpoint, tag)
    kind = layout.detect_kind(tag_dir)
    if kind != "shardwise":
        raise ValueError(f"{tag_dir} is a {kind} checkpoint; to-deepspeed converts shardwise checkpoints")
    full = read_full_checkpoint(tag_dir)
    common, module = full["common"], full["module"]
    ds_config = dict(common.get("ds_config") or {})
    ds_config["zero_optimization"] = {**(ds_config.get("zero_optimization") or {}), "stage": 0}
    states = _model_states(
        module,
        [],
        {},
        common.get("counters", {}),
        ds_config,
        common.get("lr_scheduler"),
        common.get("client_state"),
        int(full["summary"].get("dp_world_size", 1)),
        full["buffer_names"],
    )
    states.pop(names.UNIVERSAL_INFO, None)
    out_tag = layout.check_tag(out_tag or str(common.get("tag") or tag_dir.name))
    root = Path(out_dir)
    moe = saved_moe_layers(full["summary"], module)
    if moe:
        target = ep_size or max(r.ep_size for r in moe)
        staging = layout.prepare_staging(root, out_tag)
        def rank_optimizer(view_module: dict[str, torch.Tensor], view_optimizer: dict[str, Any]) -> dict[str, Any]:
            return stage0_optimizer_state(view_module, view_optimizer, ds_config=ds_config,
                                          loss_scaler=common.get("loss_scaler"))

        moe_stage0_files(full, states, moe, target, staging, rank_optimizer=rank_optimizer,
                         model_states_file=MODEL_STATES_FILE)
        final = layout.publish(root, out_tag)
        layout.write_latest(root, out_tag)
        return final
    if ep_size not in (None, 1):
        raise ValueError(f"ep_size={ep_size}: {tag_dir} has no MoE layers; fix: leave ep_size out")
    states.update(
        optimizer=stage0_optimizer_state(
            module, full["optimizer"], ds_config=ds_config, loss_scaler=common.get("loss_scaler")
        ),
        param_shapes=None,
        frozen_param_shapes=None,
        shared_params=None,
    )
    states["module"] = collections.OrderedDict(states["module"])
    staging = layout.prepare_staging(root, out_tag)
    torch.save(states, staging / MODEL_STATES_FILE)
    final = layout.publish(root, out_tag)
    layout.write_latest(root, out_tag)
    return final
