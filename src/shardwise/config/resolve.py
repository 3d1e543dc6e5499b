"""``load_config``: from a path, dict or JSON string to a validated, fully resolved config.

The pipeline, in order (each step is a function of its own module):

1. read the source (``loading``), 2. rewrite legacy spellings (``compat``),
3. set aside unknown top-level keys (warning with did-you-mean; an error when strict),
4. resolve ``"auto"`` (``auto``), 5. resolve the batch triple (``batch``),
6. validate every section (pydantic models in ``sections``) and the rules across sections
   (``checks``); the optimizer and scheduler are checked by ``shardwise.preflight``, above,
7. list the settings shardwise ignores (``inert``; errors when strict), 8. record provenance.

All problems found in steps 5-7 are reported together in one ``ConfigError``.
"""

from __future__ import annotations

import copy
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, cast

from pydantic import ValidationError

from shardwise.config.auto import BATCH_KEYS, AutoResolver, ResolutionContext, get_path, model_field_at
from shardwise.config.batch import BatchSizes, resolve_batch_sizes
from shardwise.config.checks import cross_section_errors
from shardwise.config.compat import FP16_ONLY_KEYS, normalize_legacy
from shardwise.config.errors import ConfigError, ConfigErrors, did_you_mean, looks_like_placeholder
from shardwise.config.inert import IgnoredSetting, ignored_settings
from shardwise.config.loading import read_config_source
from shardwise.config.mapping_view import DeepSpeedKeyView
from shardwise.config.model import ShardwiseConfig
from shardwise.config.provenance import Provenance, Source
from shardwise.utils.logging import logger

# keys users put at the top level that live inside a section
_TOP_LEVEL_HOMES = {
    "stage": "zero_optimization.stage",
    "loss_scale": "fp16.loss_scale",
    "lr": "optimizer.params.lr",
    "offload_optimizer": "zero_optimization.offload_optimizer",
    "offload_param": "zero_optimization.offload_param",
    "reduce_bucket_size": "zero_optimization.reduce_bucket_size",
    "overlap_comm": "zero_optimization.overlap_comm",
}


@dataclass
class ResolvedConfig(DeepSpeedKeyView):
    """A validated config with every ``"auto"`` resolved, plus where each value came from.

    Sections are reached through the typed ``config`` (``resolved.config.zero_optimization.stage``);
    the batch triple lives there too and :attr:`batch` reads it. ``warnings`` are the notes of
    resolution (legacy spellings, unknown keys, builders' warnings); ``ignored`` the settings
    shardwise accepts without acting on them (``config.inert``). Reads like DeepSpeed's config dict
    too: ``resolved.get("zero_optimization", {})``, ``resolved["fp16"]``, ``"bf16" in resolved``.
    """

    config: ShardwiseConfig
    sources: dict[str, Provenance]
    warnings: list[str]
    origin: str
    world_size: int
    batch_world_size: int  # the data-parallel size the batch rule used (world / sequence parallel)
    batch_derived: frozenset[str] = frozenset()  # batch keys computed rather than given
    unknown_keys: dict[str, Any] = field(default_factory=dict)
    ignored: list[IgnoredSetting] = field(default_factory=list)

    @property
    def batch(self) -> BatchSizes:
        """The batch triple, read from ``config`` (its one home), and the world size it was resolved for."""
        config = self.config
        tbs, mbs, gas = (
            config.train_batch_size,
            config.train_micro_batch_size_per_gpu,
            config.gradient_accumulation_steps,
        )
        assert tbs is not None and mbs is not None and gas is not None  # filled by load_config
        return BatchSizes(tbs, mbs, gas, self.batch_world_size, self.batch_derived)

    def set_batch(
        self, train_batch_size: int, micro_batch_per_gpu: int, gradient_accumulation_steps: int
    ) -> None:
        """Change the batch triple (``engine.set_train_batch_size``); :attr:`batch` and
        :meth:`to_ds_dict` (what a checkpoint records) follow."""
        self.config = self.config.model_copy(
            update={
                "train_batch_size": train_batch_size,
                "train_micro_batch_size_per_gpu": micro_batch_per_gpu,
                "gradient_accumulation_steps": gradient_accumulation_steps,
            }
        )

    def to_ds_dict(self) -> dict[str, Any]:
        """The fully resolved config as JSON-ready data with DeepSpeed's key names."""
        return self.config.model_dump(mode="json", by_alias=True)

    def flat(self) -> dict[str, Any]:
        """Every resolved leaf value by dotted key path."""
        return _flatten(self.to_ds_dict())


