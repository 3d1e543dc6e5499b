"""Write DeepSpeed's universal checkpoint layout from a shardwise checkpoint (``to-universal``).

The output is what DeepSpeed 0.19.8's ``load_checkpoint`` reads with
``"checkpoint": {"load_universal": true}`` (layout in
:mod:`~shardwise.checkpoint.universal_names`): its ZeRO-1/2 and bf16 loaders read
``mp_rank_00_model_states.pt``, ``zero/optimizer_state.pt`` and every ``zero/<param>/<state>.pt``;
its ZeRO-3 loader reads ``zero_pp_rank_0_mp_rank_00_model_states.pt`` (parameters as empty
tensors, as DeepSpeed's own ZeRO-3 files hold them) and the step in
``optimizer_state.pt``'s ``optimizer_state_dict``. Every element-wise optimizer state is written,
whatever the optimizer (``exp_avg``/``exp_avg_sq`` for Adam, ``momentum_buffer`` for SGD or
Muon...); other non-step values go to ``optimizer_state.pt`` under ``shardwise_scalar_state``.

Only plain Python values, ``OrderedDict``, ``torch.Size`` and tensors are pickled, so every file
loads with ``torch.load(weights_only=True)`` and with DeepSpeed's loader. Not written (DeepSpeed's
loader keeps its own): DeepSpeed's ``loss_scaler`` object (shardwise's scaler state is under
``shardwise_loss_scaler``).

The directory is written into ``.<tag>.partial`` and renamed when complete; ``latest_universal``
moves last.

Example:
    >>> # shardwise checkpoint to-universal ckpts/ universal/
    >>> # shardwise_to_universal("ckpts", "universal")   # -> Path("universal/global_step10")
"""

from __future__ import annotations

import collections
import os
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from shardwise.checkpoint import integrity, keys, layout
from shardwise.checkpoint import universal_names as names
from shardwise.checkpoint.dcp_io import StreamingReader


def _step_value(value: Any) -> Any:
    """A step as DeepSpeed writes it: an int where it is whole, else a float."""
    if torch.is_tensor(value):
        value = value.item()
    if isinstance(value, float) and value.is_integer():
        return int(value)
    return value


