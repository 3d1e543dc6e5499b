"""AutoEP folded over AutoTP: the layout arithmetic and its rules (DeepSpeed's
``deepspeed.module_inject.auto_ep_folding``).

With ``expert_parallel.autoep_size`` > 1 and ``tensor_parallel.autotp_size`` > 1, dense layers keep
the tensor-parallel layout (``tp`` groups of consecutive ranks, dense data parallelism over the ranks
``tp`` apart) while expert groups are runs of ``ep`` consecutive ranks of the pipeline stage, across
the TP lanes (Megatron's MoE parallel folding), and expert data parallelism (``edp``) joins the ranks
``ep`` apart. The rank lists are :class:`~shardwise.comm.parallel_dims.ParallelDims`' with
``fold_ep=True`` (the one owner of rank arithmetic); this module only names them as DeepSpeed does
and states the folding rules. Pure: no process group is needed for anything here except the
handles a caller passes to :class:`FoldingGroupHandles`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from shardwise.comm.parallel_dims import ParallelDims

__all__ = [
    "FoldingGroupHandles",
    "FoldingGroupTables",
    "ParallelFoldingSpec",
    "assert_group_matches_spec",
    "build_folding_spec",
    "expected_folding_group_tables",
    "local_folding_ranks",
    "validate_folding_global",
]

RankTable = tuple[tuple[int, ...], ...]


@dataclass(frozen=True)
class ParallelFoldingSpec:
    """The sizes of one folded layout: per pipeline stage, ``tp x dp`` dense and ``ep x etp x edp`` expert ranks."""

    world_size: int
    pp_size: int
    stage_size: int
    tp_size: int
    dp_size: int
    ep_size: int
    etp_size: int
    edp_size: int
    mp_mode: str = "tp"

    def parallel_dims(self) -> ParallelDims:
        """The same layout as shardwise's :class:`ParallelDims` (``fold_ep=True``)."""
        return ParallelDims(
            dp_shard=self.dp_size, tp=self.tp_size, pp=self.pp_size, ep=self.ep_size,
            world_size=self.world_size, fold_ep=True,
        )


@dataclass(frozen=True)
class FoldingGroupTables:
    """Every group of the folded layout as tuples of global ranks, stage by stage."""

    tp_groups: RankTable
    dense_dp_groups: RankTable
    ep_groups: RankTable
    edp_groups: RankTable


@dataclass(frozen=True)
class FoldingGroupHandles:
    """One rank's folded groups: the process groups and the rank lists they were made from."""

    spec: ParallelFoldingSpec
    tp_group: Any
    dense_dp_group: Any
    ep_group: Any
    edp_group: Any
    ep_group_name: str
    tp_ranks: tuple[int, ...]
    dense_dp_ranks: tuple[int, ...]
    ep_ranks: tuple[int, ...]
    edp_ranks: tuple[int, ...]


def _divisors(value: int) -> list[int]:
    return [d for d in range(1, value + 1) if value % d == 0]


def build_folding_spec(
    *, world_size: int, pp_size: int, tp_size: int, ep_size: int, etp_size: int = 1, mp_mode: str = "tp"
) -> ParallelFoldingSpec:
    """The folded layout's sizes from the config's; ValueError naming the size that does not tile, with the valid ones.

    Example:
        >>> spec = build_folding_spec(world_size=8, pp_size=1, tp_size=2, ep_size=4)
        >>> spec.dp_size, spec.edp_size
        (4, 2)
    """
    for name, value in (
        ("world_size", world_size),
        ("pp_size", pp_size),
        ("tensor_parallel.autotp_size", tp_size),
        ("expert_parallel.autoep_size", ep_size),
        ("expert_parallel.expert_tensor_parallel_size", etp_size),
    ):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be a positive integer, got {value!r}")
    if world_size % pp_size:
        raise ValueError(
            f"pp_size={pp_size} must divide world_size={world_size}; Valid pp_size values: {_divisors(world_size)}"
        )
    stage = world_size // pp_size
    if stage % tp_size:
        raise ValueError(
            f"tensor_parallel.autotp_size={tp_size} must divide the stage size {stage} (world_size={world_size} / "
            f"pp_size={pp_size}), or the data-parallel degree is not whole. Valid autotp_size values: {_divisors(stage)}"
        )
    width = ep_size * etp_size
    if stage % width:
        raise ValueError(
            f"autoep_size * expert_parallel.expert_tensor_parallel_size = {ep_size} * {etp_size} = {width} must "
            f"divide the stage size {stage} (world_size={world_size} / pp_size={pp_size}), or the expert-data-"
            f"parallel degree is not whole. Valid expert-width values: {_divisors(stage)}"
        )
    return ParallelFoldingSpec(
        world_size=world_size, pp_size=pp_size, stage_size=stage, tp_size=tp_size, dp_size=stage // tp_size,
        ep_size=ep_size, etp_size=etp_size, edp_size=stage // width, mp_mode=mp_mode,
    )


def expected_folding_group_tables(spec: ParallelFoldingSpec) -> FoldingGroupTables:
    """The rank tables of ``spec`` (from :meth:`ParallelDims.rank_groups`, as the mesh builds them)."""
    dims = spec.parallel_dims()

    def table(dim: str) -> RankTable:
        return tuple(tuple(group) for group in dims.rank_groups(dim))

    return FoldingGroupTables(
        tp_groups=table("tp"), dense_dp_groups=table("dp"), ep_groups=table("ep"), edp_groups=table("edp")
    )


