"""The candidate experiments: ZeRO stage x micro batch x the config's own lists of values.

The base ds_config may hold lists where it wants a search (DeepSpeed's tuning space):
``"zero_optimization": {"stage": [1, 2], "reduce_bucket_size": [5e7, 5e8]}``; ``"stage": "all"``
or no stage means stages 0-3, a single stage tunes only that stage. Micro batch sizes run in
powers of two from ``min_train_micro_batch_size_per_gpu`` to ``max_train_micro_batch_size_per_gpu``
(and at most ``max_train_batch_size / data-parallel ranks``); gradient accumulation reaches
``max_train_batch_size`` when it is set, else keeps the config's. Outside ``fast`` mode, stages
1-3 also try ``overlap_comm`` and ``reduce_bucket_size`` (unless the config lists its own values);
in ``fast`` mode only the micro batch is tuned per stage (a listed key takes its first value).

Example:
    >>> c = Candidate(stage=2, micro_batch=4, grad_accum=2)
    >>> c.name, c.ds_config({"optimizer": {"type": "Adam"}}, dp_size=2)["train_batch_size"]
    ('z2_mbs4_gas2', 16)
"""

from __future__ import annotations

import copy
import itertools
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

__all__ = ["Candidate", "TuningSpace", "build_space", "micro_batch_ladder", "spread"]

ALL_STAGES = (0, 1, 2, 3)
NON_FAST_DEFAULTS: dict[str, list[Any]] = {"overlap_comm": [True, False], "reduce_bucket_size": [5e7, 5e8]}
"""Extra zero keys tried at stages 1-3 outside fast mode when the config lists none of its own."""
BATCH_KEYS = ("train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps")
OFFLOAD_KEYS = ("offload_optimizer", "offload_param", "cpu_offload", "cpu_offload_param")


@dataclass(frozen=True)
class Candidate:
    """One experiment's settings (everything else comes from the base config).

    Attributes:
        stage: ZeRO stage.
        micro_batch: ``train_micro_batch_size_per_gpu``.
        grad_accum: ``gradient_accumulation_steps``.
        zero_extra: other ``zero_optimization`` keys, sorted ``(key, value)`` pairs.
        offload: optimizer state (and, at stage 3, parameters) offloaded to host memory.
    """

    stage: int
    micro_batch: int
    grad_accum: int
    zero_extra: tuple[tuple[str, Any], ...] = ()
    offload: bool = False

    @property
    def name(self) -> str:
        """A file-safe name, e.g. ``z2_mbs8_gas1_overlap_comm-False``."""
        parts = [f"z{self.stage}", f"mbs{self.micro_batch}", f"gas{self.grad_accum}"]
        parts += [
            f"{key}-{value:g}" if isinstance(value, float) else f"{key}-{value}"
            for key, value in self.zero_extra
        ]
        if self.offload:
            parts.append("offload")
        return "_".join(parts)

    def ds_config(self, base: Mapping[str, Any], dp_size: int) -> dict[str, Any]:
        """The base config with this candidate's settings (tuning lists replaced by values)."""
        config = copy.deepcopy(dict(base))
        zero = dict(config.get("zero_optimization") or {})
        offload_blocks = {key: zero.pop(key) for key in OFFLOAD_KEYS if key in zero}
        for key, value in list(zero.items()):
            if isinstance(value, list):
                zero[key] = value[0]
        zero["stage"] = self.stage
        zero.update(dict(self.zero_extra))
        if self.offload:
            zero["offload_optimizer"] = offload_blocks.get("offload_optimizer") or {"device": "cpu"}
            if self.stage == 3:
                zero["offload_param"] = offload_blocks.get("offload_param") or {"device": "cpu"}
        config["zero_optimization"] = zero
        config["train_micro_batch_size_per_gpu"] = self.micro_batch
        config["gradient_accumulation_steps"] = self.grad_accum
        config["train_batch_size"] = self.micro_batch * self.grad_accum * dp_size
        return config

    def as_dict(self) -> dict[str, Any]:
        """Plain values for the experiment's record."""
        return {
            "stage": self.stage,
            "micro_batch": self.micro_batch,
            "grad_accum": self.grad_accum,
            "zero_extra": dict(self.zero_extra),
            "offload": self.offload,
        }