def _flatten(tree: object, prefix: str = "") -> dict[str, object]:
    out: dict[str, Any] = {}
    if isinstance(tree, Mapping) and tree:
        for key, value in tree.items():
            out.update(_flatten(value, f"{prefix}{key}."))
    else:
        out[prefix[:-1]] = tree
    return out


def _section_home(key: str) -> str | None:
    """The section a misplaced key belongs to, e.g. ``loss_scale`` -> ``fp16``."""
    if key in FP16_ONLY_KEYS:
        return "fp16"
    for name, info in ShardwiseConfig.model_fields.items():
        from shardwise.config.auto import _model_in

        sub = _model_in(info.annotation)
        if sub is not None and key in sub.model_fields:
            return name
    return None


def _translate(err: Mapping[str, Any]) -> ConfigError:
    """One pydantic error -> a ConfigError with key path, value, rule and fix."""
    loc = [str(p) for p in err["loc"]]
    path = ".".join(loc)
    kind = err["type"]
    value = err.get("input")
    if kind == "extra_forbidden":
        parent = ".".join(loc[:-1])
        located = model_field_at(ShardwiseConfig, parent) if parent else None
        choices: list[str] = list(ShardwiseConfig.model_fields)
        if located is not None:
            from shardwise.config.auto import _is_dict_of_models, _model_in

            annotation = located[0].model_fields[located[1]].annotation
            sub = _model_in(annotation) or _is_dict_of_models(annotation)
            choices = list(sub.model_fields) if sub is not None else []
        elif len(loc) >= 3:
            # the parent is a user-named entry of a dict of models (curriculum_metrics.<name>)
            holder = model_field_at(ShardwiseConfig, ".".join(loc[:-2]))
            if holder is not None:
                from shardwise.config.auto import _is_dict_of_models

                entry = _is_dict_of_models(holder[0].model_fields[holder[1]].annotation)
                choices = list(entry.model_fields) if entry is not None else choices
        key = loc[-1]
        suggestion = did_you_mean(key, choices)
        home = _section_home(key)
        if suggestion:
            fix = f"did you mean '{suggestion}'?"
        elif home and home != parent:
            fix = f"'{key}' belongs in the '{home}' section; move it there"
        else:
            fix = f"remove it; '{parent or 'the top level'}' accepts: {', '.join(sorted(choices))}"
        return ConfigError(path, f"unknown key in '{parent}'", fix, value=value)
    if looks_like_placeholder(value):
        return ConfigError(
            path,
            f"looks like an unfilled template placeholder ({err['msg']})",
            "substitute the real value before passing the file (e.g. with your launch script's templating)",
            value=value,
        )
    rule = err["msg"]
    ctx = err.get("ctx") or {}
    if kind in ("literal_error", "enum") and "expected" in ctx:
        fix = f"use one of {ctx['expected']}"
    elif kind.startswith("int_") or kind in ("int_parsing", "int_from_float"):
        fix = "write a whole number (5e8 is fine; 1.5 is not)"
    elif kind.startswith("bool"):
        fix = "write true or false"
    elif kind in ("greater_than", "greater_than_equal", "less_than_equal", "less_than"):
        fix = "pick a value inside the allowed range"
    elif kind == "value_error":
        rule = rule.removeprefix("Value error, ")
        fix = "see the rule above"
    else:
        fix = "check the type and value against the config reference"
    return ConfigError(path or "", rule, fix, value=value)


# Sections DeepSpeed reads with dict.get (spec 1.5) and the removed legacy sections:
# real files carry extra keys there (Megatron's pipeline options, old eigenvalue keys),
# so an unknown key is a warning with did-you-mean, and an error only in strict mode.
LENIENT_SECTIONS = frozenset(
    {
        "checkpoint",
        "aio",
        "activation_checkpointing",
        "flops_profiler",
        "autotuning",
        "data_efficiency",
        "pipeline",
        "data_types",
        "compression_training",
        "sparse_attention",
        "elasticity",
        "progressive_layer_drop",
        "eigenvalue",
        "quantize_training",
        "curriculum_learning",
        "amp",
        "nebula",
    }
)


