"""DeepSpeed's ``PipelineParallelGrid``: a topology's groups, taken from the process layout.

The grid declares the topology's pipeline (and ``model``) degree to
:func:`shardwise.comm.mesh.ensure_layout` and reads every group from the layout it returns; it
makes none of its own. The mesh orders ranks pipeline-outermost and tensor-innermost, which is
DeepSpeed's ``pipe, data, model`` order, so a topology with those axes (or a prefix of them) maps
onto it rank for rank; other axis orders are refused.

As everywhere in shardwise (:mod:`shardwise.comm.groups`), a group of one rank, or one spanning the
whole world, is ``None``: ask the size before passing it to a collective.
"""

from __future__ import annotations

from typing import Any

from shardwise.comm import init, mesh
from shardwise.comm.group_type import Group
from shardwise.comm.topology import Topology
from shardwise.pipe.topology import PipeDataParallelTopology, ProcessTopology, _prime_factors

_MESH_AXES = ("pipe", "data", "model")


def _check_axes(topo: ProcessTopology) -> None:
    axes = tuple(topo.get_axis_names())
    if axes not in (_MESH_AXES[:2], _MESH_AXES) or "pipe" not in axes:
        raise ValueError(
            f"topology axes {list(axes)}: shardwise's process layout orders ranks as DeepSpeed's "
            f"{list(_MESH_AXES)} (pipeline outermost, tensor innermost); use PipeDataParallelTopology or "
            "PipeModelDataParallelTopology"
        )


def default_topology(world_size: int) -> ProcessTopology:
    """DeepSpeed's default: the prime factors of the world alternate between pipe and data."""
    pp = dp = 1
    for i, prime in enumerate(_prime_factors(world_size)):
        if i % 2 == 0:
            pp *= prime
        else:
            dp *= prime
    return PipeDataParallelTopology(num_pp=pp, num_dp=dp)


