"""DeepSpeed's engine checkpoint methods, as functions of the engine.

``ShardwiseEngine.save_checkpoint`` / ``load_checkpoint`` / ``save_16bit_model`` /
``wait_for_checkpoint`` *are* these functions (bound as methods), so the engine stays free
of checkpoint logic. Each call builds a :class:`~shardwise.checkpoint.checkpointer.TrainingState`
from the engine's parts (its counters, step hooks and the rest, each ``Stateful``) and hands it
to ``engine.checkpointer``, which ``initialize`` built with :func:`build_checkpointer` (one per
engine, so an asynchronous save can be waited for).
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Mapping
from pathlib import Path
from typing import Any, Protocol

import torch
from torch import nn

from shardwise import comm
from shardwise.autoep.layer import AutoEPMoELayer
from shardwise.checkpoint import folded_files
from shardwise.checkpoint.checkpointer import Checkpointer, CheckpointOptions, TrainingState
from shardwise.checkpoint.module_state import copy_whole_state
from shardwise.checkpoint.optimizer_state import OptimizerState
from shardwise.checkpoint.param_state import ParamOptimizerState
from shardwise.checkpoint.tp_whole import tp_slices
from shardwise.checkpoint.training_state import Restore, Stateful, StatePart
from shardwise.comm.diagnostics import check_all_ranks_arrive
from shardwise.comm.fsdp_internals import full_tensor
from shardwise.comm.topology import Topology
from shardwise.config.resolve import ResolvedConfig
from shardwise.config.sections.features import CheckpointConfig
from shardwise.moe.naming import global_expert_names
from shardwise.precision.policy import PrecisionPolicy
from shardwise.runtime.counters import EngineCounters
from shardwise.runtime.step_hooks import StepHooks
from shardwise.utils.logging import logger
from shardwise.zero.strategy import ZeroStrategy


class CheckpointedEngine(Protocol):
    """What these functions read from an engine (``ShardwiseEngine`` provides it)."""

    module: nn.Module
    counters: EngineCounters
    step_hooks: StepHooks
    checkpointer: Checkpointer
    lr_scheduler: object  # the client's or the config's scheduler: anything Stateful, or None
    training_dataloader: object  # the engine's loader (Stateful when it is shardwise's), or None

    @property
    def topology(self) -> Topology:
        """The process layout."""
        ...

    @property
    def precision(self) -> PrecisionPolicy:
        """The precision policy (its loss scaler and compute dtype)."""
        ...

    @property
    def optimizer(self) -> ZeroStrategy | torch.optim.Optimizer | None:
        """The ZeRO strategy (or a plain torch optimizer, or None)."""
        ...

    @property
    def config(self) -> ResolvedConfig:
        """The resolved config."""
        ...

    @property
    def global_steps(self) -> int:
        """Optimizer steps taken."""
        ...

    @property
    def pending_micro_batches(self) -> int:
        """Micro batches accumulated since the last optimizer step."""
        ...

    def zero_optimization_stage(self) -> int:
        """The ZeRO stage."""
        ...

    def gradient_accumulation_steps(self) -> int:
        """Micro batches per optimizer step."""
        ...

    def train_batch_size(self) -> int:
        """Samples per optimizer step over all data-parallel ranks."""
        ...

    def module_state_dict(self, exclude_frozen_parameters: bool = False) -> dict[str, Any]:
        """The module's state dict."""
        ...


def build_checkpointer(section: CheckpointConfig) -> Checkpointer:
    """The checkpointer for the config's ``checkpoint`` section (``initialize`` gives it to the engine).

    Example:
        >>> from shardwise.config import load_config
        >>> build_checkpointer(load_config({"train_batch_size": 8}).config.checkpoint).options.async_save
        False
    """
    return Checkpointer(
        CheckpointOptions(
            tag_validation=section.tag_validation,
            use_node_local_storage=section.use_node_local_storage,
            load_universal=section.load_universal,
            async_save=section.async_save,
            deepspeed_moe_files=section.deepspeed_moe_files,
        )
    )


