"""The elastic batch search, DeepSpeed's v0.1 and v0.2 algorithms (spec 10.2) as pure functions:
:func:`get_compatible_gpus_v01` and :func:`get_compatible_gpus_v02`."""

from __future__ import annotations

import bisect
import math

from shardwise.elasticity.block_rules import ElasticityConfigError, ElasticityIncompatibleWorldSize, _is_int

__all__ = ["HCN_LIST", "get_compatible_gpus_v01", "get_compatible_gpus_v02"]


# The 38 smallest highly composite numbers: each has more divisors than any smaller number,
# which is what makes them good multipliers for a batch that many GPU counts must divide.
HCN_LIST: tuple[int, ...] = (
    1, 2, 4, 6, 12, 24, 36, 48, 60, 120, 180, 240, 360, 720, 840, 1260, 1680, 2520, 5040, 7560, 10080,
    15120, 20160, 25200, 27720, 45360, 50400, 55440, 83160, 110880, 166320, 221760, 277200, 332640,
    498960, 554400, 665280, 720720,
)  # fmt: skip


def _divisors(n: int) -> list[int]:
    small = [i for i in range(1, math.isqrt(n) + 1) if n % i == 0]
    return small + [n // i for i in reversed(small) if i * i != n]


def _valid_gpus(batch: int, micro_batches: list[int], min_gpus: int, max_gpus: int) -> list[int]:
    """GPU counts that run ``batch`` exactly with some micro batch (spec 10.2 step 3)."""
    valid: set[int] = set()
    for micro in micro_batches:
        if batch % micro:
            continue
        gpus = batch // micro
        if min_gpus <= gpus <= max_gpus:
            valid.add(gpus)
        # Proper divisors up to gpus // 2: these GPU counts run the batch with more accumulation steps.
        valid.update(i for i in _divisors(gpus) if i <= gpus // 2 and min_gpus <= i <= max_gpus)
    return sorted(valid)


def _best_batch(
    micro_batches: list[int], max_batch: int, min_gpus: int, max_gpus: int, prefer_larger: bool
) -> tuple[int, list[int]]:
    """v0.1 steps 1-4 without the empty-result check; the result's GPU list may be empty."""
    bases = [*micro_batches, math.lcm(*micro_batches)]
    candidates: list[int] = []
    for base in bases:
        if base > max_batch:
            continue
        # Largest highly composite number H with H * base <= max_batch.
        candidate = (
            base
            if base == max_batch
            else HCN_LIST[bisect.bisect_right(HCN_LIST, max_batch // base) - 1] * base
        )
        if candidate not in candidates:
            candidates.append(candidate)

    final, best = min(micro_batches), list[int]()
    for batch in candidates:
        valid = _valid_gpus(batch, micro_batches, min_gpus, max_gpus)
        tie_wins = batch > final if prefer_larger else batch < final
        if len(valid) > len(best) or (len(valid) == len(best) and tie_wins):
            final, best = batch, valid
    return final, best


def get_compatible_gpus_v01(
    micro_batches: list[int],
    max_batch: int,
    min_gpus: int | None = None,
    max_gpus: int | None = None,
    prefer_larger: bool = True,
) -> tuple[int, list[int]]:
    """Elasticity v0.1: the batch size <= ``max_batch`` that the most GPU counts can run.

    Args:
        micro_batches: acceptable per-GPU micro batch sizes.
        max_batch: ceiling on the global batch size.
        min_gpus: smallest GPU count to consider (default 1).
        max_gpus: largest GPU count to consider (default ``max_batch // min(micro_batches)``).
        prefer_larger: on a tie in the number of valid GPU counts, take the larger batch.

    Returns:
        ``(final_batch_size, sorted valid GPU counts)``.

    Raises:
        ElasticityConfigError: a micro batch exceeds ``max_batch``, or no GPU count in
            ``[min_gpus, max_gpus]`` fits any candidate.

    Example:
        >>> batch, gpus = get_compatible_gpus_v01([2, 4, 6], 2000)
        >>> batch, len(gpus), gpus[-1]
        (1680, 32, 840)
    """
    micro_batches = list(micro_batches)
    if not micro_batches or any(not _is_int(m) or m <= 0 for m in micro_batches):
        raise ElasticityConfigError(f"micro batches must be positive integers, got {micro_batches!r}.")
    if any(m > max_batch for m in micro_batches):
        raise ElasticityConfigError(
            f"All micro batches must be <= max_train_batch_size ({max_batch}), got {micro_batches}."
        )
    min_gpus = 1 if min_gpus is None else min_gpus
    max_gpus = max_batch // min(micro_batches) if max_gpus is None else max_gpus
    final, valid = _best_batch(micro_batches, max_batch, min_gpus, max_gpus, prefer_larger)
    if not valid:
        raise ElasticityConfigError(
            f"No GPU count in [{min_gpus}, {max_gpus}] can run any batch size <= {max_batch} with micro "
            f"batches {micro_batches}; widen min_gpus/max_gpus or raise max_train_batch_size."
        )
    return final, valid


def _pick_micro_batch(micro_batches: list[int], per_rank_batch: int, prefer_larger: bool) -> int | None:
    """First micro batch (list order) dividing ``per_rank_batch``, or the largest such when preferred."""
    fitting = [m for m in micro_batches if per_rank_batch % m == 0]
    if not fitting:
        return None
    return max(fitting) if prefer_larger else fitting[0]


def get_compatible_gpus_v02(
    micro_batches: list[int],
    max_batch: int,
    current_num_gpus: int,
    min_gpus: int,
    max_gpus: int,
    prefer_larger: bool = True,
    num_gpus_per_node: int = 1,
    model_parallel_size: int = 1,
) -> tuple[int, list[int], int | None]:
    """Elasticity v0.2: v0.1 at node granularity, or a batch fitted to the current world size.

    Returns:
        ``(final_batch_size, valid data-parallel sizes, micro batch for current_num_gpus)``.

    Raises:
        ElasticityConfigError: ``num_gpus_per_node`` is not a multiple of
            ``model_parallel_size``, or the node-level problem has no solution.
        ElasticityIncompatibleWorldSize: ``current_num_gpus`` is not a multiple of
            ``model_parallel_size``, or is too large for even one smallest micro batch each.

    Example:
        >>> get_compatible_gpus_v02([8, 12], 1000, 64, 32, 1500, num_gpus_per_node=8)
        (768, [32, 48, 64, 96], 12)
    """
    micro_batches = list(micro_batches)
    if num_gpus_per_node % model_parallel_size != 0:
        raise ElasticityConfigError(
            f"num_gpus_per_node ({num_gpus_per_node}) must be a multiple of model_parallel_size ({model_parallel_size})."
        )
    if current_num_gpus <= 0 or current_num_gpus % model_parallel_size != 0:
        raise ElasticityIncompatibleWorldSize(
            f"World size {current_num_gpus} must be a positive multiple of model_parallel_size ({model_parallel_size})."
        )
    dp_per_node = num_gpus_per_node // model_parallel_size
    current_dp = current_num_gpus // model_parallel_size

    node_max_batch = max_batch // dp_per_node
    if any(m > node_max_batch for m in micro_batches):
        raise ElasticityConfigError(
            f"max_train_batch_size {max_batch} spread over {dp_per_node} data-parallel ranks per node leaves "
            f"{node_max_batch} per node, below a micro batch in {micro_batches}; raise max_train_batch_size."
        )
    node_batch, node_counts = _best_batch(
        micro_batches,
        node_max_batch,
        min_gpus // num_gpus_per_node,
        max_gpus // num_gpus_per_node,
        prefer_larger,
    )
    if not node_counts:
        raise ElasticityConfigError(
            f"No node count in [{min_gpus // num_gpus_per_node}, {max_gpus // num_gpus_per_node}] "
            f"(min_gpus/max_gpus divided by num_gpus_per_node={num_gpus_per_node}) fits micro batches "
            f"{micro_batches}; widen min_gpus/max_gpus."
        )
    final = node_batch * dp_per_node
    valid_dp = [n * dp_per_node for n in node_counts]
    if current_dp in valid_dp:
        return final, valid_dp, _pick_micro_batch(micro_batches, final // current_dp, prefer_larger)

    # The current world size is not among the elastic ones: fit the batch to it instead.
    candidates = [(max_batch // (m * current_dp)) * m * current_dp for m in micro_batches]
    final = max(candidates) if prefer_larger else min(candidates)
    if final == 0:
        raise ElasticityIncompatibleWorldSize(
            f"World size {current_num_gpus} (data-parallel size {current_dp}) is too large: even micro batch "
            f"{min(micro_batches)} per rank exceeds max_train_batch_size {max_batch}."
        )
    return final, [current_dp], _pick_micro_batch(micro_batches, final // current_dp, prefer_larger)
