"""Human-readable reports of a resolved config: where every value came from."""

from __future__ import annotations

import json

from shardwise.config.provenance import Source
from shardwise.config.resolve import ResolvedConfig
from shardwise.zero.stage3_settings import engine_notes

_ORDER = (Source.OVERRIDE, Source.FILE, Source.AUTO, Source.DERIVED, Source.DEFAULT)
_TITLES = {
    Source.OVERRIDE: "Set by the caller (overrides)",
    Source.FILE: "From the file",
    Source.AUTO: 'Resolved from "auto"',
    Source.DERIVED: "Derived from other values",
    Source.DEFAULT: "Defaults (not in the file)",
}


def _fmt(value: object) -> str:
    if isinstance(value, float) and value.is_integer() and abs(value) >= 1e6:
        return f"{value:.0e}"
    if isinstance(value, int) and not isinstance(value, bool) and abs(value) >= 10**6:
        return f"{value:_}"
    return json.dumps(value) if not isinstance(value, str) else value


def explain(resolved: ResolvedConfig, show_defaults: bool = True) -> str:
    """A table per source: key, value and the rule or note behind it.

    Keys the user set (not defaults) also get what they do on this engine where that
    differs from a plain DeepSpeed reading (``[engine: ...]``: e.g. how a stage-3 knob maps
    onto FSDP2, or that a key is accepted but has no effect).

    Example:
        >>> from shardwise.config import load_config
        >>> print(explain(load_config({"train_batch_size": 8}), show_defaults=False))  # doctest: +ELLIPSIS
        config: <dict>  (world size 1)
        ...
    """
    flat = resolved.flat()
    config, batch = resolved.config, resolved.batch
    lines = [f"config: {resolved.origin}  (world size {resolved.world_size})"]
    summary = (
        f"batch: train_batch_size={batch.train_batch_size} = micro {batch.micro_batch_per_gpu}"
        f" x accumulation {batch.gradient_accumulation_steps} x world {batch.world_size}; "
        f"ZeRO stage {config.zero_stage}; precision {config.precision}; "
        f"gradient_clipping {config.gradient_clipping}"
    )
    lines.append(summary)
    shown = [k for k in flat if show_defaults or resolved.sources[k].source is not Source.DEFAULT]
    width = max((len(k) for k in shown), default=10)
    user_set = {k for k in flat if resolved.sources[k].source is not Source.DEFAULT}
    on_engine = engine_notes(flat, config.zero_stage, only=user_set)
    for ignored in resolved.ignored:  # every accepted-but-ignored key says so, top-level ones too
        on_engine.setdefault(ignored.path, f"{ignored.verdict}: {ignored.instead}")
    for source in _ORDER:
        if source is Source.DEFAULT and not show_defaults:
            continue
        rows = [(k, v, resolved.sources[k]) for k, v in flat.items() if resolved.sources[k].source is source]
        if not rows:
            continue
        lines.append("")
        lines.append(f"{_TITLES[source]} ({len(rows)}):")
        for key, value, prov in rows:
            note = f"   <- {prov.note}" if prov.note else ""
            engine = f"   [engine: {on_engine[key]}]" if key in on_engine else ""
            lines.append(f"  {key.ljust(width)}  {_fmt(value)}{note}{engine}")
    if resolved.unknown_keys:
        lines.append("")
        lines.append(
            f"Ignored top-level keys (not DeepSpeed settings): {', '.join(sorted(resolved.unknown_keys))}"
        )
    if resolved.warnings:
        lines.append("")
        lines.append("Warnings:")
        lines.extend(f"  - {w}" for w in resolved.warnings)
    return "\n".join(lines)
