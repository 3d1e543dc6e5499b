"""Resolving ``"auto"`` values, with a documented rule and a recorded source for each.

HF Accelerate/Transformers fill ``"auto"`` before calling DeepSpeed; DeepSpeed itself
drops it from some sections and crashes on it elsewhere (spec 1.4). We resolve it
ourselves, in this order of preference (the first that applies wins):

1. **override**: a value the caller passed in ``overrides`` (dotted key path).
2. **derived**: computed from other config values (``train_batch_size`` from micro
   batch x accumulation x world; ``scheduler.params.warmup_max_lr`` from the optimizer lr).
3. **objects given to initialize** (``ResolutionContext``): the client optimizer's
   hyperparameters, the model's hidden size (bucket sizes: ``h*h``, ``0.9*h*h``,
   ``10*h``), the data loader's batch size, the planned number of training steps.
4. **documented default**: the section default (``bf16.enabled: "auto"`` -> false, as in
   DeepSpeed), or the default listed in ``AUTO_DEFAULTS``; a default that is a guess
   (micro batch 1, total_num_steps) also logs a warning naming the override to use.

The rule table is the documentation: ``config explain`` prints the rule used per key.
"""

from __future__ import annotations

import typing
from collections.abc import Mapping
from dataclasses import dataclass, field

from pydantic import BaseModel

from shardwise.config.errors import ConfigError
from shardwise.config.provenance import Provenance, Source

AUTO = "auto"
BATCH_KEYS = ("train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps")
# fields where the string "auto" is a real value, not a request to resolve
LITERAL_AUTO_FIELDS = {"data_types.keep_in_fp32_modules", "pipeline.stages"}

# optimizer hyperparameter defaults by JSON name (lower case); torch classes are introspected
_ADAM_LIKE = {"lr": 1e-3, "betas": [0.9, 0.999], "eps": 1e-8, "weight_decay": 0.0}
OPTIMIZER_DEFAULTS: dict[str, dict[str, object]] = {
    "adam": _ADAM_LIKE,
    "adamw": _ADAM_LIKE,
    "onebitadam": _ADAM_LIKE,
    "zerooneadam": _ADAM_LIKE,
    "lamb": _ADAM_LIKE,
    "onebitlamb": _ADAM_LIKE,
    "lion": {"lr": 1e-3, "betas": [0.9, 0.999], "weight_decay": 0.0},
    "adagrad": {"lr": 1e-2, "eps": 1e-10, "weight_decay": 0.0},
}
SCHEDULER_DEFAULTS: dict[str, object] = {
    "warmup_min_lr": 0.0,
    "warmup_num_steps": 1000,
    "warmup_type": "log",
    "warmup_min_ratio": 0.0,
    "cos_min_ratio": 0.0001,
    "decay_lr_rate": 0.0,
    "cycle_first_step_size": 2000,
    "cycle_momentum": True,
    "cycle_min_mom": 0.8,
    "cycle_max_mom": 0.9,
    "decay_mom_rate": 0.0,
    "decay_step_size": 0,
    "lr_range_test_min_lr": 1e-3,
    "lr_range_test_step_size": 2000,
    "lr_range_test_step_rate": 1.0,
    "lr_range_test_staircase": False,
}
# the last-resort total_num_steps when nothing tells us the run length (logged as a warning)
DEFAULT_TOTAL_NUM_STEPS = 10_000


@dataclass(frozen=True)
class ResolutionContext:
    """Everything outside the file that may resolve an ``"auto"``.

    Attributes:
        world_size: data-parallel world size used for batch arithmetic.
        overrides: dotted key path -> value, applied to ``"auto"`` or missing keys.
        optimizer_hparams: the client optimizer's first param group (lr, betas, eps, ...).
        hidden_size: the model's hidden size, for ZeRO bucket sizes.
        loader_batch_size: batch size of a data loader handed to initialize.
        total_training_steps: planned optimizer steps, for schedulers' total_num_steps.
    """

    world_size: int = 1
    overrides: Mapping[str, object] = field(default_factory=dict)
    optimizer_hparams: Mapping[str, object] | None = None
    hidden_size: int | None = None
    loader_batch_size: int | None = None
    total_training_steps: int | None = None


# ---------------------------------------------------------------- dotted paths


def get_path(tree: Mapping[str, object], path: str, default: object = None) -> object:
    """Value at a dotted path, or ``default``."""
    node: object = tree
    for part in path.split("."):
        if not isinstance(node, Mapping) or part not in node:
            return default
        node = node[part]
    return node