@dataclass(frozen=True)
class TuningSpace:
    """What the search varies, read from the base config and the ``autotuning`` section.

    Attributes:
        stages: ZeRO stages to try.
        micro_batches: the micro batch ladder (before the memory plan prunes it).
        extra: per stage, the other zero keys and their values.
        grad_accum: gradient accumulation per micro batch size.
    """

    stages: tuple[int, ...]
    micro_batches: tuple[int, ...]
    extra: Mapping[int, Mapping[str, Sequence[Any]]] = field(default_factory=dict)
    grad_accum: Mapping[int, int] = field(default_factory=dict)

    def candidates(self, stage: int, micro_batches: Sequence[int] | None = None) -> list[Candidate]:
        """Every candidate of ``stage`` (for the given micro batches, default the whole ladder)."""
        extra = self.extra.get(stage, {})
        keys = sorted(extra)
        out = []
        for micro in micro_batches if micro_batches is not None else self.micro_batches:
            for values in itertools.product(*(extra[key] for key in keys)):
                out.append(Candidate(stage, micro, self.grad_accum.get(micro, 1), tuple(zip(keys, values))))
        return out


def micro_batch_ladder(low: int, high: int) -> list[int]:
    """Powers of two from ``low`` to ``high``, both ends included.

    Example:
        >>> micro_batch_ladder(1, 12), micro_batch_ladder(3, 3)
        ([1, 2, 4, 8, 12], [3])
    """
    if high < low:
        return []
    ladder = [low]
    value = 2 ** math.ceil(math.log2(low)) if low > 1 else 2
    while value < high:
        if value > low:
            ladder.append(value)
        value *= 2
    if high != low:
        ladder.append(high)
    return ladder


def spread(values: Sequence[int], count: int) -> list[int]:
    """``count`` values evenly spread over ``values`` (first and last included).

    Example:
        >>> spread([1, 2, 4, 8, 16, 32], 3), spread([1, 2], 3)
        ([1, 4, 32], [1, 2])
    """
    if len(values) <= count:
        return list(values)
    if count == 1:
        return [values[-1]]
    picks = sorted({round(i * (len(values) - 1) / (count - 1)) for i in range(count)})
    return [values[i] for i in picks]


def _stages(zero: Mapping[str, Any]) -> tuple[int, ...]:
    stage = zero.get("stage", "all")
    if stage == "all":
        return ALL_STAGES
    if isinstance(stage, list):
        stages = tuple(sorted({int(s) for s in stage}))
    else:
        stages = (int(stage),)
    bad = [s for s in stages if s not in ALL_STAGES]
    if bad:
        raise ValueError(
            f"zero_optimization.stage = {stage!r}: the tuning space holds stages {bad} outside 0-3. "
            'Give a stage 0-3, a list of them, or "all".'
        )
    return stages


def build_space(base: Mapping[str, Any], settings: Any, dp_size: int) -> TuningSpace:
    """The tuning space of a base config (which may hold lists) and an ``autotuning`` section."""
    zero = dict(base.get("zero_optimization") or {})
    stages = _stages(zero)
    high = settings.max_train_micro_batch_size_per_gpu
    if settings.max_train_batch_size is not None:
        high = min(high, settings.max_train_batch_size // dp_size)
    low = settings.min_train_micro_batch_size_per_gpu
    if high < low:
        raise ValueError(
            f"autotuning: no micro batch size to try: min_train_micro_batch_size_per_gpu = {low} is above the "
            f"largest allowed, {high} (max_train_micro_batch_size_per_gpu, or max_train_batch_size = "
            f"{settings.max_train_batch_size} / {dp_size} data-parallel ranks). Lower the minimum or raise the maxima."
        )
    ladder = micro_batch_ladder(low, high)
    listed = {key: value for key, value in zero.items() if isinstance(value, list) and key != "stage"}
    extra: dict[int, dict[str, list[Any]]] = {}
    for stage in stages:
        if settings.fast:
            extra[stage] = {}  # micro batch only; a listed key keeps its first value (Candidate.ds_config)
        elif listed:
            extra[stage] = dict(listed)
        else:
            extra[stage] = dict(NON_FAST_DEFAULTS) if stage > 0 else {}
    given = base.get("gradient_accumulation_steps")
    accum: dict[int, int] = {}
    for micro in ladder:
        if settings.max_train_batch_size is not None:
            accum[micro] = max(1, settings.max_train_batch_size // (micro * dp_size))
        else:
            accum[micro] = int(given) if isinstance(given, int) and given > 0 else 1
    return TuningSpace(tuple(stages), tuple(ladder), extra, accum)
