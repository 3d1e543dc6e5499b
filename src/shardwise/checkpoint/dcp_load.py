"""Loading a shardwise (DCP) checkpoint into a :class:`~shardwise.checkpoint.training_state.TrainingState`
(:class:`DcpLoading`, a mixin of :class:`~shardwise.checkpoint.checkpointer.Checkpointer`), and where
an mpu's model-parallel ranks put their entries (:func:`_saved_mp_size`, :func:`_mp_prefix`, shared
with the save).

A load reads the summary, checks the model-parallel size, asks the optimizer for the entries it
restores (its fp32 values cover those parameters), checks the module's keys and shapes, reads the
entries with DCP (whole tensor-parallel tensors into this rank's slices), then restores counters,
scheduler, loss scaler, step hooks and, per rank, the optimizer's rank state and the RNG.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import nn

from shardwise import comm
from shardwise.checkpoint import dcp_io, keys, layout, rng
from shardwise.checkpoint.tp_whole import tp_slices
from shardwise.checkpoint.training_state import (
    LoadResult,
    TrainingState,
    checkpoint_name,
    module_state_dict,
    param_names,
    restore_parts,
)
from shardwise.moe.naming import held_elsewhere
from shardwise.utils.logging import logger

__all__ = ["DcpLoading"]


def _aliases(module: nn.Module, params: set[int]) -> set[str]:
    """Every checkpoint name of the given parameters, tied aliases included."""
    named = checkpoint_name(module)
    return {named(name) for name, p in module.named_parameters(remove_duplicate=False) if id(p) in params}


def _saved_mp_size(state: TrainingState) -> int:
    """The model-parallel size a checkpoint of ``state`` records: 1 for tensor-parallel layers
    (they save whole tensors), else the mpu's (its ranks' tensors are saved side by side)."""
    return 1 if tp_slices(state.module) else state.mp_world_size


def _mp_prefix(state: TrainingState) -> str:
    # An mpu's model-parallel ranks hold different tensors under the same names.
    return f"mp{state.mp_rank}/" if _saved_mp_size(state) > 1 else ""


class DcpLoading:
    """``_load_dcp`` for :class:`~shardwise.checkpoint.checkpointer.Checkpointer` (mixed in)."""

    def _load_dcp(
        self,
        state: TrainingState,
        path: Path,
        *,
        strict: bool,
        with_optimizer: bool,
        with_scheduler: bool,
        module_only: bool,
        custom_load_fn: Callable[..., object] | None,
    ) -> LoadResult:
        summary = layout.read_summary(path)
        prefix = _mp_prefix(state)
        slices = tp_slices(state.module)
        saved_mp = int(summary.get("mp_world_size", 1))
        if saved_mp != _saved_mp_size(state):
            raise ValueError(
                f"{path} was saved with model-parallel size {saved_mp} but this run has {_saved_mp_size(state)}; "
                "an mpu's model-parallel shards cannot be re-split on load (tensor_parallel.autotp_size runs save "
                "whole tensors and load at any degree)"
            )
        all_saved = dcp_io.saved_entries(dcp_io.read_metadata(path))
        saved = (
            {k[len(prefix) :]: v for k, v in all_saved.items() if k.startswith(prefix)}
            if prefix
            else all_saved
        )
        if slices:  # whole tensors saved: this rank's slices are what the layouts below expect
            saved = slices.local_entries(saved)
        names = param_names(state.module)
        targets: dict[str, Any] = {}
        finish: Callable[[dict[str, Any]], None] | None = None
        covered: set[str] = set()
        if state.optimizer is not None and not module_only:
            opt_targets, finish = state.optimizer.sharded_load(names, saved, with_state=with_optimizer)
            targets.update(opt_targets)
            # the optimizer restores these parameters from their fp32 values; the module must not
            filled = {k.split("/", 1)[1] for k in opt_targets if k.startswith((keys.MASTER, keys.MODEL))}
            covered = _aliases(state.module, {pid for pid, name in names.items() if name in filled})
        module_sd = module_state_dict(state.module)
        saved_model = {k[len(keys.MODEL) :]: v for k, v in saved.items() if k.startswith(keys.MODEL)}
        named = checkpoint_name(state.module)
        frozen = {named(n) for n, p in state.module.named_parameters(remove_duplicate=False) if not p.requires_grad}
        excluded = bool(summary.get("exclude_frozen_parameters", False))
        missing = [k for k in module_sd if k not in saved_model and k not in covered]
        if excluded:
            missing = [k for k in missing if k not in frozen]
        foreign = held_elsewhere(state.module)  # experts other expert-parallel ranks hold
        unexpected = [k for k in saved_model if k not in module_sd and not foreign(k)]
        if strict and (missing or unexpected):
            raise RuntimeError(
                f"Error(s) in loading state_dict for {type(state.module).__name__} from {path}: "
                f"missing keys {missing}, unexpected keys {unexpected}. "
                "Load with load_module_strict=False to load the matching entries only."
            )
        module_targets: dict[str, torch.Tensor] = {}
        for key, value in module_sd.items():
            if key in covered or key not in saved_model:
                continue
            entry = saved_model[key]
            shape = tuple(entry.shape or ())
            if shape != tuple(value.shape):
                raise ValueError(
                    f"{key}: shape {tuple(value.shape)} in the model but {shape} in the checkpoint {path}"
                )
            module_targets[keys.model_key(key)] = (
                torch.empty(shape, dtype=value.dtype) if custom_load_fn is not None else value
            )
        targets.update(module_targets)
        rank = comm.get_rank(state.process_group)
        own = keys.rank_key(rank) in saved
        rank_key = keys.rank_key(rank) if own else keys.rank_key(0)
        extra = {keys.COMMON: None}
        if rank_key in saved:
            extra[rank_key] = None
        load_targets = {prefix + k: v for k, v in targets.items()} if prefix else dict(targets)
        load_targets.update(extra)
        alone = comm.get_world_size(state.process_group) == 1
        if slices:  # DCP fills this rank's slices from the whole tensors, in place
            addressed = slices.whole_items(load_targets)
            readdressed = {k for k in load_targets if addressed[k] is not load_targets[k]}
            dcp_io.load(addressed, path, process_group=state.process_group, no_dist=alone)
            load_targets.update({k: v for k, v in addressed.items() if k not in readdressed})  # loaded objects
        else:
            dcp_io.load(load_targets, path, process_group=state.process_group, no_dist=alone)
        loaded = {k[len(prefix) :]: v for k, v in load_targets.items()} if prefix else load_targets
        if custom_load_fn is not None:
            custom_load_fn(
                src={k[len(keys.MODEL) :]: loaded[k] for k in module_targets},
                dst=state.module,
            )
        if finish is not None:
            finish(loaded)
        elif state.optimizer is not None:
            state.optimizer.refresh_masters_from_params()
        common = load_targets[keys.COMMON]
        per_rank = load_targets.get(rank_key)
        counters = {} if module_only else dict(common.get("counters", {}))
        if not module_only:
            self._restore_components(state, common, per_rank, own, with_optimizer, with_scheduler, counters)
        client_state = dict(common.get("client_state", {}))
        client_state.setdefault("ds_config", common.get("ds_config"))
        client_state.setdefault("global_samples", common.get("counters", {}).get("global_samples"))
        if not with_scheduler:
            client_state.setdefault("lr_scheduler", common.get("lr_scheduler"))
        logger.info("loaded checkpoint %s", path)
        return LoadResult(path, client_state, counters)

    def _restore_components(
        self,
        state: TrainingState,
        common: dict[str, Any],
        per_rank: dict[str, Any] | None,
        own: bool,
        with_optimizer: bool,
        with_scheduler: bool,
        counters: dict[str, int],
    ) -> None:
        restore_parts(
            state.parts, common, per_rank, with_optimizer=with_optimizer, with_scheduler=with_scheduler
        )
        if with_optimizer and state.optimizer is not None:
            # per-rank optimizer state (1-bit error buffers) continues only on the rank that saved it
            state.optimizer.load_rank_state_dict(per_rank.get("optimizer") if own and per_rank else None)
        if per_rank is None:
            return
        if own and per_rank.get("rng") is not None:
            rng.restore(per_rank["rng"])
        else:
            # A rank the saving run did not have: no state to continue, so a fixed, rank-distinct seed.
            seed = (counters.get("global_steps", 0) * 1_000_003 + comm.get_rank(state.process_group)) % 2**63
            logger.info(
                "rank %d has no saved RNG state (world size changed): seeding %d", comm.get_rank(), seed
            )
            rng.reseed(seed)
