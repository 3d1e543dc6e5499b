"""DeepSpeed's MoE file layout (``checkpoint/deepspeed_moe.py``): file names, a whole state split into
the main file and per-expert files and merged back, the ``ds_autoep_layers`` check, and
``load_moe_state_dict`` taking this rank's experts under local names."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import nn

from shardwise.checkpoint.deepspeed_moe import (
    MoELayerRecord,
    autoep_metadata,
    check_autoep_metadata,
    drop_router_aliases,
    expert_ckpt_name,
    load_moe_state_dict,
    merge_expert_files,
    moe_layers,
    split_experts,
)
from shardwise.engine import ShardwiseEngine
from shardwise.moe.layer import MoE


class _MPU:
    def get_model_parallel_rank(self) -> int:
        return 3


def test_expert_file_names_follow_deepspeed() -> None:
    assert expert_ckpt_name("/c", 1, 2, "tag", _MPU()) == "/c/tag/layer_1_expert_2_mp_rank_03_model_states.pt"
    assert ShardwiseEngine._get_expert_ckpt_name("/c", 1, 2, "tag", _MPU(), checkpoint_mp_rank=0).endswith(
        "layer_1_expert_2_mp_rank_00_model_states.pt"
    )
    assert expert_ckpt_name("/c", -1, 5, None) == "/c/expert_5_mp_rank_00_model_states.pt"


def _whole_state() -> tuple[dict[str, torch.Tensor], list[MoELayerRecord]]:
    gen = torch.Generator().manual_seed(0)
    state = {"embed.weight": torch.randn(5, 3, generator=gen), "l0.deepspeed_moe.gate.wg.weight": torch.randn(4, 3)}
    for e in range(4):
        state[f"l0.deepspeed_moe.experts.deepspeed_experts.{e}.weight"] = torch.randn(3, 3, generator=gen)
    for w in ("w1", "w2", "w3"):
        state[f"l1.experts.{w}"] = torch.randn(2, 6, 3, generator=gen)
    state["l1.router.gate.weight"] = torch.randn(2, 3, generator=gen)
    return state, [MoELayerRecord(0, "l0", "moe", 4, 2), MoELayerRecord(1, "l1", "autoep", 2, 1)]


def test_split_then_merge_gives_the_whole_state_back() -> None:
    state, layers = _whole_state()
    main, files = split_experts(state, layers)
    assert sorted(main) == ["embed.weight", "l0.deepspeed_moe.gate.wg.weight", "l1.router.gate.weight"]
    assert sorted(files) == [(0, 0), (0, 1), (0, 2), (0, 3), (1, 0), (1, 1)]
    assert list(files[(1, 1)]) == ["l1.experts.w1.1", "l1.experts.w2.1", "l1.experts.w3.1"]
    assert torch.equal(files[(1, 1)]["l1.experts.w2.1"], state["l1.experts.w2"][1])
    merge_expert_files(main, files, layers)
    assert sorted(main) == sorted(state)
    for key, value in state.items():
        assert torch.equal(main[key], value), key
    del files[(0, 3)]
    with pytest.raises(ValueError, match="layer_0_expert_3"):
        merge_expert_files({}, files, layers)


def test_autoep_metadata_is_checked_like_deepspeed() -> None:
    _, layers = _whole_state()
    entries = autoep_metadata(layers, ep_size=1)
    assert entries is not None and entries[0]["expert_key_prefix"] == "l1.experts"
    assert check_autoep_metadata(entries) == entries
    with pytest.raises(RuntimeError, match="malformed"):
        check_autoep_metadata("not_a_list")
    with pytest.raises(RuntimeError, match="missing fields"):
        check_autoep_metadata([{"moe_layer_id": 0}])
    with pytest.raises(RuntimeError, match="inconsistent"):
        check_autoep_metadata([{**entries[0], "num_local_experts": 3}])


def test_load_moe_state_dict_reads_this_ranks_experts_under_local_names(tmp_path: Path) -> None:
    model = nn.Sequential(MoE(3, nn.Linear(3, 3), num_experts=2, ep_size=1))
    assert [(r.module_path, r.kind, r.num_experts) for r in moe_layers(model)] == [("0", "moe", 2)]
    want = model.state_dict()
    _, files = split_experts(want, moe_layers(model))
    (tmp_path / "t").mkdir()
    for (layer, expert), tensors in files.items():
        torch.save(tensors, expert_ckpt_name(tmp_path, layer, expert, "t"))
    got: dict[str, torch.Tensor] = {}
    ShardwiseEngine.load_moe_state_dict(tmp_path, "t", got, old_moe_load=False, model=model)
    assert sorted(got) == sorted(k for k in want if "deepspeed_experts" in k)
    for key, value in got.items():
        assert torch.equal(value, want[key]), key
    with pytest.raises(FileNotFoundError, match="expert_1"):
        Path(expert_ckpt_name(tmp_path, 0, 1, "t")).unlink()
        load_moe_state_dict(tmp_path, "t", {}, old_moe_load=False, model=model)


def test_router_aliases_are_added_for_deepspeed_and_dropped_on_the_way_back() -> None:
    state, layers = _whole_state()
    main, _ = split_experts(state, layers)
    main["l1.gate.gate.weight"] = main["l1.router.gate.weight"].clone()  # DeepSpeed's second name
    main["l1.shared_gate.weight"] = torch.zeros(1, 3)  # not a copy of a router tensor: kept
    drop_router_aliases(main, layers)
    assert sorted(main) == ["embed.weight", "l0.deepspeed_moe.gate.wg.weight", "l1.router.gate.weight",
                            "l1.shared_gate.weight"]
