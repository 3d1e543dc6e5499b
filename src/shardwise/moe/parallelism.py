"""Where an MoE layer's expert-parallel group comes from: the one process layout.

``expert_parallel_group(ep_size, source=...)`` declares ``ep=ep_size`` with
:func:`shardwise.comm.mesh.ensure_layout` (collective; a second, different degree is refused there,
naming both sources) and returns the ``"ep"`` group of this rank (None for ``ep_size == 1``) and its rank in it.
Expert groups are runs of ``ep_size`` consecutive data-parallel ranks; the expert-data-parallel
group (``"edp"``) is the strided rest, as DeepSpeed builds them.
"""

from __future__ import annotations

from shardwise.comm import mesh
from shardwise.comm.group_type import Group


def expert_parallel_group(ep_size: int, *, source: str) -> tuple[Group, int]:
    """This rank's expert-parallel group of ``ep_size`` ranks (None when ``ep_size == 1``) and its
    place in it."""
    if ep_size == 1:
        return None, 0
    topology = mesh.ensure_layout(ep=ep_size, source=source)
    return topology.group_of("ep"), topology.rank_in("ep")
