"""A folded AutoEP + AutoTP save's DeepSpeed files: who writes what, the records, the check on load."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from shardwise.checkpoint import layout
from shardwise.checkpoint.deepspeed_moe import MoELayerRecord
from shardwise.checkpoint.folded_files import (
    FoldedRun,
    check_before_load,
    folded_run,
    side_files,
    summary_entries,
)
from shardwise.checkpoint.folding_metadata import FOLDING_METADATA_KEY
from shardwise.comm.parallel_dims import ParallelDims
from shardwise.comm.topology import Topology

LAYERS = [MoELayerRecord(0, "m.mlp", "autoep", 4, 2)]


def _run(rank: int, *, world: int = 8, tp: int = 2, ep: int = 2) -> FoldedRun:
    dims = ParallelDims(dp_shard=world // tp, tp=tp, ep=ep, world_size=world, fold_ep=True)
    groups = {dim: (None, tuple(next(g for g in dims.rank_groups(dim) if rank in g))) for dim in ("dp", "tp", "ep",
                                                                                               "edp")}
    topo = Topology(world_rank=rank, world_size=world, dp_size=world // tp, dp_rank=groups["dp"][1].index(rank),
                    mp_size=tp, mp_rank=groups["tp"][1].index(rank), shard_size=world // tp,
                    shard_rank=groups["dp"][1].index(rank), dims=dims, groups=groups)
    run = folded_run(topo)
    assert run is not None
    return run


def test_each_file_has_one_writer() -> None:
    runs = [_run(r) for r in range(8)]
    assert [(r.tp_rank, r.ep_rank) for r in runs] == [(0, 0), (1, 1)] * 4  # ep groups: runs of 2 across the lanes
    assert [r.expert_writer for r in runs] == [True, True] + [False] * 6
    assert [r.model_writer for r in runs] == [True, True] + [False] * 6
    wide = [_run(r, ep=4) for r in range(8)]  # ep 4 > tp 2: every (tp, ep) pair is held twice
    assert sum(r.expert_writer for r in wide) == 4 and (wide[2].tp_rank, wide[2].ep_rank) == (0, 2)
    assert wide[0].spec.edp_size == 2 and wide[5].edp_rank == 1


def _save(tmp_path: Path, tag: str = "t") -> Path:
    path = tmp_path / tag
    path.mkdir()
    optimizer = torch.optim.SGD([torch.nn.Parameter(torch.ones(2))], lr=0.1)
    for rank in range(8):
        run = _run(rank)
        local = range(run.ep_rank * 2, run.ep_rank * 2 + 2)
        experts = {(0, e): {f"m.mlp.experts.w1.{e}": torch.full((2, 2), float(e))} for e in local}
        main = {"m.mlp.router.gate.weight": torch.ones(4, 2), "m.dense.weight": torch.ones(2, 2)}
        files = side_files(run, torch.nn.Module(), LAYERS, main, experts, {"module": main}, optimizer, 0)
        for name, value in files.items():
            assert not (path / name).exists(), f"{name} written twice"
            torch.save(value, path / name)
    (path / layout.SUMMARY).write_text(json.dumps(summary_entries(_run(0), True)))
    return path


def test_files_and_records(tmp_path: Path) -> None:
    path = _save(tmp_path)
    assert sorted(p.name for p in path.glob("*.pt")) == [
        "expp_rank_0_mp_rank_00_optim_states.pt", "expp_rank_1_mp_rank_01_optim_states.pt",
        *(f"layer_0_expert_{e}_mp_rank_{e // 2:02d}_model_states.pt" for e in range(4)),
        "mp_rank_00_model_states.pt", "mp_rank_01_model_states.pt",
    ]
    main = torch.load(path / "mp_rank_01_model_states.pt", weights_only=True)
    record = main[FOLDING_METADATA_KEY]
    assert (record["family"], record["zero_partition_group"], record["zero_partition_count"]) == ("dense", "dense_dp", 4)
    assert record["param_families"] == {"m.mlp.router.gate.weight": "router_gate_replicated", "m.dense.weight": "dense"}
    assert main["mp_world_size"] == 2 and record["tp_rank"] == 1
    expert = torch.load(path / "layer_0_expert_3_mp_rank_01_model_states.pt", weights_only=True)[FOLDING_METADATA_KEY]
    assert (expert["family"], expert["zero_partition_group"], expert["ep_rank"]) == ("routed_expert", "edp", 1)
    for rank in range(8):  # every rank of the same layout accepts it
        check_before_load(path, "shardwise", _run(rank), LAYERS)


def test_load_refuses_missing_record_and_other_layout(tmp_path: Path) -> None:
    path = _save(tmp_path)
    with pytest.raises(RuntimeError, match=r"mismatch for ep_size .*saved=2 runtime=4"):
        check_before_load(path, "shardwise", _run(0, ep=4), LAYERS)
    with pytest.raises(RuntimeError, match=r"mismatch for zero_partition_count .*summary.*saved=4 runtime=2"):
        check_before_load(path, "shardwise", _run(0, world=4), LAYERS)
    state = torch.load(path / "mp_rank_01_model_states.pt", weights_only=True)
    state.pop(FOLDING_METADATA_KEY)
    torch.save(state, path / "mp_rank_01_model_states.pt")
    check_before_load(path, "shardwise", _run(0), LAYERS)  # lane 0 reads only its own files
    with pytest.raises(RuntimeError, match=r"Missing AutoEP\+AutoTP folding metadata in .*mp_rank_01_model_states"):
        check_before_load(path, "shardwise", _run(1), LAYERS)
    (path / layout.SUMMARY).write_text(json.dumps({"format": "x"}))
    with pytest.raises(RuntimeError, match=r"Missing AutoEP\+AutoTP folding metadata in .*summary"):
        check_before_load(path, "shardwise", _run(0), LAYERS)
