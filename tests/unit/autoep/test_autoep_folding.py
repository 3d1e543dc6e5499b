"""AutoEP folded over AutoTP: the folded rank tables come from ParallelDims (the mesh's arithmetic),
and the folding rules refuse what the folded layout cannot train."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from shardwise.autoep.config import AutoEPConfig, validate_autoep_config
from shardwise.autoep.folding import (
    assert_group_matches_spec,
    build_folding_spec,
    expected_folding_group_tables,
    local_folding_ranks,
)
from shardwise.comm.parallel_dims import ParallelDims


def test_folded_expert_groups_cross_tp_lanes_while_dense_groups_keep_tp_layout() -> None:
    dims = ParallelDims(dp_shard=4, tp=2, ep=4, world_size=8, fold_ep=True)
    assert dims.rank_groups("tp") == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert dims.rank_groups("dp") == [[0, 2, 4, 6], [1, 3, 5, 7]]
    assert dims.rank_groups("ep") == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert dims.rank_groups("edp") == [[0, 4], [1, 5], [2, 6], [3, 7]]
    # unfolded, the same degrees cut expert groups from each TP lane's data-parallel ranks
    assert ParallelDims(dp_shard=4, tp=2, ep=2, world_size=8).rank_groups("ep") == [[0, 2], [4, 6], [1, 3], [5, 7]]


def test_ep_wider_than_dense_dp_is_valid_only_when_folded() -> None:
    with pytest.raises(ValueError, match="must divide dp_shard x sp = 2"):
        ParallelDims(dp_shard=2, tp=2, ep=4, world_size=4)
    dims = ParallelDims(dp_shard=2, tp=2, ep=4, world_size=4, fold_ep=True)
    assert dims.rank_groups("ep") == [[0, 1, 2, 3]] and dims.rank_groups("edp") == [[0], [1], [2], [3]]


def test_tables_are_stage_by_stage_and_local_ranks_pick_this_ranks_groups() -> None:
    spec = build_folding_spec(world_size=8, pp_size=2, tp_size=2, ep_size=2)
    tables = expected_folding_group_tables(spec)
    assert tables.ep_groups == ((0, 1), (2, 3), (4, 5), (6, 7))
    assert tables.edp_groups == ((0, 2), (1, 3), (4, 6), (5, 7))
    assert local_folding_ranks(5, spec) == {"tp": (4, 5), "dense_dp": (5, 7), "ep": (4, 5), "edp": (5, 7)}
    assert_group_matches_spec((tables.ep_groups, tables.edp_groups), spec)
    with pytest.raises(RuntimeError, match="ep rank table"):
        assert_group_matches_spec((((0, 2), (1, 3)), tables.edp_groups), spec)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        (dict(world_size=6, tp_size=4, ep_size=2), "autotp_size=4 must divide the stage size 6.*Valid autotp_size values: \\[1, 2, 3, 6\\]"),
        (dict(world_size=4, tp_size=2, ep_size=3), "= 3 must divide the stage size 4"),
        (dict(world_size=4, tp_size=2, ep_size=1), "needs autoep_size > 1"),
        (dict(world_size=4, tp_size=2, ep_size=2, sp_size=2), "mutually exclusive"),
        (dict(world_size=4, tp_size=2, ep_size=2, etp=2), "expert_tensor_parallel_size=2 is reserved"),
        (dict(world_size=4, tp_size=2, ep_size=2, zero_offload_optimizer=True), "offload_optimizer"),
        (dict(world_size=4, tp_size=2, ep_size=2, deepcompile_enabled=True), "DeepCompile"),
        (dict(world_size=8, tp_size=2, ep_size=2, pp_size=2), "pp_size=1 only"),
        (dict(world_size=4, tp_size=2, ep_size=2, mpu=SimpleNamespace(get_model_parallel_world_size=lambda: 4)),
         "mpu tensor/model parallel world size \\(4\\)"),
    ],
)
def test_folding_rules_name_the_setting(kwargs: dict, match: str) -> None:
    etp = kwargs.pop("etp", 1)
    config = AutoEPConfig(enabled=True, autoep_size=kwargs.pop("ep_size"), expert_tensor_parallel_size=etp)
    layout = {"world_size": kwargs.pop("world_size"), "tp_size": kwargs.pop("tp_size"),
              "pp_size": kwargs.pop("pp_size", 1), "sp_size": kwargs.pop("sp_size", 1)}
    with pytest.raises(ValueError, match=match):
        validate_autoep_config(config, **layout, **kwargs)


def test_unfolded_autoep_keeps_pipeline_parallelism_and_deepcompile() -> None:
    config = AutoEPConfig(enabled=True, autoep_size=2)
    validate_autoep_config(config, world_size=8, pp_size=2, tp_size=1, sp_size=1, deepcompile_enabled=True)
