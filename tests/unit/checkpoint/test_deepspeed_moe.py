"""DeepSpeed's MoE file layout (``checkpoint/deepspeed_moe.py``): file names, a whole state split into
the main file and per-expert files and merged back, the ``ds_autoep_layers`` check, and
``load_moe_state_dict`` taking this rank's experts under local names."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import nn

from shardwise.checkpoint import keys
from shardwise.checkpoint.deepspeed_import import DeepSpeedCheckpoint
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


def _zero2_moe_checkpoint(tag: Path) -> dict[str, torch.Tensor]:
    """A DeepSpeed-shaped ZeRO-2 checkpoint of 2 ranks at EP=2 (one MoE layer "moe", 2 experts of one
    [2, 2] weight, a dense [3] bias): the dense group partitioned over both ranks, each rank's expert
    group (its one expert, local index 0) held whole by that rank alone. Returns the whole fp32
    tensors and ``exp_avg`` by global name, as the importer should read them back."""
    gen = torch.Generator().manual_seed(3)
    dense, experts = torch.randn(3, generator=gen), [torch.randn(2, 2, generator=gen) for _ in range(2)]
    avg_dense, avg_experts = torch.randn(3, generator=gen), [torch.randn(2, 2, generator=gen) for _ in range(2)]
    local = "moe.deepspeed_moe.experts.deepspeed_experts.0.weight"
    tag.mkdir(parents=True)
    torch.save({"module": {"bias": dense.clone(), "moe.deepspeed_moe.gate.wg.weight": torch.zeros(2, 2)},
                "param_shapes": [{"bias": (3,), "moe.deepspeed_moe.gate.wg.weight": (2, 2)}, {local: (2, 2)}],
                "num_experts": [2], "buffer_names": [], "dp_world_size": 2, "mp_world_size": 1,
                "ds_config": {"zero_optimization": {"stage": 2}}, "global_steps": 1, "skipped_steps": 0},
               tag / "mp_rank_00_model_states.pt")
    for e in range(2):
        torch.save({f"moe.deepspeed_moe.experts.deepspeed_experts.{e}.weight": experts[e]},
                   tag / f"layer_0_expert_{e}_mp_rank_00_model_states.pt")
    gate, avg_gate = torch.zeros(4), torch.zeros(4)
    flat_dense, flat_avg = torch.cat([dense, gate]), torch.cat([avg_dense, avg_gate])  # 7 elements: 4 on rank 0, 3
    cuts = [(0, 4), (4, 3)]
    for r in range(2):
        start, numel = cuts[r]
        # fragment addresses (numel, start): rank 0 holds the bias and the gate's first element
        mapping = {"bias": (3, 0), "moe.deepspeed_moe.gate.wg.weight": (1, 3)} if r == 0 else {
            "moe.deepspeed_moe.gate.wg.weight": (3, 0)}
        groups = [{"lr": 0.1, "name": "dense-params", "params": [0]}, {"lr": 0.1, "name": "ep_size_2", "moe": True,
                                                                        "params": [1]}]
        inner = {"state": {0: {"exp_avg": flat_avg[start:start + numel].clone(), "step": 1},
                           1: {"exp_avg": avg_experts[r].reshape(-1).clone(), "step": 1}}, "param_groups": groups}
        torch.save({"optimizer_state_dict": {
            "base_optimizer_state": inner, "partition_count": [2, 1], "param_slice_mappings": [mapping, {local: (4, 0)}],
            "single_partition_of_fp32_groups": [flat_dense[start:start + numel].clone(), experts[r].reshape(-1).clone()],
        }}, tag / f"zero_pp_rank_{r}_mp_rank_00_optim_states.pt")
    out = {"bias": dense, "exp_avg/bias": avg_dense}
    for e in range(2):
        out[f"moe.deepspeed_moe.experts.deepspeed_experts.{e}.weight"] = experts[e]
        out[f"exp_avg/moe.deepspeed_moe.experts.deepspeed_experts.{e}.weight"] = avg_experts[e]
    return out


def test_a_deepspeed_zero2_moe_checkpoint_reads_back_by_global_expert(tmp_path: Path) -> None:
    want = _zero2_moe_checkpoint(tmp_path / "t")
    ckpt = DeepSpeedCheckpoint(tmp_path / "t")
    module = ckpt.module_state_dict()
    state = ckpt.optimizer_state([n for n in module])
    assert state is not None
    for name, tensor in want.items():
        _, _, param = name.partition("/")
        got = state[f"optim/{param}/exp_avg"] if param else module[name]
        assert torch.equal(got, tensor), name
    (group,) = state["optim/param_groups"]  # DeepSpeed's expert group joins its client group
    assert sorted(group[keys.PARAM_NAMES]) == sorted(module)


def test_to_deepspeed_gives_each_expert_parallel_rank_its_rows_of_autoep_weights(tmp_path: Path) -> None:
    from shardwise.checkpoint.deepspeed_export import stage0_optimizer_state
    from shardwise.checkpoint.deepspeed_moe_export import moe_stage0_files

    layers = [MoELayerRecord(0, "l1", "autoep", 2, 2, router_alias="gate")]
    gen = torch.Generator().manual_seed(1)
    module = {"l1.router.gate.weight": torch.randn(2, 3, generator=gen)}
    module.update({f"l1.experts.{w}": torch.randn(2, 4, 3, generator=gen) for w in ("w1", "w2", "w3")})
    optimizer: dict = {"optim/param_groups": [{"lr": 0.1, "betas": (0.9, 0.99), keys.PARAM_NAMES: list(module)}]}
    for name, value in module.items():
        optimizer[f"optim/{name}/exp_avg"] = value * 2
        optimizer[f"optim/{name}/step"] = torch.tensor(3.0)
    staging = tmp_path / "t"
    staging.mkdir()
    moe_stage0_files({"module": module, "optimizer": optimizer, "buffer_names": []}, {}, layers, 2, staging,
                     rank_optimizer=lambda m, o: stage0_optimizer_state(m, o, ds_config={}),
                     model_states_file="mp_rank_00_model_states.pt")
    main = torch.load(staging / "mp_rank_00_model_states.pt", weights_only=False)
    assert torch.equal(main["module"]["l1.gate.gate.weight"], module["l1.router.gate.weight"])  # DeepSpeed's alias
    assert main["ds_autoep_layers"][0]["num_local_experts"] == 1
    for rank in range(2):
        inner = torch.load(staging / f"expp_rank_{rank}_mp_rank_00_optim_states.pt", weights_only=False)["optimizer"]
        dense, experts = inner["param_groups"]
        assert experts["moe"] and len(dense["params"]) == 1 and len(experts["params"]) == 3
        w2 = inner["state"][experts["params"][1]]["exp_avg"]  # group order: w1, w2, w3
        assert torch.equal(w2, module["l1.experts.w2"][rank:rank + 1] * 2)