def _drop_path(raw: dict[str, Any], loc: tuple[Any, ...]) -> None:
    node: Any = raw
    for part in loc[:-1]:
        node = node[part] if isinstance(node, dict) else node[int(part)]
    node.pop(loc[-1], None)


def _validate(
    raw: dict[str, object], strict: bool, warnings: list[str]
) -> tuple[ShardwiseConfig | None, list[ConfigError]]:
    try:
        return ShardwiseConfig.model_validate(raw), []
    except ValidationError as exc:
        errors = exc.errors()
    lenient = [e for e in errors if e["type"] == "extra_forbidden" and str(e["loc"][0]) in LENIENT_SECTIONS]
    if strict or not lenient:
        return None, [_translate(e) for e in errors]
    for err in lenient:
        translated = _translate(err)
        warnings.append(f"unknown key '{translated.key}' ignored; {translated.fix}")
        _drop_path(raw, err["loc"])
    try:
        return ShardwiseConfig.model_validate(raw), []
    except ValidationError as exc:
        return None, [_translate(e) for e in exc.errors()]


def _tensor_parallel_world_batch(raw: dict[str, object], dp_world: int) -> list[str]:
    """DeepSpeed checks ``train_batch_size`` of an AutoTP config against the whole world (its
    tensor-parallel ranks counted as data-parallel ones, DeepSpeed issue 7298), and the HF Trainer
    fills ``"auto"`` that way. A batch of exactly ``micro x accumulation x dp x autotp_size`` is read
    as that arithmetic: the step's batch is ``micro x accumulation x dp`` and the warning says so."""
    section = raw.get("tensor_parallel")
    tp = section.get("autotp_size") if isinstance(section, dict) else None
    tbs, mbs, gas = (raw.get(k) for k in ("train_batch_size", "train_micro_batch_size_per_gpu",
                                          "gradient_accumulation_steps"))
    numbers = (tp, tbs, mbs, gas)
    if not all(isinstance(v, int) and not isinstance(v, bool) for v in numbers):
        return []
    tp, tbs, mbs, gas = cast("tuple[int, int, int, int]", numbers)
    if tp <= 1:
        return []
    if tbs != mbs * gas * dp_world * tp:
        return []
    raw["train_batch_size"] = mbs * gas * dp_world
    return [
        f"train_batch_size = {tbs} counts the {tp} tensor-parallel ranks as data-parallel ranks (DeepSpeed's "
        f"arithmetic; the HF Trainer fills \"auto\" so, DeepSpeed issue 7298): tensor-parallel ranks share one "
        f"batch, so each optimizer step takes {mbs} x {gas} x {dp_world} data-parallel rank(s) = "
        f"{raw['train_batch_size']} samples; set train_batch_size to {raw['train_batch_size']} to silence this"
    ]


def _world_size_for_batch(raw: Mapping[str, object], world_size: int) -> int:
    sp = raw.get("sequence_parallel_size")
    if isinstance(sp, int) and sp > 1:
        if world_size % sp:
            raise ConfigError(
                "sequence_parallel_size",
                f"must divide the world size {world_size}",
                "pick a divisor of the number of ranks",
                value=sp,
            )
        return world_size // sp
    return world_size


