"""Which weights split how: DeepSpeed AutoTP's layer specs, read from ``partition_config`` (pure).

A :class:`LayerSpec` names parameters by regular expressions (``re.match`` on the dotted
parameter name, e.g. ``model.layers.0.self_attn.q_proj.weight``) and says how the layer that
owns them is split over the tensor-parallel ranks:

* ``column``: the output dimension is split (``weight`` rows, ``bias``); the layer's input is
  replicated, its output is this rank's slice (or gathered whole with ``gather_output``);
* ``row``: the input dimension is split (``weight`` columns); the partial outputs are summed
  over the ranks, the bias added once;
* ``skip``: left whole (``grad_allreduce``: its gradient summed over the ranks, for a
  replicated parameter applied to sharded activations).

A :class:`PartitionPlan` is the ordered list of specs plus the ``lm_head`` names and the
``strict_mode`` flag; the first matching spec wins, as in DeepSpeed.

Example:
    >>> plan = plan_from_dict({"layer_specs": [{"patterns": [r".*\\.o_proj\\.weight$"], "partition_type": "row"}]})
    >>> plan.find("model.layers.0.self_attn.o_proj.weight").partition_type
    'row'
    >>> plan.find("model.norm.weight") is None
    True
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

__all__ = ["PARTITION_TYPES", "LayerSpec", "PartitionPlan", "merge_plans", "plan_from_dict"]

PARTITION_TYPES = ("column", "row", "skip")
_KEY = "tensor_parallel.partition_config"
_PLAN_KEYS = frozenset(
    {"layer_specs", "use_default_specs", "strict_mode", "lm_head_patterns", "embedding_partition_dim", "tp_size"}
)
_SPEC_KEYS = frozenset(
    {"patterns", "partition_type", "gather_output", "grad_allreduce", "shape", "partition_dim", "model_types"}
)


def _fail(key: str, value: object, rule: str, fix: str) -> ValueError:
    return ValueError(f"{key} = {value!r}: {rule}; {fix}")


@dataclass(frozen=True)
class LayerSpec:
    """How the layer owning the matched parameters is split.

    Attributes:
        patterns: regular expressions matched (``re.match``) against dotted parameter names.
        partition_type: ``"column"``, ``"row"`` or ``"skip"``.
        gather_output: column layers only: all-gather the output so every rank has it whole.
        grad_allreduce: skip layers only: sum the parameter's gradient over the tensor-parallel ranks.
        shape: the weight's logical shape before splitting, ``-1`` inferred; a tuple at the
            partition dimension lists unequal sub-parameter sizes (a fused ``qkv``), an int there
            the count of equal ones; each sub-parameter is split separately.
        partition_dim: the dimension of ``shape`` to split (default 0 for column, 1 for row).
        model_types: apply only to models whose ``config.model_type`` is one of these.
    """

    patterns: tuple[str, ...]
    partition_type: str = "column"
    gather_output: bool = False
    grad_allreduce: bool = False
    shape: tuple[Any, ...] | None = None
    partition_dim: int | None = None
    model_types: tuple[str, ...] | None = None

    def __post_init__(self) -> None:
        if self.partition_type not in PARTITION_TYPES:
            raise _fail(f"{_KEY}.layer_specs[].partition_type", self.partition_type,
                        f"it must be one of {', '.join(PARTITION_TYPES)}", "spell the split of the layer")
        for pattern in self.patterns:
            try:
                re.compile(pattern)
            except re.error as error:
                raise _fail(f"{_KEY}.layer_specs[].patterns", pattern, f"not a regular expression ({error})",
                            "write a Python regex matching parameter names") from error
        if self.shape is not None:
            self._check_shape()

    def _check_shape(self) -> None:
        dim = self.split_dim
        where = f"{_KEY}.layer_specs[].shape"
        if not 0 <= dim < len(self.shape or ()):
            raise _fail(where, self.shape, f"partition_dim {dim} is outside the shape",
                        "give partition_dim inside the shape")
        for index, size in enumerate(self.shape or ()):
            if isinstance(size, tuple):
                if index != dim or not size or not all(isinstance(s, int) and s > 0 for s in size):
                    raise _fail(where, self.shape, "a tuple of positive sizes is allowed only at partition_dim",
                                "list the sub-parameter sizes at the split dimension")
            elif not isinstance(size, int) or size == 0 or size < -1:
                raise _fail(where, self.shape, "sizes must be positive ints or -1", "fix the shape")

    @property
    def split_dim(self) -> int:
        """The dimension split: ``partition_dim``, else 0 for column and 1 for row layers."""
        if self.partition_dim is not None:
            return self.partition_dim
        return 0 if self.partition_type == "column" else 1

    def matches(self, name: str, model_type: str | None = None) -> bool:
        """Whether this spec applies to parameter ``name`` of a model of ``model_type``."""
        wanted = {m.lower() for m in self.model_types or ()}
        if self.model_types is not None and (model_type is None or model_type.lower() not in wanted):
            return False
        return any(re.match(pattern, name) for pattern in self.patterns)


@dataclass(frozen=True)
class PartitionPlan:
    """The ordered specs of one model (first match wins) and how unmatched layers are treated.

    Attributes:
        specs: the layer specs, highest priority first.
        lm_head_patterns: module names (last component) that are the output head.
        strict_mode: an unmatched ``nn.Linear`` is an error instead of staying whole.
        use_default_specs: merge with the preset's specs (custom ones first).
        embedding_partition_dim: the dimension an embedding matched by a spec is split on.
    """

    specs: tuple[LayerSpec, ...] = ()
    lm_head_patterns: tuple[str, ...] = ("lm_head", "embed_out")
    strict_mode: bool = False
    use_default_specs: bool = True
    embedding_partition_dim: int = 1

    def find(self, name: str, model_type: str | None = None) -> LayerSpec | None:
        """The first spec matching parameter ``name``, or None."""
        return next((spec for spec in self.specs if spec.matches(name, model_type)), None)

    def is_lm_head(self, module_name: str) -> bool:
        """Whether the module called ``module_name`` is the output head (by its last component)."""
        return module_name.rsplit(".", 1)[-1] in self.lm_head_patterns


def _as_shape(value: object) -> tuple[Any, ...] | None:
    if value is None:
        return None
    if not isinstance(value, list | tuple):
        raise _fail(f"{_KEY}.layer_specs[].shape", value, "it must be a list", "write e.g. [3, -1]")
    return tuple(tuple(v) if isinstance(v, list | tuple) else v for v in value)


def _spec_from_dict(index: int, raw: object) -> LayerSpec:
    where = f"{_KEY}.layer_specs[{index}]"
    if not isinstance(raw, Mapping):
        raise _fail(where, raw, "each layer spec is an object", 'write {"patterns": [...], "partition_type": "row"}')
    unknown = sorted(set(raw) - _SPEC_KEYS)
    if unknown:
        raise _fail(f"{where}.{unknown[0]}", raw[unknown[0]], "not a layer-spec key",
                    f"use only {', '.join(sorted(_SPEC_KEYS))}")
    patterns = raw.get("patterns", [])
    if isinstance(patterns, str) or not isinstance(patterns, Sequence) or not patterns:
        raise _fail(f"{where}.patterns", patterns, "a non-empty list of regular expressions is required",
                    'write e.g. [".*\\\\.o_proj\\\\.weight$"]')
    kind = raw.get("partition_type", "column")
    types = raw.get("model_types")
    return LayerSpec(
        patterns=tuple(str(p) for p in patterns),
        partition_type=str(kind).lower(),
        gather_output=bool(raw.get("gather_output", False)),
        grad_allreduce=bool(raw.get("grad_allreduce", False)),
        shape=_as_shape(raw.get("shape")),
        partition_dim=raw.get("partition_dim"),
        model_types=tuple(str(t) for t in types) if types is not None else None,
    )


def plan_from_dict(raw: Mapping[str, Any]) -> PartitionPlan:
    """Read ``tensor_parallel.partition_config`` into a :class:`PartitionPlan`.

    Raises:
        ValueError: naming the key, the value, the rule and the fix.
    """
    unknown = sorted(set(raw) - _PLAN_KEYS)
    if unknown:
        raise _fail(f"{_KEY}.{unknown[0]}", raw[unknown[0]], "not a partition_config key",
                    f"use only {', '.join(sorted(_PLAN_KEYS))}")
    specs = raw.get("layer_specs", [])
    if not isinstance(specs, Sequence) or isinstance(specs, str):
        raise _fail(f"{_KEY}.layer_specs", specs, "it must be a list of layer specs", "write a JSON list")
    heads = raw.get("lm_head_patterns", ["lm_head", "embed_out"])
    return PartitionPlan(
        specs=tuple(_spec_from_dict(i, s) for i, s in enumerate(specs)),
        lm_head_patterns=tuple(str(h) for h in heads),
        strict_mode=bool(raw.get("strict_mode", False)),
        use_default_specs=bool(raw.get("use_default_specs", True)),
        embedding_partition_dim=int(raw.get("embedding_partition_dim", 1)),
    )


def merge_plans(base: PartitionPlan, override: PartitionPlan) -> PartitionPlan:
    """``override``'s specs before ``base``'s (a preset), with ``override``'s flags."""
    return PartitionPlan(
        specs=(*override.specs, *base.specs),
        lm_head_patterns=override.lm_head_patterns or base.lm_head_patterns,
        strict_mode=override.strict_mode,
        use_default_specs=override.use_default_specs,
        embedding_partition_dim=override.embedding_partition_dim,
    )
