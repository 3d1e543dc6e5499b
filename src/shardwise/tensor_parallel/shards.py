"""How one weight dimension is cut into tensor-parallel slices, and put back (no communication).

A :class:`Split` records, for one parameter, the dimension that is cut, the sub-parameters
packed along it (one for a plain weight; three for a fused ``qkv``; two for a packed
``gate_up``) and every rank's share of each. A rank's local slice is the concatenation of its
share of every sub-parameter, so a fused projection keeps its ``[q | k | v]`` layout locally.
:meth:`Split.local` cuts a whole tensor; :meth:`Split.whole` rebuilds it from every rank's slice
(checkpoints save whole tensors).

Example:
    >>> import torch
    >>> split = Split.plan(dim=0, total=6, parts=2, sub_sizes=(4, 2))
    >>> split.rank_sizes
    ((2, 1), (2, 1))
    >>> full = torch.arange(6.0)
    >>> [split.local(full, r).tolist() for r in range(2)]
    [[0.0, 1.0, 4.0], [2.0, 3.0, 5.0]]
    >>> split.whole([split.local(full, r) for r in range(2)]).tolist()
    [0.0, 1.0, 2.0, 3.0, 4.0, 5.0]
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

__all__ = ["Split", "shard_sizes"]


def shard_sizes(total: int, parts: int, unit: int = 1) -> tuple[int, ...]:
    """``total`` cut into ``parts`` near-equal pieces, whole multiples of ``unit`` (the first ranks
    take the remainder, one unit each).

    Example:
        >>> shard_sizes(10, 4), shard_sizes(64, 2, unit=16), shard_sizes(48, 2, unit=16)
        ((3, 3, 2, 2), (32, 32), (32, 16))
    """
    if total % unit:
        raise ValueError(f"a dimension of {total} does not divide into units of {unit}")
    units = total // unit
    base, extra = divmod(units, parts)
    return tuple((base + (1 if rank < extra else 0)) * unit for rank in range(parts))


@dataclass(frozen=True)
class Split:
    """One parameter's cut: dimension ``dim`` of a tensor whose size there is ``total``.

    Attributes:
        dim: the dimension cut.
        total: the whole size of that dimension.
        rank_sizes: per rank, its share of each packed sub-parameter.
    """

    dim: int
    total: int
    rank_sizes: tuple[tuple[int, ...], ...]

    @classmethod
    def plan(cls, *, dim: int, total: int, parts: int, sub_sizes: Sequence[int] = (), unit: int = 1) -> Split:
        """Cut ``total`` (made of ``sub_sizes`` packed pieces; one piece when empty) into ``parts``."""
        subs = tuple(sub_sizes) or (total,)
        if sum(subs) != total:
            raise ValueError(f"sub-parameter sizes {subs} do not add up to the dimension's {total}")
        per_sub = [shard_sizes(size, parts, unit if len(subs) == 1 else 1) for size in subs]
        return cls(dim=dim, total=total, rank_sizes=tuple(tuple(s[r] for s in per_sub) for r in range(parts)))

    @property
    def parts(self) -> int:
        """How many ranks share the dimension."""
        return len(self.rank_sizes)

    def local_size(self, rank: int) -> int:
        """The size of ``rank``'s slice along :attr:`dim`."""
        return sum(self.rank_sizes[rank])

    def local(self, full: torch.Tensor, rank: int) -> torch.Tensor:
        """``rank``'s slice of the whole tensor ``full`` (a new contiguous tensor)."""
        if full.shape[self.dim] != self.total:
            raise ValueError(f"tensor of shape {tuple(full.shape)} has {full.shape[self.dim]} along dim "
                             f"{self.dim}, expected {self.total}")
        pieces, start = [], 0
        for index in range(len(self.rank_sizes[0])):
            sizes = [self.rank_sizes[r][index] for r in range(self.parts)]
            offset = start + sum(sizes[:rank])
            pieces.append(full.narrow(self.dim, offset, sizes[rank]))
            start += sum(sizes)
        return torch.cat(pieces, dim=self.dim).contiguous()

    def whole(self, locals_: Sequence[torch.Tensor]) -> torch.Tensor:
        """The whole tensor from every rank's slice (in rank order)."""
        pieces: list[torch.Tensor] = []
        cut = [list(t.split(list(self.rank_sizes[r]), dim=self.dim)) for r, t in enumerate(locals_)]
        for index in range(len(self.rank_sizes[0])):
            pieces.extend(cut[r][index] for r in range(self.parts))
        return torch.cat(pieces, dim=self.dim)
