"""Legacy spellings and misplaced keys, rewritten to today's form in one place.

Each rewrite returns a note (shown by ``config explain`` and logged as a warning when
it changes meaning), so a user can see that ``cpu_offload: true`` became
``offload_optimizer.device: cpu``. Giving an old and a new spelling of the same key
together is an error: we cannot know which one was meant.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from shardwise.config.errors import ConfigError

# short name -> documented stage-3 name (both accepted; documented name is canonical)
STAGE3_ALIASES = {
    "prefetch_bucket_size": "stage3_prefetch_bucket_size",
    "param_persistence_threshold": "stage3_param_persistence_threshold",
    "model_persistence_threshold": "stage3_model_persistence_threshold",
    "max_live_parameters": "stage3_max_live_parameters",
    "max_reuse_distance": "stage3_max_reuse_distance",
    "gather_16bit_weights_on_model_save": "stage3_gather_16bit_weights_on_model_save",
    "module_granularity_threshold": "stage3_module_granularity_threshold",
    "use_all_reduce_for_fetch_params": "stage3_use_all_reduce_for_fetch_params",
    "allgather_sequential": "stage3_allgather_sequential",
    "stage3_gather_fp16_weights_on_model_save": "stage3_gather_16bit_weights_on_model_save",
}

# keys of fp16 that mean nothing for bf16 (bf16 needs no loss scaling)
FP16_ONLY_KEYS = (
    "loss_scale",
    "initial_scale_power",
    "loss_scale_window",
    "hysteresis",
    "consecutive_hysteresis",
    "min_loss_scale",
    "auto_cast",
    "fp16_master_weights_and_grads",
)
# apex amp options sometimes written inside fp16/bf16
AMP_KEYS = ("opt_level", "fp16_opt_level")
# zero_optimization keys that older releases read and that are harmless now
ZERO_IGNORED_KEYS = {
    "cpu_offload_use_pin_memory": "pinning follows offload_*.pin_memory",
    "grad_hooks": "gradient hooks are always used",
}


@dataclass
class CompatReport:
    """What the compatibility pass changed: notes for explain, warnings for the log."""

    renamed: dict[str, str] = field(default_factory=dict)  # new path -> old path
    warnings: list[str] = field(default_factory=list)


def _rename(
    section: dict[str, object], old: str, new: str, prefix: str, report: CompatReport, note: str = ""
) -> None:
    if old not in section:
        return
    if new in section:
        raise ConfigError(
            f"{prefix}{old}",
            f"'{prefix}{old}' and '{prefix}{new}' are two spellings of the same setting",
            f"keep only '{prefix}{new}'",
            value=section[old],
        )
    section[new] = section.pop(old)
    report.renamed[f"{prefix}{new}"] = f"{prefix}{old}"
    if note:
        report.warnings.append(note)


def _normalize_zero(raw: dict[str, Any], report: CompatReport) -> None:
    zero = raw.get("zero_optimization")
    if isinstance(zero, bool):
        raw["zero_optimization"] = {"stage": 1 if zero else 0}
        report.renamed["zero_optimization.stage"] = "zero_optimization"
        report.warnings.append(
            f"'zero_optimization: {str(zero).lower()}' is the old boolean form; read as stage {1 if zero else 0}. "
            f'Write {{"stage": {1 if zero else 0}}} instead.'
        )
        if "allgather_size" in raw:
            raw["zero_optimization"]["allgather_bucket_size"] = raw.pop("allgather_size")
            report.renamed["zero_optimization.allgather_bucket_size"] = "allgather_size"
        zero = raw["zero_optimization"]
    if not isinstance(zero, dict):
        return
    p = "zero_optimization."
    if "cpu_offload" in zero:
        flag = zero.pop("cpu_offload")
        if "offload_optimizer" in zero:
            raise ConfigError(
                f"{p}cpu_offload",
                f"'{p}cpu_offload' and '{p}offload_optimizer' are two spellings of the same setting"
                "; both together are an error, whatever the old one says",
                "keep only offload_optimizer",
                value=flag,
            )
        if flag is True:
            zero["offload_optimizer"] = {"device": "cpu"}
            report.renamed[f"{p}offload_optimizer.device"] = f"{p}cpu_offload"
            report.warnings.append(
                "'zero_optimization.cpu_offload' is deprecated; read as offload_optimizer.device=cpu"
            )
    if "cpu_offload_param" in zero:
        flag = zero.pop("cpu_offload_param")
        if "offload_param" in zero:
            raise ConfigError(
                f"{p}cpu_offload_param",
                f"'{p}cpu_offload_param' and '{p}offload_param' are two spellings of the same setting"
                "; both together are an error, whatever the old one says",
                "keep only offload_param",
                value=flag,
            )
        if flag is True:
            zero["offload_param"] = {"device": "cpu"}
            report.renamed[f"{p}offload_param.device"] = f"{p}cpu_offload_param"
            report.warnings.append(
                "'zero_optimization.cpu_offload_param' is deprecated; read as offload_param.device=cpu"
            )
    for key, why in ZERO_IGNORED_KEYS.items():
        if key in zero:
            zero.pop(key)
            report.warnings.append(f"'zero_optimization.{key}' has no effect ({why}); it can be removed")
    for old, new in STAGE3_ALIASES.items():
        _rename(zero, old, new, p, report)
    for block in ("offload_param", "offload_optimizer"):
        if zero.get(block) is None and block in zero:
            zero.pop(block)


def _normalize_precision(raw: dict[str, object], report: CompatReport) -> None:
    if "bfloat16" in raw:
        if "bf16" in raw:
            raw.pop("bfloat16")
            report.warnings.append(
                "both 'bf16' and its old name 'bfloat16' are present; 'bfloat16' is ignored"
            )
        else:
            raw["bf16"] = raw.pop("bfloat16")
            report.renamed["bf16"] = "bfloat16"
    bf16 = raw.get("bf16")
    if isinstance(bf16, dict):
        misplaced = [k for k in (*FP16_ONLY_KEYS, *AMP_KEYS) if k in bf16]
        for key in misplaced:
            bf16.pop(key)
        if misplaced:
            report.warnings.append(
                f"bf16 section has fp16-only keys {misplaced}; bf16 uses no loss scaling, so they are ignored"
            )
    fp16 = raw.get("fp16")
    if isinstance(fp16, dict):
        misplaced = [k for k in AMP_KEYS if k in fp16]
        for key in misplaced:
            fp16.pop(key)
        if misplaced:
            report.warnings.append(
                f"fp16 section has apex amp keys {misplaced}; they belong to the 'amp' section and are ignored here"
            )
    if raw.get("fp32_allreduce") is True:
        raw.pop("fp32_allreduce")
        if raw.get("communication_data_type") not in (None, "fp32", "auto"):
            raise ConfigError(
                "fp32_allreduce",
                f"fp32_allreduce=true contradicts communication_data_type={raw['communication_data_type']!r}",
                "keep only communication_data_type",
                value=True,
            )
        raw["communication_data_type"] = "fp32"
        report.renamed["communication_data_type"] = "fp32_allreduce"
        report.warnings.append("'fp32_allreduce: true' is the old spelling of communication_data_type='fp32'")
    elif "fp32_allreduce" in raw:
        raw.pop("fp32_allreduce")


def _normalize_misc(raw: dict[str, object], report: CompatReport) -> None:
    aio = raw.get("aio")
    if isinstance(aio, dict):
        _rename(aio, "thread_count", "intra_op_parallelism", "aio.", report)
    ckpt = raw.get("activation_checkpointing")
    if isinstance(ckpt, dict):
        _rename(ckpt, "partitioned_activations", "partition_activations", "activation_checkpointing.", report)


def normalize_legacy(raw: dict[str, Any]) -> CompatReport:
    """Rewrite legacy spellings in ``raw`` in place and report what changed.

    Example:
        >>> raw = {"zero_optimization": {"stage": 2, "cpu_offload": True}}
        >>> normalize_legacy(raw).renamed
        {'zero_optimization.offload_optimizer.device': 'zero_optimization.cpu_offload'}
    """
    report = CompatReport()
    _normalize_zero(raw, report)
    _normalize_precision(raw, report)
    _normalize_misc(raw, report)
    return report
