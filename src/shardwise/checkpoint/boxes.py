"""Pure maths: a contiguous range of a tensor's flattened elements as rectangular boxes.

ZeRO stages 1-2 give each rank a contiguous range of a flat buffer, so a rank owns an
arbitrary range ``[start, stop)`` of a parameter's *flattened* elements. A checkpoint that
any layout can read back (another world size, another stage, FSDP2's row shards) must
store tensors at their real shapes, in rectangular chunks. A flat range of a row-major
tensor is always the union of at most ``2 * ndim - 1`` rectangular boxes (a partial
last-dimension run, whole rows, another partial run, recursively), and each box is itself
contiguous in the flat order, so it is a ``view`` of the rank's 1-D shard: no copy.

Example, a ``4 x 5`` tensor and the flat range ``[3, 17)``::

    . . . X X      row 0, columns 3-4  -> box offsets (0, 3), sizes (1, 2)
    X X X X X      rows 1-2            -> box offsets (1, 0), sizes (2, 5)
    X X X X X
    X X . . .      row 3, columns 0-1  -> box offsets (3, 0), sizes (1, 2)

No torch here; tested in milliseconds.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class Box:
    """A rectangular chunk of a tensor that is contiguous in its flattened order.

    Attributes:
        offsets: first index of the box in every dimension.
        sizes: extent of the box in every dimension.
        flat_start: position of the box's first element in the tensor's flat order.
    """

    offsets: tuple[int, ...]
    sizes: tuple[int, ...]
    flat_start: int

    @property
    def numel(self) -> int:
        """Elements in the box."""
        return math.prod(self.sizes)


def _strides(shape: Sequence[int]) -> list[int]:
    strides = [1] * len(shape)
    for dim in range(len(shape) - 2, -1, -1):
        strides[dim] = strides[dim + 1] * shape[dim + 1]
    return strides


def _boxes(shape: tuple[int, ...], start: int, stop: int) -> list[tuple[tuple[int, ...], tuple[int, ...]]]:
    """(offsets, sizes) of the boxes covering ``[start, stop)`` (non-empty) of ``shape``."""
    if len(shape) == 1:
        return [((start,), (stop - start,))]
    inner = math.prod(shape[1:])
    first, last = start // inner, (stop - 1) // inner
    if first == last:  # inside one row: recurse into it
        return [
            ((first, *offsets), (1, *sizes))
            for offsets, sizes in _boxes(shape[1:], start - first * inner, stop - first * inner)
        ]
    out: list[tuple[tuple[int, ...], tuple[int, ...]]] = []
    full_from, full_to = first, last + 1
    if start % inner:
        out.extend(((first, *o), (1, *s)) for o, s in _boxes(shape[1:], start % inner, inner))
        full_from = first + 1
    tail = stop % inner
    if tail:
        full_to = last
    if full_to > full_from:
        out.append(((full_from, *([0] * (len(shape) - 1))), (full_to - full_from, *shape[1:])))
    if tail:
        out.extend(((last, *o), (1, *s)) for o, s in _boxes(shape[1:], 0, tail))
    return out


def flat_range_to_boxes(shape: Sequence[int], start: int, stop: int) -> list[Box]:
    """The rectangular boxes that exactly cover elements ``[start, stop)`` of ``shape``.

    Boxes come in flat order; each is contiguous in the flat order, so the elements of box
    ``b`` are ``flat[b.flat_start : b.flat_start + b.numel]`` reshaped to ``b.sizes``.

    Args:
        shape: the tensor's shape (``()`` for a scalar).
        start: first flat element, ``0 <= start``.
        stop: one past the last flat element, ``start <= stop <= numel``.

    Raises:
        ValueError: if the range lies outside the tensor.

    Example:
        >>> [(b.offsets, b.sizes) for b in flat_range_to_boxes((4, 5), 3, 17)]
        [((0, 3), (1, 2)), ((1, 0), (2, 5)), ((3, 0), (1, 2))]
    """
    shape = tuple(int(s) for s in shape)
    numel = math.prod(shape)
    if not 0 <= start <= stop <= numel:
        raise ValueError(
            f"flat range [{start}, {stop}) is outside a tensor of shape {shape} ({numel} elements)"
        )
    if start == stop:
        return []
    if not shape:
        return [Box((), (), 0)]
    strides = _strides(shape)
    return [
        Box(offsets, sizes, sum(o * s for o, s in zip(offsets, strides)))
        for offsets, sizes in _boxes(shape, start, stop)
    ]