def _batch_inputs(raw: dict[str, object], resolver: AutoResolver, ctx: ResolutionContext) -> None:
    """Apply the batch ``"auto"`` rules before the arithmetic (see ``auto`` docstring)."""
    tbs_key, mbs_key, gas_key = BATCH_KEYS
    autos = resolver.batch_autos
    # "train_batch_size": "auto" with no micro batch asks for a derived batch just as much
    if mbs_key in autos or (tbs_key in autos and raw.get(mbs_key) is None):
        if ctx.loader_batch_size:
            raw[mbs_key] = ctx.loader_batch_size
            resolver.provenance[mbs_key] = Provenance(
                Source.AUTO, "batch size of the data loader given to initialize"
            )
        elif raw.get(tbs_key) is None:
            raw[mbs_key] = 1
            resolver.provenance[mbs_key] = Provenance(
                Source.AUTO, "default 1: no data loader or batch size given"
            )
            resolver.warnings.append(
                'train_micro_batch_size_per_gpu is "auto" with nothing to derive it from; using 1. '
                "Pass training_data to initialize or overrides={'train_micro_batch_size_per_gpu': N}."
            )
    if gas_key in autos and not (raw.get(tbs_key) is not None and raw.get(mbs_key) is not None):
        raw[gas_key] = 1
        resolver.provenance[gas_key] = Provenance(Source.AUTO, "default 1 (no accumulation)")


def _apply_elasticity(
    raw: dict[str, object], normalized: Mapping[str, object], world_size: int, resolver: AutoResolver
) -> None:
    """With ``elasticity.enabled``, the batch triple comes from the elastic algorithm (spec 10.5)."""
    block = raw.get("elasticity")
    if not (isinstance(block, Mapping) and block.get("enabled") is True):
        return
    from shardwise.elasticity import ElasticityError, elastic_batch_for_world_size, reject_explicit_batch_keys

    explicit = {k: v for k, v in normalized.items() if k in BATCH_KEYS}
    try:
        reject_explicit_batch_keys({"elasticity": block, **explicit})
        tbs, mbs, gas = elastic_batch_for_world_size({"elasticity": block}, world_size)
    except ElasticityError as exc:
        raise ConfigError(
            "elasticity", str(exc), "adjust the elasticity block or the number of ranks"
        ) from exc
    for key, value in zip(BATCH_KEYS, (tbs, mbs, gas)):
        raw[key] = value
        resolver.provenance[key] = Provenance(Source.DERIVED, f"elasticity for world size {world_size}")


def _provenance(
    final: Mapping[str, object],
    normalized: Mapping[str, object],
    resolver: AutoResolver,
    renamed: Mapping[str, str],
    batch: BatchSizes,
) -> dict[str, Provenance]:
    batch_notes = {
        "train_batch_size": "micro x accumulation x world",
        "train_micro_batch_size_per_gpu": "train_batch_size // world // accumulation",
        "gradient_accumulation_steps": "train_batch_size // micro // world",
    }
    out: dict[str, Provenance] = {}
    for path in _flatten(final):
        owner = next((p for p in _prefixes(path) if p in resolver.provenance), None)
        if owner is not None:
            out[path] = resolver.provenance[owner]
        elif path in batch.derived:
            out[path] = Provenance(Source.DERIVED, f"{batch_notes[path]} (world size {batch.world_size})")
        elif path in renamed:
            out[path] = Provenance(Source.FILE, f"legacy spelling '{renamed[path]}'")
        elif get_path(normalized, path, default=_ABSENT) is not _ABSENT:
            out[path] = Provenance(Source.FILE)
        else:
            out[path] = Provenance(Source.DEFAULT)
    return out


_ABSENT = object()


def _prefixes(path: str) -> list[str]:
    """``a.b.c`` -> ``["a.b.c", "a.b", "a"]``: an override of a block covers its leaves."""
    parts = path.split(".")
    return [".".join(parts[:i]) for i in range(len(parts), 0, -1)]


