"""What each ``zero_optimization`` key means on shardwise's stage 3 (FSDP2), decided once.

Stage 3 runs on PyTorch's ``fully_shard`` (FSDP2). DeepSpeed's knobs are mapped onto it
key by key; :data:`KEY_NOTES` is that mapping as data, so ``config explain`` and
``config plan`` can show it next to a user's file, and :class:`Stage3Settings` is the
frozen policy the wrapping code reads (it never sees the config).

| key | on shardwise stage 3 |
|---|---|
| grouping (automatic) | repeated blocks (children of ModuleList/Sequential sharing a class) are shard units; ``leaf_module`` matches and leaves with >= ``LEAF_UNIT_MIN_NUMEL`` elements outside blocks too; the root holds the rest |
| ``stage3_param_persistence_threshold`` | parameters with fewer elements stay unsharded (replicated, fp32 masters, gradients all-reduced every micro step) |
| ``stage3_model_persistence_threshold`` | cap on the total elements kept unsharded (smallest first) |
| ``stage3_prefetch_bucket_size`` | FSDP2 explicit prefetch: each unit prefetches the next units whose sizes fit in the bucket |
| ``stage3_allgather_sequential`` | true: no prefetch at all (not even FSDP2's implicit backward prefetch) |
| ``stage3_max_live_parameters`` / ``stage3_max_reuse_distance`` | per unit ``reshard_after_forward``: a unit stays gathered from forward to backward when its reuse distance and the live total allow |
| ``stage3_module_granularity_threshold`` | modules with fewer elements per descendant are one unit (not split) |
| ``leaf_module`` | matching modules are one unit each |
| ``reduce_bucket_size`` | bucket size of the unsharded parameters' all-reduce (sharded gradients are reduce-scattered once per unit; ``config.inert`` reports the key at stage 3) |
| ``sub_group_size`` | the optimizer step runs over sub-groups of at most this many local-shard elements in turn (:func:`~shardwise.zero.optimizer_subset.step_in_sub_groups`; offload splits its own step) |
| ``zero_quantized_weights`` / ``zero_quantized_gradients`` | ZeRO++ qwZ / qgZ: FSDP2's custom all-gather / reduce-scatter hooks move int8 blocks (:mod:`shardwise.comm.quantized_collectives`) |
| ``zero_hpz_partition_size`` | > 1: units reshard after forward to groups of this size (FSDP2's ``reshard_after_forward=int``, ZeRO++ hpZ) |
| mixed precision | bf16/fp16 compute (``MixedPrecisionPolicy.param_dtype``), fp32 sharded masters, fp32 reduction (or ``communication_data_type``), forward inputs not cast (as at stages 0-2) |
| ``stage3_gather_16bit_weights_on_model_save`` | ``engine.save_16bit_model`` gathers full weights one tensor at a time only when true (else it saves a sharded checkpoint and says how to export it) |
| ``offload_param`` / ``offload_optimizer`` / ``aio`` | see :mod:`shardwise.zero.offload` |

No torch import here: the mapping is tested in milliseconds.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from shardwise.config.sections.zero import ZeroConfig

# Leaf modules outside repeated blocks become their own shard unit from this many elements
# on: below it, one more collective per step costs more than holding the weights does.
LEAF_UNIT_MIN_NUMEL = 1 << 20

_MAPPED = "mapped"
_INERT = "no effect"
_STAGES_12 = "stages 1-2 key"

# key (relative to zero_optimization, or a top-level section key) -> (kind, text)
KEY_NOTES: dict[str, tuple[str, str]] = {
    "stage": (_MAPPED, "3 = parameters, gradients and optimizer state sharded with FSDP2 fully_shard"),
    "stage3_param_persistence_threshold": (
        _MAPPED,
        "params with fewer elements stay unsharded (replicated; gradients all-reduced every micro step)",
    ),
    "stage3_model_persistence_threshold": (
        _MAPPED,
        "cap on the total elements kept unsharded, smallest first",
    ),
    "stage3_prefetch_bucket_size": (
        _MAPPED,
        "FSDP2 explicit prefetch: each unit prefetches the following units that fit in this many elements",
    ),
    "stage3_allgather_sequential": (_MAPPED, "true disables prefetching (FSDP2's implicit one included)"),
    "stage3_max_live_parameters": (
        _MAPPED,
        "units kept gathered between forward and backward may hold at most this many elements",
    ),
    "stage3_max_reuse_distance": (
        _MAPPED,
        "a unit stays gathered after forward (reshard_after_forward=False) if it is reused within this many elements",
    ),
    "stage3_module_granularity_threshold": (
        _MAPPED,
        "modules with fewer elements per descendant form one shard unit",
    ),
    "leaf_module": (_MAPPED, "matching modules (class path, name or suffix) form one shard unit each"),
    "reduce_bucket_size": (
        _MAPPED,
        "stage 3: bucket of the unsharded parameters' all-reduce; sharded gradients go one reduce-scatter per unit",
    ),
    "zero_hpz_partition_size": (
        _MAPPED,
        "> 1: units reshard after forward to groups of this size (FSDP2 reshard_after_forward=int)",
    ),
    "stage3_gather_16bit_weights_on_model_save": (
        _MAPPED,
        "16-bit model saves gather full weights only when true",
    ),
    "sub_group_size": (
        _MAPPED,
        "elements per optimizer step call: the local shard steps sub-group by sub-group (streamed from NVMe "
        "with offload); in one call, with a warning, for an optimizer that is not one of torch's "
        "element-wise ones",
    ),
    "offload_param": (_MAPPED, "stage 3: sharded params and grads on the host (cpu) or in files (nvme)"),
    "offload_optimizer": (
        _MAPPED,
        "optimizer state (and its fp32 masters) on the host (cpu) or in files (nvme)",
    ),
    "overlap_comm": (_INERT, "FSDP2 always overlaps its collectives with compute"),
    "contiguous_gradients": (_INERT, "FSDP2's reduce-scatter output is already one contiguous shard"),
    "stage3_use_all_reduce_for_fetch_params": (_INERT, "FSDP2 gathers with all-gather"),
    "memory_efficient_linear": (_INERT, "no custom linear is needed: FSDP2 frees gathered weights itself"),
    "override_module_apply": (_INERT, "module.apply works on the sharded module without an override"),
    "pipeline_loading_checkpoint": (_INERT, "checkpoints load shard-wise through DCP"),
    "log_trace_cache_warnings": (_INERT, "there is no trace cache: prefetch order is fixed at wrapping"),
    "enable_sanity_checks": (_INERT, "no DeepSpeed sanity checks to enable"),
    "zero_quantized_weights": (
        _MAPPED,
        "stage 3 (ZeRO++ qwZ): units are all-gathered as int8 blocks with one fp32 scale per 256 "
        "elements, dequantized on arrival (error <= block absmax / 254); stages 1-2: the updated shards",
    ),
    "zero_quantized_nontrainable_weights": (_INERT, "quantized frozen weights are not implemented"),
    "zero_quantized_gradients": (
        _MAPPED,
        "stage 3 (ZeRO++ qgZ): gradients are reduce-scattered as int8 blocks by one all-to-all, summed "
        "in fp32 on arrival (error <= sum over ranks of block absmax / 254)",
    ),
    "allgather_bucket_size": (_STAGES_12, "no effect at stage 3: FSDP2 gathers one unit per collective"),
    "allgather_partitions": (_STAGES_12, "no effect at stage 3"),
    "reduce_scatter": (_STAGES_12, "no effect at stage 3: gradients are always reduce-scattered"),
    "use_multi_rank_bucket_allreduce": (_STAGES_12, "no effect at stage 3"),
    "round_robin_gradients": (_STAGES_12, "no effect at stage 3"),
    "ignore_unused_parameters": (
        _MAPPED,
        "false: the optimizer step raises naming the trainable parameters that got no gradient in the window",
    ),
    "load_from_fp32_weights": (
        _MAPPED,
        "false: after a checkpoint load the fp32 masters are re-read from the loaded model weights",
    ),
    "offload_param.max_in_cpu": (_INERT, "there is no separate CPU parameter cache"),
    "offload_param.buffer_size": (_MAPPED, "nvme: bytes per read/write request for parameter files"),
    "offload_param.buffer_count": (_MAPPED, "nvme: parameter file requests in flight"),
    "offload_optimizer.buffer_count": (
        _MAPPED,
        "sub-groups resident at once while streaming (>= 2 overlaps I/O)",
    ),
    "offload_optimizer.ratio": (
        _MAPPED,
        "stage 3: fraction of optimizer state offloaded (first tensors first)",
    ),
    "offload_optimizer.pipeline_read": (_MAPPED, "nvme: read the next sub-group while stepping this one"),
    "offload_optimizer.pipeline_write": (_MAPPED, "nvme: write a sub-group back while stepping the next"),
    "offload_optimizer.fast_init": (_INERT, "state files are created at the first step"),
    "offload_optimizer.super_offload": (_INERT, "SuperOffload is not implemented"),
    "offload_optimizer.cpuadam_cores_perc": (_INERT, "the CPU step uses torch's kernels and thread setting"),
    "offload_param.pin_memory": (
        _MAPPED,
        "pinned host buffers when a GPU exists (ignored on CPU-only machines)",
    ),
    "offload_optimizer.pin_memory": (
        _MAPPED,
        "pinned host buffers when a GPU exists (ignored on CPU-only machines)",
    ),
}

# aio section keys (top level): how the NVMe store uses them.
AIO_NOTES: dict[str, tuple[str, str]] = {
    "block_size": (_MAPPED, "bytes per file read/write request"),
    "queue_depth": (_MAPPED, "requests in flight per I/O thread"),
    "intra_op_parallelism": (_MAPPED, "I/O threads"),
    "single_submit": (_MAPPED, "true: one request at a time"),
    "overlap_events": (_MAPPED, "overlap file I/O with the optimizer step"),
    "use_gds": (_INERT, "GPUDirect Storage is not used; reads go through host memory"),
}


@dataclass(frozen=True)
class Stage3Settings:
    """The stage-3 knobs, as the wrapping code reads them.

    Attributes:
        persistence_threshold: params with fewer elements stay unsharded.
        model_persistence_threshold: at most this many elements stay unsharded in total.
        prefetch_bucket_numel: elements a unit may prefetch ahead (0: no explicit prefetch).
        prefetch_disabled: ``stage3_allgather_sequential``: no prefetching at all.
        max_live_numel: cap on elements kept gathered between forward and backward.
        max_reuse_distance: a unit reused within this many elements stays gathered.
        granularity_threshold: modules with fewer elements per descendant are one unit.
        leaf_classes: class paths (or bare class names) that form one unit each.
        leaf_names: module names (FQNs) that form one unit each.
        leaf_suffixes: module-name suffixes that form one unit each.
        hpz_partition_size: > 1: reshard after forward to groups of this size.
        reduce_bucket_numel: bucket of the replicated (unsharded) gradients' all-reduce.
        gather_16bit_on_save: ``stage3_gather_16bit_weights_on_model_save``.
        leaf_unit_min_numel: leaves outside blocks with at least this many elements are units.
    """

    persistence_threshold: int = 100_000
    model_persistence_threshold: int = 2**63 - 1
    prefetch_bucket_numel: int = 50_000_000
    prefetch_disabled: bool = False
    max_live_numel: int = 1_000_000_000
    max_reuse_distance: int = 1_000_000_000
    granularity_threshold: int = 0
    leaf_classes: tuple[str, ...] = ()
    leaf_names: tuple[str, ...] = ()
    leaf_suffixes: tuple[str, ...] = ()
    hpz_partition_size: int = 1
    reduce_bucket_numel: int = 500_000_000
    gather_16bit_on_save: bool = False
    leaf_unit_min_numel: int = LEAF_UNIT_MIN_NUMEL


def settings_from_zero(zero: ZeroConfig) -> Stage3Settings:
    """:class:`Stage3Settings` from a validated ``zero_optimization`` section.

    Example:
        >>> from shardwise.config.sections.zero import ZeroConfig
        >>> s = settings_from_zero(ZeroConfig(stage=3, stage3_param_persistence_threshold=0))
        >>> s.persistence_threshold, s.prefetch_disabled
        (0, False)
    """
    leaf = zero.leaf_module
    return Stage3Settings(
        persistence_threshold=int(zero.stage3_param_persistence_threshold),
        model_persistence_threshold=int(zero.stage3_model_persistence_threshold),
        prefetch_bucket_numel=int(zero.stage3_prefetch_bucket_size),
        prefetch_disabled=bool(zero.stage3_allgather_sequential),
        max_live_numel=int(zero.stage3_max_live_parameters),
        max_reuse_distance=int(zero.stage3_max_reuse_distance),
        granularity_threshold=int(zero.stage3_module_granularity_threshold),
        leaf_classes=tuple(leaf.classes),
        leaf_names=tuple(leaf.names),
        leaf_suffixes=tuple(leaf.name_suffixes),
        hpz_partition_size=int(zero.zero_hpz_partition_size),
        reduce_bucket_numel=int(zero.reduce_bucket_size),
        gather_16bit_on_save=bool(zero.stage3_gather_16bit_weights_on_model_save),
    )


# What keys do at stages 1-2 where their stage-3 note (above) does not apply.
STAGE12_NOTES: dict[str, str] = {
    "overlap_comm": (
        "stages 1-2: gradient reductions run while backward does, and the post-step all-gather of the "
        "updated shards is left in flight bucket by bucket, each module's forward pre-hook waiting for "
        "its own parameters' buckets (forwards, state_dict, checkpoints and the parameter accessors wait "
        "by themselves; a parameter tensor read directly between step() and the next forward does not: "
        "call engine.optimizer.wait_for_parameters() first)"
    ),
}


def key_note(path: str, stage: int) -> str | None:
    """The engine note for one dotted key path of a resolved config, or None.

    Notes are given for ``zero_optimization.*`` and ``aio.*`` keys; keys of stages 1-2
    are only annotated at stage 3 (where they have no effect), except those of
    :data:`STAGE12_NOTES`, which say what they do at stages 1-2.

    Example:
        >>> key_note("zero_optimization.overlap_comm", 3)
        'accepted, no effect on this engine: FSDP2 always overlaps its collectives with compute'
    """
    head, _, rest = path.partition(".")
    if head == "aio" and rest in AIO_NOTES:
        kind, text = AIO_NOTES[rest]
        return _render(kind, text)
    if head != "zero_optimization" or not rest:
        return None
    if stage in (1, 2) and rest in STAGE12_NOTES:
        return STAGE12_NOTES[rest]
    entry = KEY_NOTES.get(rest)
    if entry is None and "." in rest:
        block = rest.split(".", 1)[0]
        if block in ("offload_param", "offload_optimizer") and rest.endswith(".device"):
            entry = KEY_NOTES[block]
        elif rest.startswith("leaf_module."):
            entry = KEY_NOTES["leaf_module"]
    if entry is None:
        return None
    kind, text = entry
    if kind == _STAGES_12 and stage != 3:
        return None
    if kind == _MAPPED and stage != 3 and rest.startswith("stage3_"):
        return "stage-3 key: no effect at stage " + str(stage)
    return _render(kind, text)


def _render(kind: str, text: str) -> str:
    if kind == _MAPPED:
        return text
    return "accepted, no effect on this engine: " + text


def engine_notes(flat_keys: Mapping[str, object], stage: int, only: set[str] | None = None) -> dict[str, str]:
    """Notes for every key of a flattened config (``ResolvedConfig.flat()``) that has one.

    Args:
        flat_keys: dotted key path -> value.
        stage: the config's ZeRO stage.
        only: restrict to these paths (for example, the keys set in the file).

    Example:
        >>> notes = engine_notes({"zero_optimization.overlap_comm": False}, 3)
        >>> notes["zero_optimization.overlap_comm"].startswith("accepted, no effect")
        True
    """
    out: dict[str, str] = {}
    for path in flat_keys:
        if only is not None and path not in only:
            continue
        note = key_note(path, stage)
        if note is not None:
            out[path] = note
    return out


def inert_keys(flat_keys: Mapping[str, object], stage: int, only: set[str] | None = None) -> dict[str, str]:
    """The subset of :func:`engine_notes` for keys that have no effect on this engine."""
    return {
        k: v for k, v in engine_notes(flat_keys, stage, only).items() if v.startswith("accepted, no effect")
    }