def optimizer_state(optimizer: object) -> OptimizerState | None:
    """The checkpoint interface of an engine's optimizer (None for none).

    A ZeRO strategy describes itself (``state_layout()``); a plain torch optimizer over the
    module's parameters is described by :func:`~shardwise.checkpoint.param_state.param_layout`.
    """
    if optimizer is None:
        return None
    if isinstance(optimizer, ZeroStrategy):
        return OptimizerState(optimizer.state_layout())
    if isinstance(optimizer, torch.optim.Optimizer):
        return ParamOptimizerState(optimizer)
    raise TypeError(
        f"cannot checkpoint an optimizer of type {type(optimizer).__name__}: it must describe its state "
        "(a shardwise.zero.strategy.ZeroStrategy, whose state_layout() returns a StateLayout) or be a "
        "torch.optim.Optimizer"
    )


def state_parts(engine: CheckpointedEngine) -> dict[str, StatePart]:
    """The engine's named Stateful parts (those it has), each with the loads that restore it."""
    candidates: dict[str, tuple[object, Restore, bool]] = {
        "counters": (engine.counters, Restore.ALWAYS, False),
        "lr_scheduler": (engine.lr_scheduler, Restore.WITH_SCHEDULER, False),
        "loss_scaler": (engine.precision.loss_scaler, Restore.WITH_OPTIMIZER, False),
        "step_hooks": (engine.step_hooks, Restore.ALWAYS, False),
        "data_loader": (engine.training_dataloader, Restore.ALWAYS, True),
    }
    return {
        name: StatePart(obj, restore, per_rank)
        for name, (obj, restore, per_rank) in candidates.items()
        if isinstance(obj, Stateful)
    }


def training_state(engine: CheckpointedEngine) -> TrainingState:
    """The parts of ``engine`` a checkpoint covers."""
    topology = engine.topology
    return TrainingState(
        module=engine.module,
        optimizer=optimizer_state(engine.optimizer),
        parts=state_parts(engine),
        zero_stage=engine.zero_optimization_stage(),
        dp_world_size=topology.dp_size,
        mp_rank=topology.mp_rank,
        mp_world_size=topology.mp_size,
        gradient_accumulation_steps=engine.gradient_accumulation_steps(),
        pending_micro_batches=engine.pending_micro_batches,
        ds_config=engine.config.to_ds_dict(),
        process_group=None,
        folding=folded_files.folded_run(topology),
    )


def save_checkpoint(
    engine: CheckpointedEngine,
    save_dir: str | Path,
    tag: Any = None,
    client_state: Mapping[str, Any] | None = None,
    save_latest: bool = True,
    exclude_frozen_parameters: bool = False,
) -> bool:
    """``engine.save_checkpoint``: every rank calls it; returns True.

    Writes ``save_dir/<tag>`` (default tag ``global_step{N}``) atomically and then moves
    ``save_dir/latest``. With ``"checkpoint": {"async_save": true}`` it returns once the state
    is copied and the files are written in the background (see :func:`wait_for_checkpoint`).

    Example:
        >>> # engine.save_checkpoint("ckpts", client_state={"epoch": 3})
    """
    # A save called on only some ranks would hang in its first collective: fail fast instead,
    # naming the ranks that did not come and where they are.
    check_all_ranks_arrive("save_checkpoint")
    engine.checkpointer.save(
        training_state(engine),
        save_dir,
        tag=tag,
        client_state=client_state,
        save_latest=save_latest,
        exclude_frozen_parameters=exclude_frozen_parameters,
    )
    return True


def load_checkpoint(
    engine: CheckpointedEngine,
    load_dir: str | Path,
    tag: object = None,
    load_module_strict: bool = True,
    load_optimizer_states: bool = True,
    load_lr_scheduler_states: bool = True,
    load_module_only: bool = False,
    custom_load_fn: Callable[..., object] | None = None,
) -> tuple[str | None, dict[str, Any] | None]:
    """``engine.load_checkpoint``: returns ``(path, client_state)``, or ``(None, None)`` without ``latest``.

    Loads a checkpoint saved at any world size and ZeRO stage, or one written by DeepSpeed.
    ``path`` is the tag directory. With ``zero_optimization.load_from_fp32_weights: false`` the
    fp32 masters are then re-read from the loaded (training-dtype) model weights.

    Example:
        >>> # path, client_state = engine.load_checkpoint("ckpts")
    """
    check_all_ranks_arrive("load_checkpoint")
    state = training_state(engine)
    result = engine.checkpointer.load(
        state,
        load_dir,
        tag=None if tag is None else str(tag),
        load_module_strict=load_module_strict,
        load_optimizer_states=load_optimizer_states,
        load_lr_scheduler_states=load_lr_scheduler_states,
        load_module_only=load_module_only,
        custom_load_fn=custom_load_fn,
    )
    if result is None:
        return None, None
    zero = engine.config.config.zero_optimization
    if not zero.load_from_fp32_weights and state.optimizer is not None and load_optimizer_states:
        # DeepSpeed's load_from_fp32_weights=false: the masters restart from the (16-bit) model
        # weights just loaded, not from the checkpoint's fp32 copy
        state.optimizer.refresh_masters_from_params()
    # the counters part was restored with the others; a checkpoint without global_samples
    # (DeepSpeed's older ones) derives it
    if "global_samples" not in result.counters and "global_steps" in result.counters:
        engine.counters.global_samples = engine.global_steps * engine.train_batch_size()
    return str(result.path), result.client_state