def load_config(
    source: str | os.PathLike[str] | Mapping[str, Any],
    *,
    world_size: int | None = None,
    overrides: Mapping[str, Any] | None = None,
    context: ResolutionContext | None = None,
    strict: bool = False,
) -> ResolvedConfig:
    """Read, normalise, resolve and validate a DeepSpeed config.

    Args:
        source: a path (JSON or hjson), a dict, or JSON / base64 text.
        world_size: data-parallel world size for the batch rule (default: ``context`` or 1).
        overrides: dotted key path -> value, filling ``"auto"`` or missing keys.
        context: objects from ``initialize`` that can resolve ``"auto"``.
        strict: unknown keys and ignored settings (``config.inert``) become errors instead of warnings.

    Raises:
        ConfigError: every problem found, each with key, value, rule and fix.

    Example:
        >>> cfg = load_config({"train_batch_size": 32, "train_micro_batch_size_per_gpu": 4}, world_size=4)
        >>> cfg.batch.gradient_accumulation_steps, cfg.config.zero_optimization.stage
        (2, 0)
    """
    ctx = context or ResolutionContext()
    if world_size is not None or overrides is not None:
        ctx = ResolutionContext(
            world_size=world_size if world_size is not None else ctx.world_size,
            overrides={**ctx.overrides, **(overrides or {})},
            optimizer_hparams=ctx.optimizer_hparams,
            hidden_size=ctx.hidden_size,
            loader_batch_size=ctx.loader_batch_size,
            total_training_steps=ctx.total_training_steps,
        )
    raw, origin = read_config_source(source)
    compat = normalize_legacy(raw)
    warnings = list(compat.warnings)

    unknown = {k: raw.pop(k) for k in list(raw) if k not in ShardwiseConfig.model_fields}
    errors: list[ConfigError] = []
    for key in unknown:
        suggestion = did_you_mean(key, ShardwiseConfig.model_fields)
        home = _TOP_LEVEL_HOMES.get(key)
        hint = f"did you mean '{suggestion}'?" if suggestion else f"it belongs at '{home}'" if home else ""
        if strict:
            errors.append(
                ConfigError(
                    key,
                    "unknown top-level key (strict mode)",
                    hint or "remove it, or run without --strict",
                    value=unknown[key],
                )
            )
        else:
            warnings.append(f"unknown top-level key '{key}' ignored" + (f"; {hint}" if hint else ""))

    normalized = copy.deepcopy(raw)
    resolver = AutoResolver(ctx, ShardwiseConfig)
    resolver.resolve(raw)
    _batch_inputs(raw, resolver, ctx)
    warnings.extend(resolver.warnings)

    batch: BatchSizes | None = None
    try:
        dp_world = _world_size_for_batch(raw, ctx.world_size)
        warnings.extend(_tensor_parallel_world_batch(raw, dp_world))
        _apply_elasticity(raw, normalized, dp_world, resolver)
        batch = resolve_batch_sizes(
            raw.get("train_batch_size"),
            raw.get("train_micro_batch_size_per_gpu"),
            raw.get("gradient_accumulation_steps"),
            dp_world,
        )
    except ConfigError as exc:
        near = [
            f"'{k}' (did you mean '{did_you_mean(k, BATCH_KEYS)}'?)"
            for k in unknown
            if did_you_mean(k, BATCH_KEYS)
        ]
        if near:
            exc = ConfigError(
                exc.key,
                exc.rule,
                exc.fix + f"; note the unknown key(s) {', '.join(near)}",
                exc.value if exc.has_value else None,
            )
        errors.append(exc)
    if batch is not None:
        raw["train_batch_size"] = batch.train_batch_size
        raw["train_micro_batch_size_per_gpu"] = batch.micro_batch_per_gpu
        raw["gradient_accumulation_steps"] = batch.gradient_accumulation_steps

    config, validation_errors = _validate(raw, strict, warnings)
    # A batch or elasticity mistake already reported above is not reported again by the sections.
    reported = {e.key for e in errors} & {"elasticity"}
    errors.extend(
        e
        for e in validation_errors
        if (e.key not in BATCH_KEYS or batch is not None) and e.key.split(".")[0] not in reported
    )
    ignored: list[IgnoredSetting] = []
    if config is not None:
        errors.extend(cross_section_errors(config))
        ignored = ignored_settings(config, batch.world_size if batch is not None else ctx.world_size)
        if strict:
            errors.extend(setting.as_error() for setting in ignored)
    if errors:
        raise errors[0] if len(errors) == 1 else ConfigErrors(errors)
    assert config is not None and batch is not None  # internal: no errors means both exist

    for text in warnings:
        logger.warning(text)
    for setting in ignored:
        logger.warning(setting.message)
    final = config.model_dump(mode="json", by_alias=True)
    sources = _provenance(final, normalized, resolver, compat.renamed, batch)
    return ResolvedConfig(
        config,
        sources,
        warnings,
        origin,
        ctx.world_size,
        batch_world_size=batch.world_size,
        batch_derived=batch.derived,
        unknown_keys=unknown,
        ignored=ignored,
    )
