"""Saving and loading a training state: collectives, DCP, atomic publication, async writes.

:class:`TrainingState` names the parts a checkpoint covers (each part keeps its own
``state_dict``), :class:`Checkpointer` does the work. The engine-facing functions with
DeepSpeed's signatures are in :mod:`shardwise.checkpoint.engine_io`.

What a save does (every rank calls it):

1. wait for the previous asynchronous save (its error, if any, is raised here);
2. check the tag is the same on every rank (``checkpoint.tag_validation``);
3. collect the state: module entries, the optimizer's topology-free pieces, counters,
   scheduler, loss scaler, step hooks, client state, and per rank the RNG states and loader
   position;
4. write it with DCP into ``.<tag>.partial`` (every rank its own shards, in parallel,
   fsynced; :mod:`~shardwise.checkpoint.publish` does steps 4-5); with
   ``checkpoint.async_save`` the state is first copied and steps 4-5 run in a background
   thread while training continues;
5. every rank checksums the files it wrote; the publishing rank adds the summary (with
   every file's checksum, :mod:`~shardwise.checkpoint.integrity`), renames the directory to
   ``<tag>``, then moves ``latest``. A failure anywhere is raised on every rank and publishes
   nothing. A load verifies the files against these checksums before it reads them.
"""

from __future__ import annotations

import hashlib
import math
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from shardwise import comm
from shardwise.checkpoint import deepspeed_moe_save, integrity_ranks, keys, layout, publish, rng
from shardwise.checkpoint.dcp_load import DcpLoading, _mp_prefix, _saved_mp_size
from shardwise.checkpoint.deepspeed_moe import moe_layers
from shardwise.checkpoint.folded_files import check_before_load, summary_entries
from shardwise.checkpoint.tp_whole import tp_slices
from shardwise.checkpoint.training_state import (
    LoadResult,
    TrainingState,
    checkpoint_name,
    module_state_dict,
    param_names,
    saved_parts,
)
from shardwise.comm.group_type import Group
from shardwise.utils.logging import logger


@dataclass(frozen=True)
class CheckpointOptions:
    """The ``checkpoint`` config section, as the checkpointer uses it."""

    tag_validation: str = "Warn"
    use_node_local_storage: bool = False
    load_universal: bool = False
    async_save: bool = False
    thread_count: int = 1
    deepspeed_moe_files: bool = True  # MoE models: DeepSpeed's per-expert model files too