def wait_for_checkpoint(engine: CheckpointedEngine) -> None:
    """Block until the engine's asynchronous save (if any) is published; raises its error."""
    engine.checkpointer.wait()


def save_16bit_model(
    engine: CheckpointedEngine,
    save_dir: str | Path,
    save_filename: str = "pytorch_model.bin",
    exclude_frozen_parameters: bool = False,
) -> bool:
    """``engine.save_16bit_model``: the module's weights in their training dtype, one file.

    ``.safetensors`` file names write safetensors, anything else a ``torch.load``-able file;
    both are written tensor by tensor and atomically, by rank 0. At stage 3 the weights are
    gathered one at a time, in the compute dtype, when ``stage3_gather_16bit_weights_on_model_save`` is true;
    otherwise, instead of DeepSpeed's silent skip, a full sharded checkpoint is saved under
    ``save_dir`` and the log names the one command that exports it. Returns False then.

    Example:
        >>> # engine.save_16bit_model("export", "model.safetensors")
    """
    from shardwise.checkpoint.writers import write_state_dict

    _refuse_expert_parallel(engine, "save_16bit_model")
    state = engine.module_state_dict(exclude_frozen_parameters=exclude_frozen_parameters)
    sharded = engine.zero_optimization_stage() == 3
    if sharded and not engine.config.config.zero_optimization.stage3_gather_16bit_weights_on_model_save:
        save_checkpoint(engine, save_dir, exclude_frozen_parameters=exclude_frozen_parameters)
        wait_for_checkpoint(engine)
        logger.warning(
            "Did not save the 16-bit model %s: stage3_gather_16bit_weights_on_model_save is false. A sharded "
            "checkpoint was saved there instead; export it with: shardwise checkpoint export %s %s",
            Path(save_dir) / save_filename,
            save_dir,
            Path(save_dir) / save_filename,
        )
        return False
    rank0 = comm.get_rank() == 0
    slices = tp_slices(engine.module)  # tensor-parallel slices are gathered whole too
    # stage 3 keeps fp32 sharded parameters and computes in 16 bits: write the compute dtype
    compute = engine.precision.param_dtype if sharded else None

    def dtype_of(value: torch.Tensor) -> torch.dtype:
        return compute if compute is not None and value.is_floating_point() else value.dtype

    def tensors() -> Any:
        for key, value in state.items():
            full = slices.gathered(key, full_tensor(value))  # collective
            if rank0:
                yield key, full.detach().to(device="cpu", dtype=dtype_of(full))

    out = Path(save_dir) / save_filename
    if rank0:
        out.parent.mkdir(parents=True, exist_ok=True)
        shapes = {k: (slices.whole_shapes.get(k, tuple(v.shape)), dtype_of(v)) for k, v in state.items()}
        fmt = "safetensors" if save_filename.endswith(".safetensors") else "pt"
        write_state_dict(out, shapes, tensors(), fmt=fmt)
    else:
        for _ in tensors():  # take part in the gathers
            pass
    return True


def _refuse_expert_parallel(engine: CheckpointedEngine, what: str) -> None:
    """One file from rank 0 cannot hold an expert-parallel model: the other ranks' experts are not there."""
    autoep = any(isinstance(m, AutoEPMoELayer) and m.ep_size > 1 for m in engine.module.modules())
    if global_expert_names(engine.module) or autoep:
        raise ValueError(
            f"engine.{what} with expert parallelism (MoE layers with ep_size > 1 or AutoEP with autoep_size > "
            "1): rank 0 holds only its "
            "own experts; fix: engine.save_checkpoint(dir) (every expert by its global index), then "
            "`shardwise checkpoint export` or load it at ep_size=1"
        )