class PipelineParallelGrid:
    """The groups of a pipeline topology for this rank, and DeepSpeed's mpu accessors over them.

    Args:
        topology: a ``pipe x data [x model]`` topology; None: DeepSpeed's default split of the world.
        process_group: accepted for DeepSpeed's signature; the world is the layout's.
    """

    def __init__(self, topology: ProcessTopology | None = None, process_group: Any = None) -> None:
        self.global_rank = init.get_rank()
        self.world_size = init.get_world_size()
        self._topo = topology if topology is not None else default_topology(self.world_size)
        _check_axes(self._topo)
        if self._topo.world_size() != self.world_size:
            raise ValueError(
                f"topology {dict(zip(self._topo.axes, self._topo.dims))} covers {self._topo.world_size()} ranks "
                f"but the world has {self.world_size}; make the product of its dims the world size"
            )
        self.data_parallel_size = max(self._topo.get_dim("data"), 1)
        self.pipe_parallel_size = max(self._topo.get_dim("pipe"), 1)
        self.model_parallel_size = max(self._topo.get_dim("model"), 1)
        self.slice_parallel_size = self.model_parallel_size
        source = f"pipeline topology {dict(zip(self._topo.axes, self._topo.dims))}"
        self.layout: Topology = mesh.ensure_layout(
            pp=self.pipe_parallel_size, tp=self.model_parallel_size, source=source
        )
        if self.layout.size_of("dp") != self.data_parallel_size:
            raise ValueError(
                f"{source}: the process layout has {self.layout.size_of('dp')} data-parallel ranks, the "
                f"topology {self.data_parallel_size} (is sequence parallelism declared too?); make them agree"
            )
        coord = self._topo.get_coord(self.global_rank)
        self.stage_id = coord.pipe
        self.data_parallel_id = coord.data
        assert self.layout.rank_in("pp") == self.stage_id, "mesh and topology disagree on the stage"
        self.is_first_stage = self.stage_id == 0
        self.is_last_stage = self.stage_id == self.pipe_parallel_size - 1
        self.pp_group = list(self.layout.ranks_of("pp"))
        self.pp_proc_group = self.layout.group_of("pp")
        self.dp_group = list(self.layout.ranks_of("dp"))
        self.dp_proc_group = self.layout.group_of("dp")
        self.dp_groups = self._topo.get_axis_comm_lists("data")
        self.pipe_groups = self._topo.get_axis_comm_lists("pipe")
        self.slice_group = list(self.layout.ranks_of("tp"))
        self.slice_proc_group = self.layout.group_of("tp")
        self.p2p_groups = self._build_p2p_groups()
        # DeepSpeed's "model parallel" group: every rank of one data-parallel replica (pipe x model).
        self.ds_model_rank = self._topo.get_axis_list("data", self.data_parallel_id).index(self.global_rank)
        self.ds_model_world_size = self.pipe_parallel_size * self.model_parallel_size

    def _build_p2p_groups(self) -> list[list[int]]:
        """Each rank with its next stage (wrapping around), as DeepSpeed lists them."""
        pairs = []
        for rank in range(self.world_size):
            ranks = next(r for r in self.pipe_groups if rank in r)
            pairs.append([rank, ranks[(ranks.index(rank) + 1) % len(ranks)]])
        return pairs

    def _is_grid_valid(self) -> bool:
        return self._topo.world_size() == init.get_world_size()

    def stage_to_global(self, stage_id: int, **kwargs: int) -> int:
        """The global rank of ``stage_id`` with this rank's other coordinates (or those given)."""
        coord = self._topo.get_coord(self.global_rank)._replace(pipe=stage_id, **kwargs)
        return self._topo.get_rank(**coord._asdict())

    def topology(self) -> ProcessTopology:
        """The topology."""
        return self._topo

    # ---------------------------------------------------------------- the mpu accessors
    def get_global_rank(self) -> int:
        """This rank."""
        return self.global_rank

    def get_stage_id(self) -> int:
        """This rank's pipeline stage."""
        return self.stage_id

    def get_data_parallel_id(self) -> int:
        """This rank's data-parallel index."""
        return self.data_parallel_id

    def get_pipe_parallel_rank(self) -> int:
        """This rank's pipeline stage."""
        return self.stage_id

    get_pipeline_model_parallel_rank = get_pipe_parallel_rank

    def get_pipe_parallel_world_size(self) -> int:
        """The number of stages."""
        return self.pipe_parallel_size

    get_pipeline_model_parallel_world_size = get_pipe_parallel_world_size

    def get_pipe_parallel_group(self) -> Group:
        """The ranks of this rank's pipeline (None when it is the world or one rank)."""
        return self.pp_proc_group

    def get_data_parallel_rank(self) -> int:
        """Which pipeline (data-parallel replica) this rank is in."""
        return self.data_parallel_id

    def get_data_parallel_world_size(self) -> int:
        """The number of pipelines."""
        return self.data_parallel_size

    def get_data_parallel_group(self) -> Group:
        """This stage's ranks over all pipelines."""
        return self.dp_proc_group

    def get_data_parallel_group_ranks(self) -> list[int]:
        """The global ranks of the data-parallel group."""
        return self.dp_group

    def get_model_parallel_rank(self) -> int:
        """This rank's place among the ranks of its pipeline replica (pipe x model)."""
        return self.ds_model_rank

    def get_model_parallel_world_size(self) -> int:
        """Ranks per pipeline replica (stages x tensor slices)."""
        return self.ds_model_world_size

    def get_model_parallel_group(self) -> Group:
        """The group of one pipeline replica: the pipeline group, or the tensor group with one stage.

        Raises:
            NotImplementedError: pipeline and tensor parallelism together (the layout has no
                group spanning both).
        """
        if self.pipe_parallel_size > 1 and self.model_parallel_size > 1:
            raise NotImplementedError(
                "a group over pipe x model ranks: the process layout has none (pipeline with tensor "
                "parallelism); use get_pipe_parallel_group() and get_slice_parallel_group()"
            )
        return self.pp_proc_group if self.pipe_parallel_size > 1 else self.slice_proc_group

    def get_slice_parallel_rank(self) -> int:
        """This rank's tensor (``model``) slice."""
        return getattr(self._topo.get_coord(self.global_rank), "model", 0)

    get_tensor_model_parallel_rank = get_slice_parallel_rank

    def get_slice_parallel_world_size(self) -> int:
        """The number of tensor slices."""
        return self.slice_parallel_size

    get_tensor_model_parallel_world_size = get_slice_parallel_world_size

    def get_slice_parallel_group(self) -> Group:
        """The tensor-slice group."""
        return self.slice_proc_group

    get_tensor_model_parallel_group = get_slice_parallel_group