def write_universal(
    out_dir: str | os.PathLike[str],
    tag: str,
    *,
    module: Mapping[str, torch.Tensor],
    optimizer: Mapping[str, Any],
    counters: Mapping[str, int],
    ds_config: Mapping[str, Any],
    lr_scheduler: Any = None,
    loss_scaler: Any = None,
    client_state: Mapping[str, Any] | None = None,
    zero_stage: int = 0,
    dp_world_size: int = 1,
    frozen: Mapping[str, tuple[int, ...]] | None = None,
    buffer_names: list[str] | None = None,
) -> Path:
    """Write one universal checkpoint ``out_dir/<tag>`` and point ``latest_universal`` at it.

    Args:
        module: the module's state dict, whole tensors (the training dtype).
        optimizer: ``OptimizerState.full_state_dict`` form: ``master/<name>`` (or the fp32 module
            entry), ``optim/<name>/<key>`` and ``optim/param_groups`` (with each group's names).
        counters: ``global_steps``, ``skipped_steps``, ``global_samples``.
        ds_config: the run's config (``gradient_clipping`` becomes ``clip_grad``).
        lr_scheduler, loss_scaler, client_state: saved as they are (client keys at the top level
            of the model states, as DeepSpeed saves them).
        zero_stage, dp_world_size: the writer's layout, for the record.
        frozen: ``name -> shape`` of frozen parameters.
        buffer_names: the module's buffers.

    Returns:
        The tag directory.

    Raises:
        ValueError: no param groups, or a parameter without an fp32 value.
    """
    groups = optimizer.get(keys.PARAM_GROUPS)
    if not groups:
        raise ValueError(
            "the optimizer state has no param groups; a universal checkpoint needs the optimizer's"
        )
    root = Path(out_dir)
    tag = layout.check_tag(tag)
    staging = layout.prepare_staging(root, tag)
    zero = staging / names.ZERO_DIR
    param_shapes = []
    scalars: dict[str, dict[str, Any]] = {}
    ds_groups = []
    first_step: Any = None
    index = 0
    for group in groups:
        members = list(group[keys.PARAM_NAMES])
        shapes = collections.OrderedDict()
        for name in members:
            master = optimizer.get(keys.master_key(name))
            if master is None:
                master = module.get(name)
            if master is None:
                raise ValueError(
                    f"no fp32 value for the trainable parameter {name!r} (neither master/ nor module)"
                )
            shapes[name] = torch.Size(master.shape)
            folder = zero / name
            folder.mkdir(parents=True, exist_ok=True)
            torch.save(
                {names.PARAM: master.detach().float().contiguous(), names.CAT_DIM: 0}, folder / "fp32.pt"
            )
            prefix = f"{keys.OPTIM}{name}/"
            for key, value in optimizer.items():
                if not key.startswith(prefix) or key == keys.PARAM_GROUPS:
                    continue
                state_key = key[len(prefix) :]
                if state_key == names.STEP:
                    step = _step_value(value)
                    first_step = step if first_step is None else first_step
                    torch.save(step, folder / "step.pt")
                elif torch.is_tensor(value) and value.numel() == master.numel() and value.dim() > 0:
                    tensor = value.detach().reshape(master.shape).contiguous()
                    torch.save({names.PARAM: tensor, names.CAT_DIM: 0}, folder / f"{state_key}.pt")
                else:
                    scalars.setdefault(name, {})[state_key] = value
        param_shapes.append(shapes)
        hyper = {k: v for k, v in group.items() if k not in ("params", keys.PARAM_NAMES)}
        ds_groups.append({**hyper, "params": list(range(index, index + len(members)))})
        index += len(members)
    for name in frozen or {}:
        if name in module:  # DeepSpeed's conversion also writes every other module weight's fp32 value
            (zero / name).mkdir(parents=True, exist_ok=True)
            torch.save(
                {names.PARAM: module[name].detach().float().contiguous(), names.CAT_DIM: 0},
                zero / name / "fp32.pt",
            )
    clip = float(ds_config.get("gradient_clipping", 0.0) or 0.0)
    optim_state: dict[str, Any] = {
        "dynamic_loss_scale": bool(isinstance(loss_scaler, dict) and loss_scaler.get("kind") == "dynamic"),
        "overflow": False,
        "clip_grad": clip,
        "zero_stage": zero_stage,
        "partition_count": [dp_world_size] * len(ds_groups),
        "ds_version": names.DS_VERSION,
        "param_groups": ds_groups,
        # DeepSpeed's ZeRO-3 universal loader reads the step and hyperparameters from here
        "optimizer_state_dict": {
            "state": {0: {names.STEP: first_step if first_step is not None else 0}},
            "param_groups": ds_groups,
        },
    }
    if scalars:
        optim_state[names.SCALAR_STATE] = scalars
    if loss_scaler is not None:
        optim_state[names.LOSS_SCALER] = loss_scaler
    torch.save(optim_state, zero / names.OPTIMIZER_STATE_FILE)
    model_states = _model_states(
        module,
        param_shapes,
        frozen or {},
        counters,
        ds_config,
        lr_scheduler,
        client_state,
        dp_world_size,
        buffer_names or [],
    )
    torch.save(model_states, staging / names.MODEL_STATES_FILE)
    trainable = {n for shapes in param_shapes for n in shapes} | set(frozen or {})
    stage3 = dict(model_states)
    stage3["module"] = collections.OrderedDict(
        (k, torch.empty(0, dtype=v.dtype) if k in trainable else v) for k, v in model_states["module"].items()
    )
    torch.save(stage3, staging / names.STAGE3_MODEL_STATES_FILE)
    final = layout.publish(root, tag)
    layout.write_latest(root, tag, layout.LATEST_UNIVERSAL)
    return final