def gather_16bit_weights_on_model_save(engine: CheckpointedEngine) -> bool:
    """``engine.zero_gather_16bit_weights_on_model_save()``: the config's
    ``zero_optimization.stage3_gather_16bit_weights_on_model_save``."""
    return bool(engine.config.config.zero_optimization.stage3_gather_16bit_weights_on_model_save)


def consolidated_16bit_state_dict(
    engine: CheckpointedEngine, exclude_frozen_parameters: bool = False
) -> dict[str, Any]:
    """``engine._zero3_consolidated_16bit_state_dict()``: the full module state dict in the training
    dtype on rank 0 (CPU tensors), ``{}`` on the other ranks. Collective: every rank must call it
    (each sharded tensor is gathered in turn). At stages 0-2 the weights are already whole.
    """
    _refuse_expert_parallel(engine, "_zero3_consolidated_16bit_state_dict")
    state = engine.module_state_dict(exclude_frozen_parameters=exclude_frozen_parameters)
    compute = engine.precision.param_dtype if engine.zero_optimization_stage() == 3 else None
    rank0 = comm.get_rank() == 0
    slices = tp_slices(engine.module)  # tensor-parallel slices are gathered whole too
    out: dict[str, object] = {}
    for key, value in state.items():
        full = slices.gathered(key, full_tensor(value))  # collective
        if rank0:
            dtype = compute if compute is not None and full.is_floating_point() else full.dtype
            out[key] = full.detach().to(device="cpu", dtype=dtype).clone()
    return out


def load_module_state_dict(
    engine: CheckpointedEngine,
    checkpoint: dict[str, Any],
    strict: bool = True,
    custom_load_fn: Callable[..., Any] | None = None,
    fetch_z3_params: bool = False,
    z3_params_to_fetch: object = None,
    allowed_missing_keys: Collection[str] | None = None,
) -> None:
    """``engine.load_module_state_dict``: load ``checkpoint["module"]`` (whole tensors, e.g. from
    ``torch.load``) into the engine's module at any stage, then re-read the fp32 masters from it.

    At stage 3 each rank keeps its shard of every whole tensor (no communication: every rank must
    pass the same dict). ``custom_load_fn(src=state, dst=module)`` replaces the copy; at stage 3 it
    sees the sharded module, so ``fetch_z3_params=True`` or ``z3_params_to_fetch`` (DeepSpeed gathers
    those parameters for it first) is refused. ``allowed_missing_keys`` (DeepSpeed's AutoEP expert
    weights restored elsewhere) may be missing from a strict load; any other difference still fails.

    Raises:
        RuntimeError: ``strict`` and the keys differ (beyond ``allowed_missing_keys``), or a shape differs.
        NotImplementedError: ``custom_load_fn`` with parameters to gather at stage 3.
    """
    state = tp_slices(engine.module).localized(checkpoint["module"])  # whole tensors -> this rank's slices
    if strict and allowed_missing_keys is not None:
        _check_keys_beyond_allowed(engine.module, state, set(allowed_missing_keys))
        strict = False
    if custom_load_fn is not None:
        fetch_z3_params = fetch_z3_params or bool(z3_params_to_fetch)
        if fetch_z3_params and engine.zero_optimization_stage() == 3:
            raise NotImplementedError(
                "load_module_state_dict(custom_load_fn=..., fetch_z3_params=True): at stage 3 shardwise does "
                "not gather the parameters for a custom load function (FSDP2 keeps them sharded); load whole "
                "tensors without custom_load_fn, or pass fetch_z3_params=False and handle DTensor shards"
            )
        custom_load_fn(src=state, dst=engine.module)
    else:
        copy_whole_state(
            engine.module,
            state,
            strict=strict,
            source='checkpoint["module"]',
            fix="Pass strict=False to load the matching entries only.",
        )
    optimizer = optimizer_state(engine.optimizer)
    if optimizer is not None:
        optimizer.refresh_masters_from_params()


def _check_keys_beyond_allowed(module: nn.Module, state: Mapping[str, Any], allowed: set[str]) -> None:
    """A strict load that may miss ``allowed``: any other missing or unexpected key is an error."""
    targets = module.state_dict()
    missing = [k for k in targets if k not in state and k not in allowed]
    unexpected = [k for k in state if k not in targets]
    if missing or unexpected:
        raise RuntimeError(
            f"Error(s) in loading checkpoint['module']: keys outside AutoEP expert weights (allowed_missing_keys) "
            f"differ: missing keys {missing}, unexpected keys {unexpected}. Pass strict=False to load the "
            "matching entries only."
        )
