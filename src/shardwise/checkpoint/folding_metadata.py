"""The layout record of a checkpoint saved by a folded AutoEP + AutoTP run, and its checks (pure).

A folded run (``expert_parallel.autoep_size`` > 1 with ``tensor_parallel.autotp_size`` > 1,
:mod:`shardwise.autoep.folding`) places expert groups across the tensor-parallel lanes, so which
rank holds which shard depends on the whole layout. Its checkpoint files therefore carry a record
(DeepSpeed 0.19.8's ``"folding"`` entry, keys :data:`FOLDING_TP_SIZE` ...): the sizes and this
file's ranks, the file's family (``dense`` model file, ``routed_expert`` expert or optimizer file,
``zero_optimizer_state``), the data-parallel group its ZeRO partition spans (``dense_dp``,
``edp``, ``per_family``) and, for a model file, the family of every parameter in it.
A folded run refuses to load a file without the record or with another layout, naming the axis.

Example:
    >>> meta = make_folding_metadata(tp_size=2, tp_rank=0, ep_size=2, ep_rank=1, zero_partition_group="edp",
    ...                              zero_partition_rank=0, zero_partition_count=2, family="routed_expert")
    >>> validate_folding_metadata({FOLDING_METADATA_KEY: meta}, tp_size=2, ep_size=2)[FOLDING_EP_RANK]
    1
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Any, Protocol

FOLDING_METADATA_KEY = "folding"
"""The entry of a checkpoint file (and of shardwise's summary) holding the record."""
FOLDING_METADATA_VERSION = 1
FOLDING_TP_SIZE = "tp_size"
FOLDING_TP_RANK = "tp_rank"
FOLDING_EP_SIZE = "ep_size"
FOLDING_EP_RANK = "ep_rank"
FOLDING_ETP_SIZE = "etp_size"
FOLDING_ETP_RANK = "etp_rank"
FOLDING_ZERO_PARTITION_GROUP = "zero_partition_group"
FOLDING_ZERO_PARTITION_RANK = "zero_partition_rank"
FOLDING_ZERO_PARTITION_COUNT = "zero_partition_count"
FOLDING_DISPATCH_STRATEGY = "dispatch_strategy"
FOLDING_SHARED_EXPERT_PLACEMENT = "shared_expert_placement"
FOLDING_FAMILY = "family"
FOLDING_PARAM_FAMILIES = "param_families"

DISPATCH_STRATEGY = "route_full_partition_dispatch"
"""How a folded run dispatches tokens: every TP lane routes its full partition to its expert ranks."""
SHARED_EXPERT_PLACEMENT = "tp_sharded"
"""Where a folded run keeps shared experts: sliced over the TP lanes like dense layers."""

_WHAT = {
    FOLDING_TP_SIZE: "tensor_parallel.autotp_size",
    FOLDING_EP_SIZE: "expert_parallel.autoep_size",
    FOLDING_ETP_SIZE: "expert_parallel.expert_tensor_parallel_size",
    FOLDING_TP_RANK: "this rank's tensor-parallel rank",
    FOLDING_EP_RANK: "this rank's expert-parallel rank",
    FOLDING_ETP_RANK: "this rank's expert-tensor-parallel rank",
    FOLDING_ZERO_PARTITION_GROUP: "the group the file's ZeRO partition spans",
    FOLDING_ZERO_PARTITION_RANK: "the file's ZeRO partition rank",
    FOLDING_ZERO_PARTITION_COUNT: "the number of ZeRO partitions (data-parallel size of the group)",
    FOLDING_FAMILY: "the file's parameter family",
    FOLDING_PARAM_FAMILIES: "the per-parameter families",
    FOLDING_SHARED_EXPERT_PLACEMENT: "the shared-expert placement",
    FOLDING_DISPATCH_STRATEGY: "the token dispatch strategy",
}

_FIX = {
    FOLDING_TP_SIZE: "a folded checkpoint loads only into the layout that saved it; fix: resume with the saved "
    "tensor_parallel.autotp_size, expert_parallel.autoep_size and world size",
    FOLDING_FAMILY: "the file is not the kind this load expects (renamed or mixed up); fix: load the checkpoint "
    "directory as it was saved",
    FOLDING_PARAM_FAMILIES: "the saving run grouped its parameters differently; fix: resume with the model and "
    "config that saved it",
}


def make_folding_metadata(
    *,
    tp_size: int,
    tp_rank: int,
    ep_size: int,
    ep_rank: int,
    zero_partition_group: str,
    zero_partition_rank: int,
    zero_partition_count: int,
    family: str,
    param_families: Mapping[str, Any] | None = None,
) -> dict[str, Any]:
    """The record one file of a folded run carries (experts are never tensor-sliced: ``etp`` is 1, rank 0)."""
    record: dict[str, Any] = {
        "version": FOLDING_METADATA_VERSION,
        FOLDING_TP_SIZE: tp_size,
        FOLDING_TP_RANK: tp_rank,
        FOLDING_EP_SIZE: ep_size,
        FOLDING_EP_RANK: ep_rank,
        FOLDING_ETP_SIZE: 1,
        FOLDING_ETP_RANK: 0,
        FOLDING_ZERO_PARTITION_GROUP: zero_partition_group,
        FOLDING_ZERO_PARTITION_RANK: zero_partition_rank,
        FOLDING_ZERO_PARTITION_COUNT: zero_partition_count,
        FOLDING_DISPATCH_STRATEGY: DISPATCH_STRATEGY,
        FOLDING_SHARED_EXPERT_PLACEMENT: SHARED_EXPERT_PLACEMENT,
        FOLDING_FAMILY: family,
    }
    if param_families is not None:
        record[FOLDING_PARAM_FAMILIES] = dict(param_families)
    return record


def validate_folding_metadata(
    metadata: object,
    *,
    tp_size: int,
    ep_size: int,
    etp_size: int = 1,
    tp_rank: int | None = None,
    ep_rank: int | None = None,
    etp_rank: int | None = None,
    zero_partition_group: str | None = None,
    zero_partition_rank: int | None = None,
    zero_partition_count: int | None = None,
    family: str | None = None,
    param_families: Mapping[str, Any] | None = None,
    shared_expert_placement: str | None = None,
    dispatch_strategy: str | None = None,
    where: str = "folded checkpoint",
) -> dict[str, Any]:
    """``metadata[FOLDING_METADATA_KEY]`` checked against the runtime's layout (the sizes always, every
    other value that is not None); returns the record.

    Raises:
        RuntimeError: the record is missing ("Missing AutoEP+AutoTP folding metadata"), of another
            version, or one value differs (the message names the key, both values and the fix).
    """
    if not isinstance(metadata, Mapping) or FOLDING_METADATA_KEY not in metadata:
        raise RuntimeError(
            f"Missing AutoEP+AutoTP folding metadata in {where}: it was not saved by a folded AutoEP+AutoTP run "
            f"(no {FOLDING_METADATA_KEY!r} entry), so which rank's shards it holds is unknown; fix: load it with "
            "the layout it was saved with (without tensor_parallel.autotp_size if it was saved unfolded), or "
            "resave it from a folded run"
        )
    record = metadata[FOLDING_METADATA_KEY]
    version = record.get("version") if isinstance(record, Mapping) else None
    if version != FOLDING_METADATA_VERSION:
        raise RuntimeError(
            f"Unsupported AutoEP+AutoTP folding metadata version {version!r} in {where} (this shardwise reads "
            f"version {FOLDING_METADATA_VERSION}); fix: load it with the release that saved it"
        )
    expected: dict[str, Any] = {FOLDING_TP_SIZE: tp_size, FOLDING_EP_SIZE: ep_size, FOLDING_ETP_SIZE: etp_size}
    optional = {
        FOLDING_TP_RANK: tp_rank,
        FOLDING_EP_RANK: ep_rank,
        FOLDING_ETP_RANK: etp_rank,
        FOLDING_ZERO_PARTITION_GROUP: zero_partition_group,
        FOLDING_ZERO_PARTITION_RANK: zero_partition_rank,
        FOLDING_ZERO_PARTITION_COUNT: zero_partition_count,
        FOLDING_FAMILY: family,
        FOLDING_PARAM_FAMILIES: param_families,
        FOLDING_SHARED_EXPERT_PLACEMENT: shared_expert_placement,
        FOLDING_DISPATCH_STRATEGY: dispatch_strategy,
    }
    expected.update({key: value for key, value in optional.items() if value is not None})
    for key, value in expected.items():
        saved = record.get(key)
        if saved != value:
            raise RuntimeError(
                f"Folding metadata mismatch for {key} ({_WHAT[key]}) in {where}: saved={saved!r} runtime={value!r}; "
                f"{_FIX.get(key, _FIX[FOLDING_TP_SIZE])}"
            )
    return dict(record)


class FoldingSpecLike(Protocol):
    """What the runtime check reads of a folded layout (:class:`shardwise.autoep.folding.ParallelFoldingSpec`)."""

    @property
    def tp_size(self) -> int: ...
    @property
    def ep_size(self) -> int: ...
    @property
    def etp_size(self) -> int: ...


def validate_runtime_folding(
    state: object,
    *,
    folding_spec: FoldingSpecLike | None,
    family: str,
    zero_partition_group: str,
    zero_partition_count: int | None,
    tp_rank: int | None = None,
    ep_rank: int | None = None,
    zero_partition_rank: int | None = None,
    param_families: Mapping[str, Any] | None = None,
    require_when_folded: bool = True,
    where: str = "folded checkpoint",
) -> None:
    """One loaded file ``state`` checked against the run (``folding_spec`` None or ``tp_size`` 1: unfolded)
    (DeepSpeed's ``DeepSpeedEngine._validate_autoep_folding_checkpoint_metadata``).

    Raises:
        RuntimeError: a folded file in an unfolded run ("requires a folded runtime"), a folded run's
            file without the record (with ``require_when_folded``), or any value that differs.
    """
    has_record = isinstance(state, Mapping) and FOLDING_METADATA_KEY in state
    folded = folding_spec is not None and folding_spec.tp_size > 1
    if has_record and not folded:
        raise RuntimeError(
            f"{where} was saved by a folded AutoEP+AutoTP run: it requires a folded runtime with matching "
            "tensor_parallel.autotp_size and expert_parallel.autoep_size; fix: set both as the saving run did"
        )
    if not folded or (not has_record and not require_when_folded):
        return
    assert folding_spec is not None
    validate_folding_metadata(
        state, tp_size=folding_spec.tp_size, ep_size=folding_spec.ep_size, etp_size=folding_spec.etp_size,
        etp_rank=0, tp_rank=tp_rank, ep_rank=ep_rank, zero_partition_group=zero_partition_group,
        zero_partition_rank=zero_partition_rank, zero_partition_count=zero_partition_count,
        param_families=param_families, family=family, shared_expert_placement=SHARED_EXPERT_PLACEMENT,
        dispatch_strategy=DISPATCH_STRATEGY, where=where,
    )


def param_families(keys: Iterable[str], moe_layer_paths: Sequence[str]) -> dict[str, str]:
    """The family of each non-expert entry of a folded run's model file: ``router_gate_replicated``
    (an MoE layer's router, replicated over the TP lanes), ``shared_expert`` (its shared experts, TP-sliced),
    ``routed_expert`` (its experts) or ``dense``.

    Example:
        >>> param_families(["a.mlp.router.gate.weight", "a.dense.weight"], ["a.mlp"])
        {'a.mlp.router.gate.weight': 'router_gate_replicated', 'a.dense.weight': 'dense'}
    """
    heads = [f"{path}." if path else "" for path in moe_layer_paths]
    out = {}
    for key in keys:
        family = "dense"
        for head in heads:
            if not key.startswith(head):
                continue
            rest = key[len(head):]
            if rest.startswith(("router.", "gate.")):
                family = "router_gate_replicated"
            elif rest.startswith("shared_experts"):
                family = "shared_expert"
            elif rest.startswith("experts."):
                family = "routed_expert"
            break
        out[key] = family
    return out