def _model_states(
    module: Mapping[str, torch.Tensor],
    param_shapes: list[collections.OrderedDict[str, torch.Size]],
    frozen: Mapping[str, tuple[int, ...]],
    counters: Mapping[str, int],
    ds_config: Mapping[str, Any],
    lr_scheduler: Any,
    client_state: Mapping[str, Any] | None,
    dp_world_size: int,
    buffer_names: list[str],
) -> dict[str, Any]:
    """The ``*_model_states.pt`` dict, with the keys DeepSpeed's loader and ``ds_to_universal`` write."""
    from shardwise import __version__

    steps = int(counters.get("global_steps", 0))
    states: dict[str, Any] = dict(client_state or {})
    states.update(
        {
            "module": collections.OrderedDict((k, v.detach().contiguous()) for k, v in module.items()),
            "buffer_names": list(buffer_names),
            "optimizer": None,
            "param_shapes": param_shapes,
            "frozen_param_shapes": collections.OrderedDict((k, torch.Size(v)) for k, v in frozen.items()),
            "shared_params": {},
            "frozen_param_fragments": None,
            "lr_scheduler": lr_scheduler,
            "data_sampler": None,
            "random_ltd": None,
            "skipped_steps": int(counters.get("skipped_steps", 0)),
            "global_steps": steps,
            "global_samples": int(
                counters.get("global_samples", steps * int(ds_config.get("train_batch_size", 1)))
            ),
            "dp_world_size": dp_world_size,
            "mp_world_size": 1,
            "checkpoint_parallel_dimensions": {"pp_degree": 1, "tp_degree": 1},
            "ds_config": dict(ds_config),
            "ds_version": names.DS_VERSION,
            # the client's own description (Megatron's vocabulary sizes and parameter patterns) is kept;
            # the version is this layout's
            names.UNIVERSAL_INFO: {
                **dict(states.get(names.UNIVERSAL_INFO) or {}),
                names.UNIVERSAL_VERSION_KEY: names.UNIVERSAL_VERSION,
            },
            "shardwise_version": __version__,
        }
    )
    return states


def shardwise_to_universal(
    checkpoint: str | os.PathLike[str],
    out_dir: str | os.PathLike[str],
    *,
    tag: str | None = None,
    out_tag: str | None = None,
) -> Path:
    """Convert a shardwise checkpoint (any stage, any world size) to DeepSpeed's universal layout.

    A native DeepSpeed 0.19.8 checkpoint converts too, including what DeepSpeed's own
    ``ds_to_universal`` refuses: stage 0 (no ZeRO files) and optimizers other than Adam.

    Args:
        checkpoint: a save directory (its ``latest`` tag) or a tag directory.
        out_dir: where ``<tag>/`` and ``latest_universal`` are written.
        tag: the tag to convert instead of ``latest``.
        out_tag: the output tag (default: the converted tag's name).

    Raises:
        CheckpointIntegrityError: the checkpoint is damaged (checked before anything is written).
        ValueError: not a shardwise checkpoint, tensor-parallel shards, or no optimizer state.

    Example:
        >>> # shardwise_to_universal("ckpts", "universal")
    """
    tag_dir = layout.resolve(checkpoint, tag)
    kind = layout.detect_kind(tag_dir)
    if kind == "deepspeed":
        integrity.require_intact(tag_dir)
        return _deepspeed_to_universal(tag_dir, out_dir, out_tag or tag_dir.name)
    if kind != "shardwise":
        raise ValueError(
            f"{tag_dir} is a {kind} checkpoint; to-universal converts shardwise and native DeepSpeed checkpoints"
        )
    full = read_full_checkpoint(tag_dir)
    common = full["common"]
    module, optimizer, frozen, summary = full["module"], full["optimizer"], full["frozen"], full["summary"]
    return write_universal(
        out_dir,
        out_tag or str(common.get("tag") or tag_dir.name),
        module=module,
        optimizer=optimizer,
        counters=common.get("counters", {}),
        ds_config=common.get("ds_config") or {},
        lr_scheduler=common.get("lr_scheduler"),
        loss_scaler=common.get("loss_scaler"),
        client_state=common.get("client_state"),
        zero_stage=int(summary.get("zero_stage", 0)),
        dp_world_size=int(summary.get("dp_world_size", 1)),
        frozen=frozen,
        buffer_names=full["buffer_names"],
    )