def local_folding_ranks(global_rank: int, spec: ParallelFoldingSpec) -> dict[str, tuple[int, ...]]:
    """The ``tp``, ``dense_dp``, ``ep`` and ``edp`` rank lists that ``global_rank`` belongs to."""
    tables = expected_folding_group_tables(spec)
    by_name = {"tp": tables.tp_groups, "dense_dp": tables.dense_dp_groups, "ep": tables.ep_groups,
               "edp": tables.edp_groups}
    return {name: next(g for g in groups if global_rank in g) for name, groups in by_name.items()}


def assert_group_matches_spec(rank_tables: tuple[RankTable, RankTable], spec: ParallelFoldingSpec) -> None:
    """RuntimeError when ``(ep_groups, edp_groups)`` (e.g. left by an earlier, unfolded layout) are not ``spec``'s."""
    expected = expected_folding_group_tables(spec)
    ep_groups, edp_groups = (tuple(tuple(g) for g in table) for table in rank_tables)
    for name, found, wanted in (("ep", ep_groups, expected.ep_groups), ("edp", edp_groups, expected.edp_groups)):
        if found != wanted:
            raise RuntimeError(
                f"the {name} rank table {found} does not match folding spec (tp={spec.tp_size}, ep={spec.ep_size}, "
                f"world={spec.world_size}): expected {wanted}; the expert groups were made for another layout "
                "(rebuild them through shardwise.comm.mesh with fold_ep=True)"
            )


def _mpu_size(mpu: Any, *names: str) -> int | None:
    for name in names:
        getter = getattr(mpu, name, None) if mpu is not None else None
        if getter is not None:
            return int(getter())
    return None


def validate_folding_global(
    spec: ParallelFoldingSpec,
    *,
    zero_stage: int = 0,
    sp_size: int = 1,
    deepcompile_enabled: bool = False,
    use_data_before_expert_parallel: bool = False,
    mpu: Any = None,
    autoep_enabled: bool = True,
    tp_preset: str | None = None,
    ep_preset: str | None = None,
    zero_offload_optimizer: bool = False,
    zero_offload_param: bool = False,
) -> None:
    """The folding rules DeepSpeed states (before any group exists); ValueError naming the setting and the fix.

    A folded model trains at ZeRO stages 0-2; stage 3 (parameters gathered per lane and per expert
    group) is refused.
    """
    if not autoep_enabled:
        return
    folded = spec.tp_size > 1
    if folded and zero_stage == 3:
        raise ValueError(f"zero_optimization.stage=3 with AutoEP+AutoTP folding (tensor_parallel.autotp_size="
                         f"{spec.tp_size}, expert_parallel.autoep_size={spec.ep_size}) is not supported: sharding "
                         "parameters over the folded expert and tensor-parallel groups is a separate ZeRO-3 "
                         "composition lane, not built; "
                         "fix: use zero_optimization.stage 0, 1 or 2, or tensor_parallel.autotp_size=1")
    if deepcompile_enabled and folded:
        raise ValueError("compile.deepcompile: DeepCompile with AutoEP+AutoTP folding is not supported; "
                         "fix: disable compile.deepcompile or use tensor_parallel.autotp_size=1")
    if folded and spec.pp_size > 1:
        raise ValueError(f"AutoEP+AutoTP folding supports pp_size=1 only (got pp_size={spec.pp_size}); "
                         "fix: drop pipeline parallelism or tensor_parallel.autotp_size")
    if folded and sp_size > 1:
        raise ValueError(f"tensor_parallel.autotp_size={spec.tp_size} and sequence_parallel_size={sp_size} are "
                         "mutually exclusive under AutoEP folding; fix: use one of them")
    if spec.etp_size != 1:
        raise ValueError(f"expert_parallel.expert_tensor_parallel_size={spec.etp_size} is reserved for tensor "
                         "parallelism inside an expert, which neither DeepSpeed nor shardwise implements; "
                         "fix: set expert_tensor_parallel_size=1 or leave it out")
    if tp_preset is not None and ep_preset is not None and tp_preset != ep_preset:
        raise ValueError(f"tensor_parallel.preset_model={tp_preset!r} and expert_parallel.preset_model="
                         f"{ep_preset!r} must match when both are set; fix: name the same model family")
    if folded and spec.ep_size == 1:
        raise ValueError("expert_parallel.autoep_size=1 with tensor_parallel.autotp_size="
                         f"{spec.tp_size}: AutoEP+AutoTP folding needs autoep_size > 1 (with one expert rank every "
                         "TP lane would compute the same routed tokens); fix: set autoep_size > 1")
    if folded and use_data_before_expert_parallel:
        raise ValueError("use_data_before_expert_parallel_=true is not supported with AutoEP+AutoTP folding "
                         "(the folded expert groups are fixed runs of ranks); fix: set it to false")
    if folded and (zero_offload_optimizer or zero_offload_param):
        raise ValueError("zero_optimization.offload_optimizer/offload_param with AutoEP+AutoTP folding is not "
                         "supported; fix: disable the offload or tensor_parallel.autotp_size")
    mpu_tp = _mpu_size(mpu, "get_tensor_model_parallel_world_size", "get_model_parallel_world_size")
    if mpu_tp not in (None, 1, spec.tp_size):
        raise ValueError(f"the mpu tensor/model parallel world size ({mpu_tp}) conflicts with "
                         f"tensor_parallel.autotp_size={spec.tp_size}; fix: make them agree or drop mpu=")
    mpu_pp = _mpu_size(mpu, "get_pipeline_model_parallel_world_size", "get_pipeline_parallel_world_size")
    if mpu_pp not in (None, spec.pp_size):
        raise ValueError(f"the mpu pipeline parallel world size ({mpu_pp}) conflicts with pp_size={spec.pp_size}; "
                         "fix: make them agree or drop mpu=")
