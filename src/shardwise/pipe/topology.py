"""DeepSpeed's process topologies: named axes over the ranks, row-major (the last axis varies fastest).

Pure rank arithmetic, no process groups: :class:`ProcessTopology` maps coordinates to ranks and back,
:class:`PipeDataParallelTopology` is ``pipe x data`` and :class:`PipeModelDataParallelTopology`
``pipe x data x model`` (DeepSpeed's axis orders, which are also the mesh's: pipeline outermost,
tensor innermost). The groups of a topology come from :mod:`shardwise.pipe.grid`.

Example:
    >>> topo = PipeDataParallelTopology(num_pp=2, num_dp=2)
    >>> topo.get_rank(pipe=1, data=0), topo.get_axis_comm_lists("pipe")
    (2, [[0, 2], [1, 3]])
"""

from __future__ import annotations

import itertools
import math
from collections import namedtuple
from collections.abc import Sequence
from typing import Any, cast


class ProcessTopology:
    """Cartesian coordinates over named axes <-> linear ranks, row-major in the order of ``axes``.

    Args:
        axes: the axis names, outermost first.
        dims: the length of each axis.
    """

    def __init__(self, axes: Sequence[str], dims: Sequence[int]) -> None:
        if len(axes) != len(dims):
            raise ValueError(
                f"ProcessTopology: {len(axes)} axes {list(axes)} but {len(dims)} dims {list(dims)}"
            )
        self.axes = list(axes)
        self.dims = list(dims)
        self.ProcessCoord: Any = cast(Any, namedtuple("ProcessCoord", self.axes))
        # DeepSpeed exposes this dict; kept, in rank order.
        self.mapping = {
            self.ProcessCoord(*coord): rank
            for rank, coord in enumerate(itertools.product(*(range(d) for d in self.dims)))
        }

    # ------------------------------------------------------------------ rank <-> coordinate
    def _strides(self) -> list[int]:
        return [math.prod(self.dims[i + 1 :]) for i in range(len(self.dims))]

    def get_rank(self, **coord_kwargs: int) -> int:
        """The rank at the coordinate given by every axis (``get_rank(pipe=0, data=1)``)."""
        if len(coord_kwargs) != len(self.axes):
            raise ValueError(
                f"get_rank({coord_kwargs}) needs a value for every axis {self.axes}; for slices of the grid use filter_match()"
            )
        unknown = set(coord_kwargs) - set(self.axes)
        if unknown:
            raise ValueError(f"get_rank(): axes {sorted(unknown)} are not in the topology's {self.axes}")
        for axis, dim in zip(self.axes, self.dims):
            if not 0 <= coord_kwargs[axis] < dim:
                raise AssertionError(f"key {coord_kwargs} invalid: {axis} must be in [0, {dim})")
        return sum(coord_kwargs[a] * s for a, s in zip(self.axes, self._strides()))

    def get_coord(self, rank: int) -> Any:
        """The coordinate (a ``ProcessCoord`` namedtuple) of ``rank``."""
        if not 0 <= rank < self.world_size():
            raise ValueError(f"rank {rank} not found in topology.")
        return self.ProcessCoord(*((rank // s) % d for s, d in zip(self._strides(), self.dims)))

    def get_axis_names(self) -> list[str]:
        """The axis names, outermost first."""
        return self.axes

    def get_dim(self, axis: str) -> int:
        """The length of ``axis`` (0 when the topology has no such axis)."""
        return self.dims[self.axes.index(axis)] if axis in self.axes else 0

    def world_size(self) -> int:
        """The number of ranks the topology covers."""
        return math.prod(self.dims)

    def get_rank_repr(
        self,
        rank: int,
        omit_axes: Sequence[str] = ("data", "pipe"),
        inner_sep: str = "_",
        outer_sep: str = "-",
    ) -> str:
        """``rank``'s coordinate as text, e.g. ``'model_01'`` (used in checkpoint file names)."""
        coord = self.get_coord(rank)
        return outer_sep.join(
            f"{axis}{inner_sep}{getattr(coord, axis):02d}" for axis in self.axes if axis not in set(omit_axes)
        )

    # ------------------------------------------------------------------ groups of ranks
    def get_axis_comm_lists(self, axis: str) -> list[list[int]]:
        """The rank lists that differ only along ``axis`` (one communicator each); [] for an unknown axis."""
        if axis not in self.axes:
            return []
        others = [a for a in self.axes if a != axis]
        lists = []
        for values in itertools.product(*(range(self.get_dim(a)) for a in others)):
            fixed = dict(zip(others, values))
            lists.append([self.get_rank(**fixed, **{axis: i}) for i in range(self.get_dim(axis))])
        return lists

    def filter_match(self, **filter_kwargs: int) -> list[int]:
        """The ranks whose coordinates equal every given axis value, in rank order."""
        return [
            rank
            for rank in range(self.world_size())
            if all(getattr(self.get_coord(rank), k) == v for k, v in filter_kwargs.items())
        ]

    def get_axis_list(self, axis: str, idx: int) -> list[int]:
        """The ranks whose coordinate along ``axis`` is ``idx``."""
        return self.filter_match(**{axis: idx})

    def __str__(self) -> str:
        return str(self.mapping)


def _prime_factors(n: int) -> list[int]:
    """The prime factors of ``n`` in ascending order (``[]`` for 1); ValueError for ``n <= 0``."""
    if n <= 0:
        raise ValueError(f"cannot factor {n}: only positive integers have prime factors")
    factors, p = [], 2
    while n > 1:
        while n % p == 0:
            factors.append(p)
            n //= p
        p += 1
    return factors


class PipeDataParallelTopology(ProcessTopology):
    """Pipeline x data parallelism: axes ``['pipe', 'data']`` (data ranks adjacent)."""

    def __init__(self, num_pp: int, num_dp: int) -> None:
        super().__init__(axes=["pipe", "data"], dims=[num_pp, num_dp])


class PipeModelDataParallelTopology(ProcessTopology):
    """Pipeline x data x tensor (model) parallelism: axes ``['pipe', 'data', 'model']``."""

    def __init__(self, num_pp: int, num_mp: int, num_dp: int) -> None:
        super().__init__(axes=["pipe", "data", "model"], dims=[num_pp, num_dp, num_mp])
