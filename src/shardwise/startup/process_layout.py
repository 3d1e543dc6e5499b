"""The process layout ``initialize`` starts with: the process group, the declared dimensions, the TP split.

:func:`start_distributed` joins (or starts) the process group and registers the layout: the one
:mod:`shardwise.comm.mesh` owns when a feature or the config declares a dimension (the config's
``sequence_parallel_size`` and ``tensor_parallel.autotp_size``: :func:`declared_in_config`;
DeepSpeed's ``mesh_param``; MoE layers' ``ep_size``), else the world's or an mpu's.
:func:`apply_autoep` converts MoE blocks for the config's ``expert_parallel`` section,
:func:`merge_tp_model_init` folds ``tp_model_init``'s record into the config, and
:func:`split_tensor_parallel` splits the model over the ``tp`` dimension.

Example:
    >>> sequence_degree_of_mesh_param((2, 2), 4)
    2
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

from torch import nn

from shardwise import comm
from shardwise.autoep.convert import autoep_config, convert_model, repoint
from shardwise.comm import mesh
from shardwise.comm.groups import set_topology
from shardwise.comm.topology import Topology, build_topology
from shardwise.config import ConfigError
from shardwise.config.loading import read_config_source
from shardwise.config.model import ShardwiseConfig
from shardwise.moe.declare import declare_expert_parallelism, expert_parallel_degree
from shardwise.utils.logging import logger


def merge_tp_model_init(source: Any, mpu: object) -> Any:
    """The config with ``tp_model_init``'s recorded degree and dtype merged into ``tensor_parallel``."""
    from shardwise.tensor_parallel.model_init import merge_into_config, recorded

    if recorded() is None:
        return source
    from shardwise.config.loading import read_config_source

    raw, _ = read_config_source(source)
    return merge_into_config(raw, mpu)


def split_tensor_parallel(
    root: ShardwiseConfig, topology: Topology, model: nn.Module, model_parameters: Any, optimizer: object
) -> Any:
    """Split the model over the tensor-parallel dimension (``tensor_parallel.autotp_size`` > 1);
    returns ``model_parameters`` (and re-points a client optimizer) at the local slices."""
    from shardwise.tensor_parallel.engine_setup import remap_optimizer, remap_parameters, split_for_engine
    from shardwise.tensor_parallel.model_init import set_autotp_mode

    section = root.tensor_parallel
    if section.autotp_size > 0:
        set_autotp_mode(training=True)  # as DeepSpeed's initialize does for an AutoTP config
    if section.autotp_size > 1:
        from shardwise.zero.init_context import stash_of

        if any(stash_of(p) is not None for p in model.parameters()):
            raise ConfigError(
                "tensor_parallel.autotp_size",
                "the model was built under zero.Init (its parameters are placeholders), so it cannot be split",
                "build the model without zero.Init when training it with tensor parallelism (stage 3 still shards "
                "the slices)",
                value=section.autotp_size,
            )
    report = split_for_engine(model, section, topology, zero_stage=root.zero_stage)
    if report is None:
        return model_parameters
    remap_optimizer(optimizer, report)
    logger.info("tensor parallel: %d layers split over %d ranks (%s)", len(report.kinds), topology.mp_size,
                report.source)
    return remap_parameters(model_parameters, report)


