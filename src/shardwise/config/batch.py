"""Batch-size resolution: the train_batch_size = micro * accumulation * world rule.

Pure arithmetic, no torch. The filling rules and the order of the checks are
DeepSpeed's (spec section 2), so a file resolves to the same triple; the messages are
ours and show the numbers and a way to fix them.
"""

from __future__ import annotations

from dataclasses import dataclass

from shardwise.config.errors import ConfigError, looks_like_placeholder

TBS, MBS, GAS = "train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps"

MAX_BATCH_SIZE = 2**31 - 1
"""The largest batch value accepted (each key, and the resolved ``train_batch_size``).

No data loader draws two billion samples per step, and a larger value overflows the int32
indices that samplers and collectives use; such a value is a typo (an exponent too many)."""


@dataclass(frozen=True)
class BatchSizes:
    """A resolved, consistent batch triple and the world size it was resolved for."""

    train_batch_size: int
    micro_batch_per_gpu: int
    gradient_accumulation_steps: int
    world_size: int
    derived: frozenset[str]  # which of the three keys were computed rather than given


def _as_int(key: str, value: object) -> int | None:
    if value is None:
        return None
    if looks_like_placeholder(value):
        raise ConfigError(
            key,
            "looks like an unfilled template placeholder, not a number",
            "substitute the real value before passing the file",
            value=value,
        )
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise ConfigError(key, "must be a positive integer", f'write a number, e.g. "{key}": 8', value=value)
    if isinstance(value, float):
        if not value.is_integer():
            raise ConfigError(
                key, "must be a whole number", f"use {int(value)} or {int(value) + 1}", value=value
            )
        value = int(value)
    if value > MAX_BATCH_SIZE:
        raise ConfigError(
            key,
            f"is larger than the largest batch accepted, 2**31 - 1 = {MAX_BATCH_SIZE}",
            "check the value for a typo; batch sizes are counts of samples",
            value=value,
        )
    return value


def _divisors_hint(total: int, world: int) -> str:
    per_rank = total // world if world and total % world == 0 else None
    if per_rank is None:
        return f"train_batch_size must be a multiple of the world size {world}"
    options = [m for m in range(1, per_rank + 1) if per_rank % m == 0][:6]
    return (
        f"with {world} rank(s) each rank gets {per_rank} samples per step; "
        f"pick a micro batch among {options}{'...' if len(options) == 6 else ''}"
    )


def resolve_batch_sizes(
    train_batch_size: object, micro_batch: object, grad_accum: object, world_size: int
) -> BatchSizes:
    """Fill the missing batch values and check train = micro * accumulation * world.

    Args:
        train_batch_size: ``train_batch_size`` or None.
        micro_batch: ``train_micro_batch_size_per_gpu`` or None.
        grad_accum: ``gradient_accumulation_steps`` or None.
        world_size: the data-parallel world size.

    Raises:
        ConfigError: naming the key, the numbers and a consistent alternative.

    Example:
        >>> b = resolve_batch_sizes(32, 4, None, world_size=4)
        >>> (b.train_batch_size, b.micro_batch_per_gpu, b.gradient_accumulation_steps)
        (32, 4, 2)
    """
    if world_size < 1:
        raise ConfigError("world_size", "must be at least 1", "run on one or more ranks", value=world_size)
    tbs, mbs, gas = _as_int(TBS, train_batch_size), _as_int(MBS, micro_batch), _as_int(GAS, grad_accum)
    given = {k for k, v in ((TBS, tbs), (MBS, mbs), (GAS, gas)) if v is not None}
    if gas is not None and gas <= 0:
        raise ConfigError(GAS, "must be greater than 0", "use 1 for no accumulation", value=gas)
    if tbs is not None and tbs <= 0:
        raise ConfigError(
            TBS, "must be greater than 0", "give the number of samples per optimizer step", value=tbs
        )
    if mbs is not None and mbs <= 0:
        raise ConfigError(
            MBS, "must be greater than 0", "give the number of samples per rank per forward", value=mbs
        )

    if tbs is not None and mbs is not None and gas is None:
        gas = tbs // mbs // world_size
        if gas == 0:
            raise ConfigError(
                TBS,
                f"is smaller than {MBS} ({mbs}) x world size ({world_size}) = {mbs * world_size}, "
                "so gradient_accumulation_steps would be 0",
                f"raise {TBS} to at least {mbs * world_size}, or lower {MBS}; {_divisors_hint(tbs, world_size)}",
                value=tbs,
            )
    elif tbs is not None and gas is not None and mbs is None:
        mbs = tbs // world_size // gas
        if mbs == 0:
            raise ConfigError(
                TBS,
                f"is smaller than {GAS} ({gas}) x world size ({world_size}) = {gas * world_size}, "
                "so the micro batch per rank would be 0",
                f"raise {TBS} to a multiple of {gas * world_size}, or lower {GAS}",
                value=tbs,
            )
    elif mbs is not None and gas is not None and tbs is None:
        tbs = mbs * gas * world_size
    elif tbs is not None and mbs is None and gas is None:
        gas = 1
        mbs = tbs // world_size
        if mbs == 0:
            raise ConfigError(
                TBS,
                f"is smaller than the world size ({world_size}), so each rank would get 0 samples",
                f"set {TBS} to at least {world_size} (a multiple of it)",
                value=tbs,
            )
    elif mbs is not None and tbs is None and gas is None:
        gas = 1
        tbs = mbs * world_size
    elif tbs is None and mbs is None:
        raise ConfigError(
            TBS,
            f"neither {TBS} nor {MBS} is set, so the batch size is unknown"
            + (f" ({GAS}={gas} alone is not enough)" if gas is not None else ""),
            f'add "{MBS}": <samples per rank> (and optionally "{GAS}"), or "{TBS}": <samples per step>',
        )
    assert tbs is not None and mbs is not None and gas is not None  # internal: all branches filled them

    if tbs > MAX_BATCH_SIZE:
        raise ConfigError(
            TBS,
            f"(micro {mbs} x accumulation {gas} x world {world_size}) is larger than the largest batch accepted, "
            f"2**31 - 1 = {MAX_BATCH_SIZE}",
            f"lower {MBS} or {GAS}",
            value=tbs,
        )
    if tbs != mbs * gas * world_size:
        product = mbs * gas * world_size
        if TBS in given and MBS in given and GAS in given:
            fix = (
                f"set {TBS} to {product}, or remove one of the three keys and let it be derived"
                f"; {_divisors_hint(tbs, world_size)}"
            )
        elif MBS not in given and GAS not in given:
            fix = _divisors_hint(tbs, world_size)
        elif GAS not in given:
            fix = f"{TBS} must be a multiple of {MBS} x world size = {mbs * world_size}; {_divisors_hint(tbs, world_size)}"
        else:
            fix = f"{TBS} must be a multiple of {GAS} x world size = {gas * world_size}; {_divisors_hint(tbs, world_size)}"
        raise ConfigError(
            TBS,
            f"must equal {MBS} x {GAS} x world size, but {tbs} != {mbs} x {gas} x {world_size} = {product}",
            fix,
            value=tbs,
        )
    return BatchSizes(tbs, mbs, gas, world_size, frozenset({TBS, MBS, GAS} - given))