def set_path(tree: dict[str, object], path: str, value: object) -> None:
    """Set a dotted path, creating dicts on the way."""
    parts = path.split(".")
    node = tree
    for part in parts[:-1]:
        nxt = node.get(part)
        if not isinstance(nxt, dict):
            nxt = {}
            node[part] = nxt
        node = nxt
    node[parts[-1]] = value


def delete_path(tree: dict[str, object], path: str) -> None:
    """Remove a dotted path if present."""
    parts = path.split(".")
    node: object = tree
    for part in parts[:-1]:
        node = node.get(part) if isinstance(node, dict) else None
    if isinstance(node, dict):
        node.pop(parts[-1], None)


def find_auto_paths(tree: object, prefix: str = "") -> list[str]:
    """All dotted paths whose value is the string ``"auto"`` (any case)."""
    found: list[str] = []
    if isinstance(tree, Mapping):
        for key, value in tree.items():
            path = f"{prefix}{key}"
            if isinstance(value, str) and value.strip().lower() == AUTO and path not in LITERAL_AUTO_FIELDS:
                found.append(path)
            else:
                found.extend(find_auto_paths(value, path + "."))
    elif isinstance(tree, list):
        for i, value in enumerate(tree):
            if isinstance(value, str) and value.strip().lower() == AUTO:
                found.append(f"{prefix}{i}" if prefix else str(i))
            elif isinstance(value, Mapping | list):
                found.extend(find_auto_paths(value, f"{prefix}{i}."))
    return found


# ---------------------------------------------------------------- model introspection


def _model_in(annotation: object) -> type[BaseModel] | None:
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation
    for arg in typing.get_args(annotation):
        found = _model_in(arg)
        if found is not None:
            return found
    return None


def _is_dict_of_models(annotation: object) -> type[BaseModel] | None:
    for candidate in (annotation, *typing.get_args(annotation)):
        if typing.get_origin(candidate) is dict:
            args = typing.get_args(candidate)
            if len(args) == 2:
                return _model_in(args[1])
    return None


def model_field_at(root: type[BaseModel], path: str) -> tuple[type[BaseModel], str] | None:
    """The (model class, field name) that a dotted path lands on, or None if free-form."""
    model: type[BaseModel] | None = root
    parts = path.split(".")
    i = 0
    while model is not None and i < len(parts):
        name = parts[i]
        if name not in model.model_fields:
            return None
        if i == len(parts) - 1:
            return model, name
        annotation = model.model_fields[name].annotation
        nested = _model_in(annotation)
        dict_model = _is_dict_of_models(annotation)
        if dict_model is not None:
            model, i = dict_model, i + 2  # skip the user-chosen key
            continue
        model, i = nested, i + 1
    return None


# ---------------------------------------------------------------- the rules


def _optimizer_default(opt_type: str, key: str) -> object:
    table = OPTIMIZER_DEFAULTS.get(opt_type.lower())
    if table is not None and key in table:
        return table[key]
    import inspect

    import torch.optim  # only when a torch optimizer's defaults are needed

    cls = getattr(torch.optim, opt_type, None)
    if cls is not None:
        param = inspect.signature(cls).parameters.get(key)
        if param is not None and param.default is not inspect.Parameter.empty:
            default = param.default
            return list(default) if isinstance(default, tuple) else default
    raise ConfigError(
        f"optimizer.params.{key}",
        f'is "auto" but optimizer {opt_type!r} has no default for {key!r}',
        f"give a value, or pass overrides={{'optimizer.params.{key}': ...}}",
        value=AUTO,
    )


