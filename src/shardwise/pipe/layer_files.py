"""Per-layer checkpoint files of a PipelineModule: independent of how many stages wrote them.

Layout (DeepSpeed's, so its tools read it): in ``<dir>/<tag>/``, one file per layer that has state,
named by the layer's *global* index, ``layer_{index:02d}-model_states.pt`` (with
``-model_{slice:02d}`` before ``-model_states`` under tensor parallelism), holding that layer's
``state_dict()``. A layer used through a ``TiedLayerSpec`` with a ``forward_fn`` has no file of
its own: its module is saved where it is used directly, and every other holder takes it from the
first holder after loading. Data-parallel rank 0 of each stage writes its stage's layers, so a
checkpoint written with 2 stages loads with 1 (or 4) stages unchanged.

``checkpoint_engine`` is anything with DeepSpeed's ``save(state_dict, path)``,
``load(path, map_location=...)`` and ``makedirs(path, exist_ok=...)``; None uses ``torch.save``
and ``torch.load`` directly.
"""

from __future__ import annotations

import glob
import os
from typing import TYPE_CHECKING, Any, cast

import torch
from torch import nn

from shardwise.pipe.topology import ProcessTopology

if TYPE_CHECKING:
    from shardwise.pipe.module import PipelineModule


def rank_prefix(topo: ProcessTopology, rank: int, checkpoints_path: str, tag: str) -> str:
    """``<path>/<tag>/module-pipe_XX[-model_XX]``: the data axis is left out (replicas are equal)."""
    coord = topo.get_coord(rank)
    name = "module" + "".join(f"-{a}_{getattr(coord, a):02d}" for a in topo.get_axis_names() if a != "data")
    return os.path.join(checkpoints_path, str(tag), name)


def layer_path(topo: ProcessTopology, rank: int, ckpt_dir: str, layer_idx: int) -> str:
    """The file of global layer ``layer_idx`` as ``rank`` writes it."""
    path = os.path.join(ckpt_dir, f"layer_{layer_idx:02d}")
    rank_repr = topo.get_rank_repr(rank=rank)
    if rank_repr:
        path += f"-{rank_repr}"
    return path + "-model_states.pt"


def layer_path_list(ckpt_dir: str, layer_idx: int) -> list[str]:
    """Every file of global layer ``layer_idx`` (one per tensor slice), sorted."""
    return sorted(glob.glob(os.path.join(ckpt_dir, f"layer_{layer_idx:02d}-*model_states.pt")))


def _save(engine: Any, state: dict[str, Any], path: str) -> None:
    if engine is None:
        torch.save(state, path)
    else:
        engine.save(state_dict=state, path=path)


def _load(engine: Any, path: str) -> dict[str, Any]:
    if engine is None:
        return torch.load(path, map_location="cpu", weights_only=True)
    return engine.load(path, map_location="cpu")


def save_layers(
    module: PipelineModule, save_dir: str, checkpoint_engine: Any = None, exclude_frozen_params: bool = False
) -> None:
    """Write this stage's layer files (data-parallel rank 0 only, unless
    ``checkpoint_parallel_write_pipeline`` spreads the layers over the data-parallel ranks)."""
    from shardwise.pipe.partition import partition_uniform

    grid = module._grid
    n = len(module.forward_funcs)
    if module.checkpoint_parallel_write_pipeline:
        bounds = partition_uniform(n, grid.data_parallel_size)
        start, end = bounds[grid.data_parallel_id], bounds[grid.data_parallel_id + 1]
    elif grid.data_parallel_id != 0:
        return
    else:
        start, end = 0, n
    if checkpoint_engine is None:
        os.makedirs(save_dir, exist_ok=True)
    else:
        checkpoint_engine.makedirs(save_dir, exist_ok=True)
    for local in range(start, end):
        layer = module.forward_funcs[local]
        if not hasattr(layer, "state_dict"):
            continue
        state = {k: v.detach().clone() if torch.is_tensor(v) else v for k, v in layer.state_dict().items()}
        if exclude_frozen_params:
            for name, p in cast(nn.Module, layer).named_parameters():  # a layer with a state_dict is a module
                if not p.requires_grad:
                    state.pop(name, None)
        _save(checkpoint_engine, state, module.ckpt_layer_path(save_dir, local))


def load_layers(
    module: PipelineModule, load_dir: str, checkpoint_engine: Any = None, strict: bool = True
) -> None:
    """Load every layer of this stage that has state from its file.

    Raises:
        FileNotFoundError: a layer's file is missing (names the layer and the directory).
        NotImplementedError: a layer was saved in several tensor slices (merging them is not supported).
    """
    for local, layer in enumerate(module.forward_funcs):
        if not hasattr(layer, "load_state_dict"):
            continue
        files = module.ckpt_layer_path_list(load_dir, local)
        index = local + module._local_start
        if not files:
            raise FileNotFoundError(
                f"no checkpoint file for pipeline layer {index} in {load_dir} (expected "
                f"layer_{index:02d}-*model_states.pt); was it saved from a model with the same layers?"
            )
        slice_files = [
            f for f in files if f"model_{module._grid.get_slice_parallel_rank():02d}" in f
        ] or files
        if len(slice_files) > 1:
            raise NotImplementedError(
                f"pipeline layer {index} has {len(slice_files)} files in {load_dir}: merging tensor slices "
                "is not supported; load with the tensor-parallel size it was saved with"
            )
        layer.load_state_dict(_load(checkpoint_engine, slice_files[0]), strict=strict)
