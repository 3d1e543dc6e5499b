"""Pure arithmetic of the Ulysses layouts: which heads and which tokens each rank holds.

Ulysses moves between two shardings of the same attention input: the *sequence* sharding
(rank ``r`` holds tokens ``[r*s/p, (r+1)*s/p)`` of every head) and the *head* sharding (rank ``r``
holds every token of its heads). Heads are split as DeepSpeed splits them: by key/value groups,
the first ``kv % p`` ranks taking one group more, so a query head always lands on the rank that
holds its key/value head (grouped-query attention), and an uneven count (7 heads on 2 ranks)
works.

Example:
    >>> head_shard_sizes(num_heads=7, world_size=2)
    [4, 3]
    >>> head_shard_sizes(num_heads=8, world_size=2, num_kv_heads=2)
    [4, 4]
    >>> sequence_dim(batch_dim_idx=0), sequence_dim(batch_dim_idx=1)
    (1, 0)
    >>> padded_length(10, 4)
    12
"""

from __future__ import annotations

__all__ = [
    "HEAD_DIM",
    "get_shard_size_list",
    "head_shard_sizes",
    "padded_length",
    "sequence_dim",
    "shard_bounds",
]

HEAD_DIM = 2
"""The heads dimension of a 4-D attention tensor, ``[b, s, h, d]`` or ``[s, b, h, d]``."""


def sequence_dim(batch_dim_idx: int) -> int:
    """The sequence dimension of a 4-D attention tensor whose batch dimension is ``batch_dim_idx``.

    Raises:
        ValueError: ``batch_dim_idx`` is not 0 (``[b, s, h, d]``) or 1 (``[s, b, h, d]``).
    """
    if batch_dim_idx not in (0, 1):
        raise ValueError(
            f"batch_dim_idx={batch_dim_idx!r}: Ulysses tensors are [b, s, h, d] (batch_dim_idx=0) or "
            "[s, b, h, d] (batch_dim_idx=1); pass 0 or 1"
        )
    return 1 - batch_dim_idx


def head_shard_sizes(num_heads: int, world_size: int, num_kv_heads: int | None = None) -> list[int]:
    """How many of ``num_heads`` heads each of ``world_size`` ranks holds, in rank order.

    Args:
        num_heads: heads of the tensor being split (query heads, or key/value heads).
        world_size: the sequence-parallel degree.
        num_kv_heads: the key/value head count the split follows (default: ``num_heads``).

    Raises:
        ValueError: fewer key/value heads than ranks (a rank would have none), or ``num_heads``
            not a multiple of ``num_kv_heads``.
    """
    groups = num_heads if num_kv_heads is None else num_kv_heads
    if groups < world_size:
        raise ValueError(
            f"{groups} key/value heads cannot be split over a sequence-parallel group of {world_size}: "
            "every rank needs at least one head; use a sequence_parallel_size of at most the head count"
        )
    if num_heads % groups:
        raise ValueError(
            f"{num_heads} heads are not a multiple of num_kv_heads={groups}; pass the model's key/value head count"
        )
    per_group = num_heads // groups
    return [
        per_group * (groups // world_size + (1 if r < groups % world_size else 0)) for r in range(world_size)
    ]


def shard_bounds(length: int, world_size: int, rank: int) -> tuple[int, int]:
    """``[start, stop)`` of ``rank``'s contiguous slice of a sequence of ``length`` split evenly.

    Raises:
        ValueError: ``length`` is not divisible by ``world_size``.
    """
    if length % world_size:
        raise ValueError(
            f"sequence length {length} is not divisible by the sequence-parallel size {world_size}; "
            f"pad it to {padded_length(length, world_size)} (labels -100, see shardwise.sequence.loss)"
        )
    chunk = length // world_size
    return rank * chunk, (rank + 1) * chunk


def padded_length(length: int, multiple: int) -> int:
    """``length`` rounded up to a multiple of ``multiple``."""
    return -(-length // multiple) * multiple


def get_shard_size_list(
    total_size: int, mp_size: int, meta: object = None, name: str | None = None
) -> list[int]:
    """DeepSpeed's ``module_inject.tp_shard.get_shard_size_list``: each rank's share of ``total_size``.

    With ``meta.num_kv_heads`` dividing ``total_size`` (and ``name`` not an MLP or ``lm_head``
    weight) the split follows key/value heads (:func:`head_shard_sizes`); otherwise it is near-even
    in units of ``meta.tp_grain_size`` (default 1), the first ranks taking one unit more and the last
    rank the remainder below one unit.

    Example:
        >>> get_shard_size_list(7, 2), get_shard_size_list(10, 4)
        ([4, 3], [3, 3, 2, 2])
    """
    kv = getattr(meta, "num_kv_heads", None)
    grain = int(getattr(meta, "tp_grain_size", 1) or 1)
    excluded = name is not None and (
        "mlp" in name
        or name in ("lm_head", "embed_out")
        or any(s in name for s in ("gate_proj", "up_proj", "down_proj", "w1", "w2", "w3"))
    )
    if kv is not None and total_size % kv == 0 and not excluded:
        return head_shard_sizes(total_size, mp_size, kv)
    if total_size < grain:
        return [total_size // mp_size + (1 if r < total_size % mp_size else 0) for r in range(mp_size)]
    units, remainder = divmod(total_size, grain)
    sizes = [(units // mp_size + (1 if r < units % mp_size else 0)) * grain for r in range(mp_size)]
    sizes[-1] += remainder
    return sizes
