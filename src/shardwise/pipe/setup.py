"""What ``initialize`` does for a PipelineModule before the optimizer exists.

* the ``pipeline`` config section: ``activation_checkpoint_interval`` and ``use_reentrant`` set
  the module's checkpointing; ``schedule``/``virtual_stages`` pick the torch schedule and re-cut
  the module into chunks for interleaved and V-shaped ones (an impossible pair is refused by
  name). ``stages``, ``partition`` and ``seed_layers`` are read by neither DeepSpeed's engine nor
  this one (the module's own arguments decide), and ``pipe_partitioned``/``grad_partitioned`` act
  only with tensor slicing: :mod:`shardwise.config.inert` reports them when set;
* ZeRO: stages 0 and 1 only (DeepSpeed's rule; stage 2 reduce-scatters every micro batch inside
  backward, which the pipeline's tied-gradient sum must precede, and stage 3 shards layers the
  stages already split);
* the norm group: the topology handed to ZeRO names the pipeline group as its model-parallel
  group (DeepSpeed's mpu does the same), and every stage's own parameters are flagged
  ``model_parallel``, so the gradient norm and the overflow check cover the whole model; a
  tied copy on a later stage (``ds_pipe_replicated``) is counted once.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from shardwise.comm import init
from shardwise.comm.group_type import Group
from shardwise.comm.topology import Topology
from shardwise.config.errors import ConfigError
from shardwise.config.model import ShardwiseConfig
from shardwise.pipe import executor as ex
from shardwise.pipe.grid import PipelineParallelGrid
from shardwise.pipe.module import PipelineModule


def pipe_group(grid: PipelineParallelGrid) -> Group:
    """The pipeline group as a collective can take it: the layout's group, or the world group
    object when the pipeline spans the world (the layout's ``None``)."""
    if grid.pipe_parallel_size > 1 and grid.pp_proc_group is None:
        return init.get_world_group()
    return grid.pp_proc_group


def _check_config(module: PipelineModule, root: ShardwiseConfig) -> None:
    stage = int(root.zero_stage)
    if stage >= 2:
        raise ConfigError(
            "zero_optimization.stage",
            f"stage {stage} with a PipelineModule: ZeRO-2 reduces gradients inside every micro batch's backward "
            "and ZeRO-3 shards the layers the stages already split (DeepSpeed refuses both too)",
            "use stage 0 or 1 with pipeline parallelism",
            value=stage,
        )
    if module._grid.model_parallel_size > 1:
        raise ConfigError(
            "pipeline",
            f"a topology with {module._grid.model_parallel_size} tensor slices (model axis): pipeline with tensor "
            "parallelism is not supported yet (no group spans pipe x model ranks for the gradient norm)",
            "use PipeDataParallelTopology, or a model axis of 1",
        )


def prepare(module: PipelineModule, root: ShardwiseConfig, model_parameters: Any) -> Any:
    """Apply the ``pipeline`` section to ``module`` (collective: may re-cut it into chunks).

    Returns the parameters to optimize: ``model_parameters`` unchanged, or, when the module was
    re-cut for virtual stages, the module's new trainable parameters (refused when the caller
    passed parameter groups, which could not be mapped onto the new layers).
    """
    from shardwise import checkpointing

    _check_config(module, root)
    section = root.pipeline
    if not section.use_reentrant:
        module.activation_checkpoint_func = checkpointing.non_reentrant_checkpoint
    if section.activation_checkpoint_interval > 0:
        module.activation_checkpoint_interval = section.activation_checkpoint_interval
    if module.activation_checkpoint_interval > 0:
        module._precompute_checkpointable_values()
    try:
        kind = ex.check_schedule(section.schedule, section.virtual_stages)
    except ValueError as exc:
        raise ConfigError(
            "pipeline.virtual_stages",
            str(exc),
            "set the stages per rank the schedule runs",
            value=section.virtual_stages,
        ) from None
    if kind.stages_per_rank == 1:
        return model_parameters
    p = module.num_stages
    indices = ex.chunk_stages(kind, module.stage_id, p, section.virtual_stages)
    total = p * section.virtual_stages

    def rank_of(stage: int) -> int:
        return stage % p if kind.placement == "loop" else (stage if stage < p else 2 * p - 1 - stage)

    before = {id(q) for q in module.parameters()}
    items = list(model_parameters) if model_parameters is not None else None
    if items and isinstance(items[0], dict):
        raise ConfigError(
            "pipeline.virtual_stages",
            "parameter groups were passed to initialize, but the module is re-cut into chunks for "
            f"schedule {section.schedule!r}, which builds new layers",
            "pass model_parameters=None (or the module's parameters) with interleaved / V-shaped schedules",
            value=section.virtual_stages,
        )
    if items and any(id(q) not in before for q in items):
        raise ConfigError(
            "pipeline.virtual_stages",
            "model_parameters holds tensors that are not the PipelineModule's",
            "pass the module's parameters (or None) to initialize",
            value=section.virtual_stages,
        )
    module.split_virtual_stages(indices, total, rank_of)
    return None if items is None else [q for q in module.parameters() if q.requires_grad]


def norm_topology(topology: Topology, module: PipelineModule) -> Topology:
    """The layout ZeRO gets: the pipeline group as its model-parallel group (see the module docstring)."""
    grid = module._grid
    for param in module.parameters():
        setattr(param, "model_parallel", not getattr(param, "ds_pipe_replicated", False))  # noqa: B010 - DeepSpeed's attribute
    if grid.pipe_parallel_size == 1:
        return topology
    return dataclasses.replace(
        topology, mp_group=pipe_group(grid), mp_rank=grid.stage_id, mp_size=grid.pipe_parallel_size
    )