def start_distributed(
    distributed_port: int,
    dist_init_required: bool | None,
    mpu: object,
    source: object,
    mesh_param: Any = None,
    model: Any = None,
) -> Topology:
    """Join (or start) the process group and read the process layout, registered for
    :mod:`shardwise.comm.groups`' accessors.

    Without an mpu the layout is the one :mod:`shardwise.comm.mesh` owns when a feature
    declared a dimension (a ``PipelineModule``, ``tp_model_init``, the model's MoE layers: their
    ``ep_size`` is declared here, :func:`shardwise.moe.declare.declare_expert_parallelism`) or the config
    does (``sequence_parallel_size``, ``tensor_parallel.autotp_size``); otherwise (and with an
    mpu) it is read as before.
    """
    comm.init_distributed(distributed_port=distributed_port, dist_init_required=dist_init_required)
    if getattr(mpu, "reads_process_layout", False):
        mpu = (
            None  # an mpu over the mesh itself (shardwise.sequence.parallel_state): the layout is the mesh's
        )
    sp, tp = declared_in_config(source)
    if mesh_param is not None:
        sp = sequence_degree_of_mesh_param(mesh_param, comm.get_world_size())
    if model is not None and expert_parallel_degree(model) > 1 and mpu is not None:
        raise ValueError(
            "MoE layers with ep_size > 1 and an mpu: shardwise builds expert groups from its own process "
            "layout (shardwise.comm.mesh), not from an mpu's groups; fix: drop mpu= (declare tensor "
            "parallelism with the config's tensor_parallel.autotp_size) or use ep_size=1"
        )
    if model is not None:
        declare_expert_parallelism(model)  # collective: the MoE layers' ep_size into the layout
    if mpu is None and (mesh.current_layout() is not None or sp is not None or tp is not None):
        return mesh.ensure_layout(
            sp=sp, tp=tp, source="the config (sequence_parallel_size / tensor_parallel)"
        )
    topology = build_topology(mpu)
    set_topology(topology)  # utils.groups-style accessors (shardwise.comm.groups) read this layout
    return topology


def sequence_degree_of_mesh_param(mesh_param: Any, world: int) -> int | None:
    """DeepSpeed's ``initialize(mesh_param=(data_parallel, sequence_parallel))``: the sp degree it declares."""
    valid = isinstance(mesh_param, (tuple, list)) and len(mesh_param) == 2
    if not valid or not all(isinstance(d, int) and not isinstance(d, bool) and d >= 1 for d in mesh_param):
        raise ValueError(
            f"mesh_param={mesh_param!r}: DeepSpeed's mesh_param is (data_parallel_size, sequence_parallel_size), "
            "two ints >= 1; e.g. mesh_param=(2, 2) on 4 ranks"
        )
    dp, sp = mesh_param
    if dp * sp != world:
        raise ValueError(
            f"mesh_param={tuple(mesh_param)}: data_parallel_size {dp} x sequence_parallel_size {sp} must equal "
            f"the world size {world}; launch {dp * sp} ranks or change mesh_param"
        )
    return sp if sp > 1 else None


def apply_autoep(
    source: object, model: Any, model_parameters: Any, optimizer: Any, mpu: object, topology: Topology
) -> tuple[Topology, Any]:
    """The config's ``expert_parallel`` (AutoEP): declare ``ep`` and convert the model's MoE blocks
    (:mod:`shardwise.autoep.convert`); parameter lists and a client optimizer built before are re-pointed
    at the kept experts. Nothing without the section (or with ``autoep_size`` 1)."""
    raw = read_config_source(source)[0] if isinstance(source, (str, os.PathLike, Mapping)) else {}
    config = autoep_config(raw, topology, mpu)
    if config is None:
        return topology, model_parameters
    if mpu is not None:
        raise ValueError(
            "expert_parallel (AutoEP) with an mpu: shardwise builds expert groups in its own process layout; "
            "fix: drop mpu="
        )
    replaced = convert_model(model, config, topology)
    if config.autoep_size > 1:
        topology = mesh.current_layout() or topology
    if optimizer is not None and hasattr(optimizer, "param_groups"):
        for group in optimizer.param_groups:
            group["params"] = repoint(list(group["params"]), replaced)
    return topology, repoint(model_parameters, replaced)


def declared_in_config(source: object) -> tuple[int | None, int | None]:
    """The config's ``sequence_parallel_size`` and ``tensor_parallel.autotp_size`` when they ask
    for more than one rank (validated later with the rest of the config)."""
    if not isinstance(source, (str, os.PathLike, Mapping)):
        return None, None
    raw, _ = read_config_source(source)
    tp_section = raw.get("tensor_parallel")
    sp = raw.get("sequence_parallel_size")
    tp = tp_section.get("autotp_size") if isinstance(tp_section, dict) else None
    return (
        sp if isinstance(sp, int) and not isinstance(sp, bool) and sp > 1 else None,
        tp if isinstance(tp, int) and not isinstance(tp, bool) and tp > 1 else None,
    )