@dataclass
class AutoResolver:
    """Applies overrides and the auto rules to a raw config dict, recording provenance."""

    ctx: ResolutionContext
    root_model: type[BaseModel]
    provenance: dict[str, Provenance] = field(default_factory=dict)
    warnings: list[str] = field(default_factory=list)
    batch_autos: set[str] = field(default_factory=set)

    def apply_overrides(self, raw: dict[str, object]) -> None:
        """Fill ``"auto"`` or missing keys from the caller's overrides; conflicts are errors."""
        for path, value in self.ctx.overrides.items():
            current = get_path(raw, path, default=_MISSING)
            is_auto = isinstance(current, str) and current.strip().lower() == AUTO
            if current is _MISSING or is_auto or current == value:
                set_path(raw, path, value)
                self.provenance[path] = Provenance(Source.OVERRIDE, 'replaced "auto"' if is_auto else "")
            else:
                raise ConfigError(
                    path,
                    f"the file says {current!r} but the caller's override says {value!r}",
                    'make them agree, or write "auto" in the file to let the override decide',
                    value=current,
                )

    def resolve(self, raw: dict[str, object]) -> None:
        """Replace every remaining ``"auto"`` in ``raw`` (in place)."""
        self.apply_overrides(raw)
        autos = find_auto_paths(raw)
        # scheduler rules read the optimizer's resolved lr, so resolve optimizer first
        autos.sort(key=lambda p: (p.startswith("scheduler."), p))
        for path in autos:
            self._resolve_one(raw, path)

    def _set(
        self, raw: dict[str, object], path: str, value: object, note: str, source: Source = Source.AUTO
    ) -> None:
        set_path(raw, path, value)
        self.provenance[path] = Provenance(source, note)

    def _resolve_one(self, raw: dict[str, object], path: str) -> None:
        ctx = self.ctx
        if path in BATCH_KEYS:
            self.batch_autos.add(path)  # resolved with the batch triple
            delete_path(raw, path)
            return
        if path == "gradient_clipping":
            self._set(raw, path, 1.0, "default 1.0 (DeepSpeed >= 0.19.3)")
            return
        hidden = ctx.hidden_size
        bucket_rules = {
            "zero_optimization.reduce_bucket_size": (lambda h: h * h, "hidden_size**2"),
            "zero_optimization.stage3_prefetch_bucket_size": (
                lambda h: int(0.9 * h * h),
                "0.9 * hidden_size**2",
            ),
            "zero_optimization.stage3_param_persistence_threshold": (lambda h: 10 * h, "10 * hidden_size"),
        }
        if path in bucket_rules and hidden:
            fn, text = bucket_rules[path]
            self._set(raw, path, fn(hidden), f"{text} with the model's hidden_size {hidden}")
            return
        if path.startswith("optimizer.params."):
            self._optimizer_param(raw, path)
            return
        if path.startswith("scheduler.params."):
            self._scheduler_param(raw, path)
            return
        located = model_field_at(self.root_model, path)
        if located is not None:
            model, name = located
            delete_path(raw, path)
            info = model.model_fields[name]
            default = info.get_default(call_default_factory=True)
            shown = default.model_dump() if isinstance(default, BaseModel) else default
            self.provenance[path] = Provenance(Source.AUTO, f"section default {shown!r}")
            return
        raise ConfigError(
            path,
            'is "auto", but no rule can resolve it here (it is not a setting with a default)',
            f"write a concrete value, or pass overrides={{'{path}': ...}}",
            value=AUTO,
        )

    def _optimizer_param(self, raw: dict[str, object], path: str) -> None:
        key = path.split(".", 2)[2]
        hparams = self.ctx.optimizer_hparams or {}
        if key in hparams:
            value = hparams[key]
            self._set(
                raw,
                path,
                list(value) if isinstance(value, tuple) else value,
                "from the optimizer passed to initialize",
            )
            return
        opt_type = str(get_path(raw, "optimizer.type", ""))
        self._set(raw, path, _optimizer_default(opt_type, key), f"{opt_type} default")

    def _scheduler_param(self, raw: dict[str, object], path: str) -> None:
        key = path.split(".", 2)[2]
        if key in ("warmup_max_lr", "cycle_max_lr"):
            lr = get_path(raw, "optimizer.params.lr")
            if lr is None and self.ctx.optimizer_hparams:
                lr = self.ctx.optimizer_hparams.get("lr")
            if isinstance(lr, int | float):
                self._set(raw, path, lr, "the optimizer's lr", Source.DERIVED)
                return
            self._set(raw, path, 1e-3, "default 1e-3 (no optimizer lr to copy)")
            return
        if key == "cycle_min_lr":
            self._set(raw, path, 0.0, "default 0.0")
            return
        if key == "total_num_steps":
            if self.ctx.total_training_steps:
                self._set(
                    raw, path, int(self.ctx.total_training_steps), "planned training steps", Source.DERIVED
                )
                return
            warmup = get_path(raw, "scheduler.params.warmup_num_steps")
            total = max(DEFAULT_TOTAL_NUM_STEPS, warmup if isinstance(warmup, int) else 0)
            self._set(raw, path, total, f"default {total}: nothing tells the run length")
            self.warnings.append(
                f'scheduler.params.total_num_steps is "auto" and nothing tells the run length; using {total}. '
                "Pass training_data to initialize or overrides={'scheduler.params.total_num_steps': N}."
            )
            return
        if key in SCHEDULER_DEFAULTS:
            self._set(raw, path, SCHEDULER_DEFAULTS[key], f"scheduler default {SCHEDULER_DEFAULTS[key]!r}")
            return
        raise ConfigError(
            path,
            'is "auto", but this scheduler parameter has no default to fall back to',
            f"write a value, or pass overrides={{'{path}': ...}}",
            value=AUTO,
        )


_MISSING = object()