def read_full_checkpoint(tag_dir: Path) -> dict[str, Any]:
    """A shardwise tag directory, whole: ``module``, ``optimizer`` (``full_state_dict`` form),
    ``common``, ``summary``, ``frozen`` (name -> shape) and ``buffer_names``.

    Raises:
        CheckpointIntegrityError: the checkpoint is damaged.
        ValueError: tensor-parallel shards, or no optimizer state.
    """
    integrity.require_intact(tag_dir)
    summary = layout.read_summary(tag_dir)
    if int(summary.get("mp_world_size", 1)) > 1:
        raise ValueError(f"{tag_dir} holds tensor-parallel shards (mp size > 1); only mp size 1 is converted")
    reader = StreamingReader(tag_dir)
    entries = reader.entries
    if keys.PARAM_GROUPS not in entries:
        raise ValueError(
            f"{tag_dir} has no optimizer state (saved without an optimizer); nothing to resume from"
        )
    groups = reader.read(keys.PARAM_GROUPS)
    common = reader.read(keys.COMMON)
    saved = [k[len(keys.MODEL) :] for k in entries if k.startswith(keys.MODEL)]
    # module_keys is the publishing rank's; under expert parallelism the other ranks' experts follow
    order = list(dict.fromkeys([*(summary.get("module_keys") or []), *saved]))
    module = {name: reader.read(keys.model_key(name)) for name in order if keys.model_key(name) in entries}
    groups = _with_every_expert(groups, list(module))
    optimizer: dict[str, Any] = {keys.PARAM_GROUPS: groups}
    for key in entries:
        if key.startswith(keys.MASTER) or (key.startswith(keys.OPTIM) and key != keys.PARAM_GROUPS):
            optimizer[key] = reader.read(key)
    trainable = {n for g in groups for n in g[keys.PARAM_NAMES]}
    frozen = {
        n: tuple(module[n].shape) for n in summary.get("frozen", []) if n in module and n not in trainable
    }
    params = trainable | set(frozen) | set(summary.get("aliases", {}))
    return {
        "module": module,
        "optimizer": optimizer,
        "common": common,
        "summary": summary,
        "frozen": frozen,
        "buffer_names": [n for n in module if n not in params],
    }


_EXPERT_INDEX = re.compile(r"(^|\.)deepspeed_moe\.experts\.deepspeed_experts\.\d+\.")


def _expert_pattern(name: str) -> str:
    return _EXPERT_INDEX.sub(r"\g<1>deepspeed_moe.experts.deepspeed_experts.*.", name, count=1)


def _with_every_expert(groups: list[dict[str, Any]], module_names: list[str]) -> list[dict[str, Any]]:
    """The saved param groups (one rank's: under expert parallelism they name only its experts)
    with every other rank's copies of those expert tensors added, in module order."""
    out = []
    for group in groups:
        patterns = {_expert_pattern(n) for n in group[keys.PARAM_NAMES] if _EXPERT_INDEX.search(n)}
        if not patterns:
            out.append(group)
            continue
        members = set(group[keys.PARAM_NAMES])
        dense = [n for n in group[keys.PARAM_NAMES] if not _EXPERT_INDEX.search(n)]
        experts = [n for n in module_names if n in members or _expert_pattern(n) in patterns]
        out.append({**group, keys.PARAM_NAMES: dense + [n for n in experts if _EXPERT_INDEX.search(n)]})
    return out


def _deepspeed_to_universal(tag_dir: Path, out_dir: str | os.PathLike[str], out_tag: str) -> Path:
    """A native DeepSpeed checkpoint (stages 0-3, read by the importer) to the universal layout."""
    from shardwise.checkpoint.deepspeed_import import DeepSpeedCheckpoint

    ckpt = DeepSpeedCheckpoint(tag_dir)
    module = ckpt.module_state_dict()
    params = [n for n in module if n not in ckpt.buffer_names]
    optimizer = ckpt.optimizer_state(params)
    if optimizer is None:
        raise ValueError(
            f"{tag_dir}: the optimizer state is not readable (see the warning); nothing to convert"
        )
    trainable = {n for g in optimizer[keys.PARAM_GROUPS] for n in g[keys.PARAM_NAMES]}
    frozen = {n: tuple(module[n].shape) for n in params if n not in trainable}
    excluded = {"module", "optimizer", "lr_scheduler", "param_shapes", "frozen_param_shapes", "buffer_names"}
    return write_universal(
        out_dir,
        out_tag,
        module=module,
        optimizer=optimizer,
        counters=ckpt.counters(),
        ds_config=ckpt.model.get("ds_config") or {},
        lr_scheduler=ckpt.model.get("lr_scheduler"),
        client_state={k: v for k, v in ckpt.model.items() if k not in excluded and not _is_foreign(v)},
        zero_stage=ckpt.stage,
        dp_world_size=ckpt.world_size,
        frozen=frozen,
        buffer_names=list(ckpt.buffer_names),
    )


def _is_foreign(value: Any) -> bool:
    """A DeepSpeed object read as a stand-in: not written back (it would need DeepSpeed to unpickle)."""
    from shardwise.checkpoint.deepspeed_import import ForeignObject

    return isinstance(value, ForeignObject)