class Checkpointer(DcpLoading):
    """Saves and loads :class:`TrainingState` s; holds the in-flight asynchronous save.

    Example:
        >>> # ckpt = Checkpointer(CheckpointOptions())
        >>> # ckpt.save(state, "ckpts", tag="global_step10")
        >>> # result = ckpt.load(state, "ckpts")   # any world size, any ZeRO stage
    """

    def __init__(self, options: CheckpointOptions) -> None:
        self.options = options
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None
        self._async_group: Group = None

    # ------------------------------------------------------------------ async bookkeeping
    def wait(self) -> None:
        """Block until the in-flight asynchronous save is published; re-raise its error."""
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        if self._error is not None:
            error, self._error = self._error, None
            raise RuntimeError(f"the previous asynchronous checkpoint save failed: {error}") from error

    def _group_for_async(self, base: Group) -> Group:
        # A background thread must not issue collectives on the group training uses (gloo and
        # nccl both require one issuing order per group), so async saves get their own gloo group.
        if self._async_group is None and comm.get_world_size(base) > 1:
            self._async_group = comm.new_group(comm.group_ranks(base), backend="gloo")
        return self._async_group

    # ------------------------------------------------------------------ save
    def save(
        self,
        state: TrainingState,
        save_dir: str | Path,
        tag: str | None = None,
        client_state: Mapping[str, Any] | None = None,
        save_latest: bool = True,
        exclude_frozen_parameters: bool = False,
        *,
        background: bool | None = None,
    ) -> Path:
        """Save ``state`` as ``save_dir/<tag>`` (collective); returns the tag directory.

        ``background`` (None: ``async_save``'s choice) writes and publishes in a background thread
        once the state is copied; the engine's periodic snapshots pass True.
        """
        self.wait()
        if not str(save_dir):
            raise ValueError("save_checkpoint needs a save_dir (got an empty path)")
        client_state = dict(client_state or {})
        if "checkpoint_parallel_dimensions" in client_state:
            raise KeyError("client_state may not use the reserved key 'checkpoint_parallel_dimensions'")
        tag = layout.check_tag(
            tag if tag is not None else f"global_step{state.counters.get('global_steps', 0)}"
        )
        self._validate_tag(tag, state.process_group)
        pending, gas = state.pending_micro_batches, state.gradient_accumulation_steps
        if pending:  # gradients accumulated since the last optimizer step (not micro_steps % GAS: clients
            # such as accelerate move the boundary themselves)
            logger.warning(
                "checkpoint %s is saved in the middle of a gradient-accumulation window (micro step %d of %d): "
                "the gradients accumulated so far are not saved",
                tag,
                pending,
                gas,
            )
        root = Path(save_dir)
        items = self._collect(state, client_state, exclude_frozen_parameters, tag)
        side = {}
        if self.options.deepspeed_moe_files:
            side = deepspeed_moe_save.side_files(
                state.module,
                zero_stage=state.zero_stage,
                mp_world_size=state.mp_world_size,
                dp_world_size=state.dp_world_size,
                common=items[keys.COMMON],  # type: ignore[arg-type]
                folding=state.folding,
                optimizer=state.optimizer.optimizer if state.optimizer is not None else None,
            )
        summary = _summary(state, tag, exclude_frozen_parameters, items)
        summary.update(summary_entries(state.folding, self.options.deepspeed_moe_files and state.zero_stage < 3))
        failure: OSError | None = None
        if publish.is_publisher(self.options.use_node_local_storage):
            try:
                layout.prepare_staging(root, tag)
            except OSError as error:  # e.g. a read-only or full disk on this rank's node
                failure = error
        # every rank learns which rank could not write where; nothing is published, `latest` stays
        integrity_ranks.raise_if_any_failed(
            failure, state.process_group, f"saving checkpoint {tag!r} (nothing published, 'latest' unchanged)"
        )
        if self.options.async_save if background is None else background:
            items = publish.snapshot(items)
            group = self._group_for_async(state.process_group)
            self._thread = threading.Thread(
                target=self._background, args=(items, root, tag, summary, save_latest, group, side), daemon=False
            )
            self._thread.start()
        else:
            self._write_and_publish(items, root, tag, summary, save_latest, state.process_group, side)
        return root / tag

    def _background(self, *args: object) -> None:
        try:
            self._write_and_publish(*args)
        except BaseException as error:  # handed to the next wait()
            self._error = error

    def _write_and_publish(self, *args: Any) -> None:
        publish.write_and_publish(
            *args, node_local=self.options.use_node_local_storage, thread_count=self.options.thread_count
        )

    def _validate_tag(self, tag: str, group: Group) -> None:
        mode = self.options.tag_validation.lower()
        if mode == "ignore" or comm.get_world_size(group) == 1:
            return
        digest = int.from_bytes(hashlib.sha1(tag.encode()).digest()[:7], "big")
        low, high = torch.tensor([digest]), torch.tensor([digest])
        comm.all_reduce(low, op="min", group=group)
        comm.all_reduce(high, op="max", group=group)
        if int(low) != int(high):
            message = f"The checkpoint tag name '{tag}' is not consistent across all ranks"
            if mode == "fail":
                raise ValueError(
                    f"{message} (checkpoint.tag_validation is 'Fail'); pass the same tag on every rank"
                )
            logger.warning("%s; every rank must pass the same tag", message)

    def _collect(
        self, state: TrainingState, client_state: dict[str, object], exclude_frozen: bool, tag: str
    ) -> dict[str, object]:
        names = param_names(state.module)
        named = checkpoint_name(state.module)
        frozen = {named(n) for n, p in state.module.named_parameters(remove_duplicate=False) if not p.requires_grad}
        prefix = _mp_prefix(state)
        items: dict[str, Any] = {}
        for key, value in module_state_dict(state.module).items():
            if exclude_frozen and key in frozen:
                continue
            items[prefix + keys.model_key(key)] = value
        if state.optimizer is not None:
            for key, value in state.optimizer.sharded_state_dict(names).items():
                items[prefix + key] = value
        slices = tp_slices(state.module)
        if slices:  # tensor-parallel slices saved as chunks of their whole tensors
            items = slices.whole_items(items)
        common, per_rank = saved_parts(state.parts)
        items[keys.COMMON] = {
            **common,
            "client_state": client_state,
            "ds_config": state.ds_config,
            "exclude_frozen_parameters": exclude_frozen,
            "tag": tag,
        }
        items[keys.rank_key(comm.get_rank(state.process_group))] = {
            "rng": rng.capture(),
            **per_rank,
            "optimizer": state.optimizer.rank_state_dict() if state.optimizer is not None else None,
        }
        return items

    # ------------------------------------------------------------------ load
    def load(
        self,
        state: TrainingState,
        load_dir: str | Path,
        tag: str | None = None,
        *,
        load_module_strict: bool = True,
        load_optimizer_states: bool = True,
        load_lr_scheduler_states: bool = True,
        load_module_only: bool = False,
        custom_load_fn: Callable[..., object] | None = None,
    ) -> LoadResult | None:
        """Restore ``state`` from a checkpoint of any world size and stage (collective).

        Returns None (with a warning) when ``tag`` is None and there is no ``latest`` file.
        """
        self.wait()
        root = Path(load_dir)
        universal = self.options.load_universal
        if tag is None:
            tag = layout.read_latest(root, layout.LATEST_UNIVERSAL if universal else layout.LATEST)
            if tag is None and universal:
                raise ValueError(
                    f"checkpoint.load_universal is true but {root / layout.LATEST_UNIVERSAL} does not exist: "
                    "point load_checkpoint at a universal checkpoint (ds_to_universal or `shardwise checkpoint "
                    "to-universal` output), pass its tag, or set load_universal to false"
                )
            if tag is None:
                logger.warning(
                    "Unable to find latest file at %s, if trying to load latest checkpoint please ensure this file "
                    "exists or pass an explicit checkpoint tag when loading a checkpoint.",
                    root / layout.LATEST,
                )
                return None
        path = layout.tag_path(root, layout.check_tag(tag))
        kind = layout.detect_kind(path)
        if state.folding is not None and kind in ("shardwise", "deepspeed"):  # the layout first: it only refuses
            check_before_load(path, kind, state.folding, moe_layers(state.module))
        if kind is not None:  # every file checked against its checksum before any byte is used
            integrity_ranks.verify_before_load(path, state.process_group)
        if universal and kind != "universal":
            raise ValueError(
                f"checkpoint.load_universal is true but {path} is a {kind} checkpoint, not a universal one "
                "(no zero/optimizer_state.pt): convert it with `shardwise checkpoint to-universal` (or DeepSpeed's "
                "ds_to_universal), or set load_universal to false to load it as it is"
            )
        if kind == "universal":
            from shardwise.checkpoint.deepspeed_import import load_deepspeed_checkpoint
            from shardwise.checkpoint.universal_read import UniversalCheckpoint

            return load_deepspeed_checkpoint(
                state,
                path,
                load_module_strict=load_module_strict,
                load_optimizer_states=load_optimizer_states,
                load_lr_scheduler_states=load_lr_scheduler_states,
                load_module_only=load_module_only,
                ckpt=UniversalCheckpoint(path),
            )
        if kind == "deepspeed":
            from shardwise.checkpoint.deepspeed_import import load_deepspeed_checkpoint

            return load_deepspeed_checkpoint(
                state,
                path,
                load_module_strict=load_module_strict,
                load_optimizer_states=load_optimizer_states,
                load_lr_scheduler_states=load_lr_scheduler_states,
                load_module_only=load_module_only,
            )
        if kind is None:
            raise FileNotFoundError(f"{path} is not a checkpoint (no DCP .metadata, no *_model_states.pt)")
        return self._load_dcp(
            state,
            path,
            strict=load_module_strict,
            with_optimizer=load_optimizer_states and not load_module_only,
            with_scheduler=load_lr_scheduler_states and not load_module_only,
            module_only=load_module_only,
            custom_load_fn=custom_load_fn,
        )

