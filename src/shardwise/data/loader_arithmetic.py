"""The data loader's pure arithmetic: batches per pass, the sampler positions a resumed pass skips,
and the seed of a pass's workers (:mod:`shardwise.data.loader`); testable without a process group."""

from __future__ import annotations

import math

__all__ = ["num_batches", "resume_skip", "worker_base_seed"]


def num_batches(num_samples: int, batch_size: int, drop_last: bool) -> int:
    """Batches in one pass over ``num_samples`` samples: a ceiling, or a floor with ``drop_last``.

    Example:
        >>> num_batches(5, 2, drop_last=False), num_batches(5, 2, drop_last=True)
        (3, 2)
    """
    if drop_last:
        return num_samples // batch_size
    return math.ceil(num_samples / batch_size)


def resume_skip(
    *,
    batches_consumed: int,
    samples_consumed: int | None,
    saved_batch_size: int,
    saved_world_size: int,
    batch_size: int,
    world_size: int,
) -> int:
    """How many of this rank's sampler positions a resumed pass must skip.

    With the same batch size and world size the answer is exact: ``batches * batch_size``.
    When the topology changed, ``samples_consumed`` (positions consumed in the epoch's shared
    permutation, all ranks together) is used instead: ``DistributedSampler`` deals the shared
    permutation out round-robin, so rank ``r`` of ``W`` holds positions ``r, r+W, r+2W, ...`` and
    the first ``k`` global positions are the first ``k // W`` of every rank's slice. If ``k`` is
    not a multiple of ``W`` a few samples are seen twice rather than never.

    Example:
        >>> resume_skip(batches_consumed=2, samples_consumed=8, saved_batch_size=2,
        ...             saved_world_size=2, batch_size=2, world_size=2)
        4
        >>> resume_skip(batches_consumed=2, samples_consumed=8, saved_batch_size=2,
        ...             saved_world_size=2, batch_size=1, world_size=4)
        2
    """
    if saved_batch_size == batch_size and saved_world_size == world_size:
        return batches_consumed * batch_size
    if samples_consumed is None:
        samples_consumed = batches_consumed * saved_batch_size * saved_world_size
    return samples_consumed // world_size


def worker_base_seed(seed: int, epoch: int, rank: int) -> int:
    """A deterministic base seed for a pass's DataLoader workers.

    torch draws each pass's worker base seed from the loader's generator, or from the global RNG
    when it has none; the latter would shift the user's model RNG on every epoch and make a
    resumed run diverge. A private generator seeded from ``(seed, epoch, rank)`` avoids both.
    The multipliers are large odd constants, so nearby inputs map to well separated seeds.
    """
    mixed = seed * 0x9E3779B97F4A7C15 + epoch * 0xBF58476D1CE4E5B9 + rank * 0x94D049BB133111EB
    return mixed % (2**63 - 1)