def _summary(
    state: TrainingState, tag: str, exclude_frozen: bool, items: Mapping[str, object]
) -> dict[str, object]:
    from shardwise import __version__

    seen: set[int] = set()
    trainable = frozen = 0
    dtypes: set[str] = set()
    for _, p in state.module.named_parameters():
        if id(p) in seen:
            continue
        seen.add(id(p))
        dtypes.add(str(p.dtype).removeprefix("torch."))
        if p.requires_grad:
            trainable += math.prod(p.shape)
        else:
            frozen += math.prod(p.shape)
    module_keys = list(state.module.state_dict().keys())
    frozen_names = [
        n for n, p in state.module.named_parameters(remove_duplicate=False) if not p.requires_grad
    ]
    if exclude_frozen:
        module_keys = [k for k in module_keys if k not in set(frozen_names)]
    first = param_names(state.module)
    aliases = {
        n: first[id(p)] for n, p in state.module.named_parameters(remove_duplicate=False) if first[id(p)] != n
    }
    return {
        "module_keys": module_keys,
        "frozen": frozen_names,
        "aliases": aliases,
        "format": keys.FORMAT,
        "format_version": keys.FORMAT_VERSION,
        "shardwise_version": __version__,
        "tag": tag,
        "saved_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "counters": dict(state.counters),
        "zero_stage": state.zero_stage,
        "world_size": comm.get_world_size(state.process_group),
        "dp_world_size": state.dp_world_size,
        "mp_world_size": _saved_mp_size(state),
        "tensor_parallel_size": state.mp_world_size,
        "param_dtypes": sorted(dtypes),
        "trainable_parameters": trainable,
        "frozen_parameters": frozen,
        "exclude_frozen_parameters": exclude_frozen,
        "fp32_masters_saved": any(k.startswith(keys.MASTER) or f"/{keys.MASTER}" in k for k in items),
        "optimizer": None if state.optimizer is None else state.optimizer.optimizer_name,
        "moe_layers": [record.as_json() for record in moe_layers(state.module)],  # for to-deepspeed's files
    }
