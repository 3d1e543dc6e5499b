"""The folded AutoEP + AutoTP checkpoint record: written, checked, refused; folded expert shards refused."""

from __future__ import annotations

import pytest
import torch

from shardwise.autoep.folding import build_folding_spec
from shardwise.checkpoint import folding_metadata as fm
from shardwise.checkpoint.deepspeed_moe import expert_files
from shardwise.checkpoint.universal_experts import consolidate_autoep_expert_files


def _record(**overrides: object) -> dict[str, object]:
    args: dict[str, object] = dict(tp_size=2, tp_rank=1, ep_size=4, ep_rank=3, zero_partition_group="edp",
                                   zero_partition_rank=1, zero_partition_count=2, family="routed_expert")
    args.update(overrides)
    return fm.make_folding_metadata(**args)  # type: ignore[arg-type]


def test_record_holds_every_axis() -> None:
    record = _record(param_families={"a.weight": "dense"})
    assert record == {
        "version": 1, "tp_size": 2, "tp_rank": 1, "ep_size": 4, "ep_rank": 3, "etp_size": 1, "etp_rank": 0,
        "zero_partition_group": "edp", "zero_partition_rank": 1, "zero_partition_count": 2,
        "dispatch_strategy": "route_full_partition_dispatch", "shared_expert_placement": "tp_sharded",
        "family": "routed_expert", "param_families": {"a.weight": "dense"},
    }


@pytest.mark.parametrize(("key", "runtime", "saved"), [
    ("tp_size", {"tp_size": 1}, 2), ("ep_size", {"ep_size": 2}, 4), ("ep_rank", {"ep_rank": 0}, 3),
    ("zero_partition_count", {"zero_partition_count": 4}, 2), ("family", {"family": "dense"}, "routed_expert"),
])
def test_mismatch_names_the_axis_both_values_and_the_fix(key: str, runtime: dict[str, object], saved: object) -> None:
    kwargs: dict[str, object] = {"tp_size": 2, "ep_size": 4, **runtime}
    with pytest.raises(RuntimeError, match=f"mismatch for {key} .*saved={saved!r} runtime={runtime[key]!r}.*fix:"):
        fm.validate_folding_metadata({fm.FOLDING_METADATA_KEY: _record()}, **kwargs)  # type: ignore[arg-type]


def test_missing_record_and_other_version_are_refused() -> None:
    with pytest.raises(RuntimeError, match=r"Missing AutoEP\+AutoTP folding metadata in x\.pt.*fix:"):
        fm.validate_folding_metadata({"module": {}}, tp_size=2, ep_size=4, where="x.pt")
    with pytest.raises(RuntimeError, match="version 7"):
        fm.validate_folding_metadata({fm.FOLDING_METADATA_KEY: {**_record(), "version": 7}}, tp_size=2, ep_size=4)
    assert fm.validate_folding_metadata({fm.FOLDING_METADATA_KEY: _record()}, tp_size=2, ep_size=4)["ep_rank"] == 3


def test_runtime_check_folded_and_unfolded() -> None:
    spec = build_folding_spec(world_size=8, pp_size=1, tp_size=2, ep_size=4)
    folded = {fm.FOLDING_METADATA_KEY: _record(family="dense", zero_partition_group="dense_dp",
                                               zero_partition_count=spec.dp_size)}
    common = dict(family="dense", zero_partition_group="dense_dp", zero_partition_count=spec.dp_size)
    fm.validate_runtime_folding(folded, folding_spec=spec, **common)  # type: ignore[arg-type]
    fm.validate_runtime_folding({}, folding_spec=None, **common)  # type: ignore[arg-type]  # unfolded: nothing
    with pytest.raises(RuntimeError, match="requires a folded runtime"):
        fm.validate_runtime_folding(folded, folding_spec=None, **common)  # type: ignore[arg-type]
    with pytest.raises(RuntimeError, match=r"Missing AutoEP\+AutoTP"):
        fm.validate_runtime_folding({}, folding_spec=spec, **common)  # type: ignore[arg-type]
    fm.validate_runtime_folding({}, folding_spec=spec, require_when_folded=False, **common)  # type: ignore[arg-type]
    with pytest.raises(RuntimeError, match="zero_partition_group"):
        fm.validate_runtime_folding(folded, folding_spec=spec, family="dense", zero_partition_group="edp",
                                    zero_partition_count=spec.dp_size)


def test_param_families_follow_the_moe_layers() -> None:
    keys = ["m.0.mlp.router.gate.weight", "m.0.mlp.shared_experts.up.weight", "m.0.mlp.experts.w1",
            "m.0.dense.weight", "lm_head.weight"]
    assert fm.param_families(keys, ["m.0.mlp"]) == {
        "m.0.mlp.router.gate.weight": "router_gate_replicated", "m.0.mlp.shared_experts.up.weight": "shared_expert",
        "m.0.mlp.experts.w1": "routed_expert", "m.0.dense.weight": "dense", "lm_head.weight": "dense",
    }


def _expert_file(tmp_path, tp_rank: int, expert: int, folded: bool) -> None:  # type: ignore[no-untyped-def]
    state: dict[str, object] = {f"experts.{w}.{expert}": torch.full((2, 3), float(expert + 10 * tp_rank))
                                for w in ("w1", "w2", "w3")}
    if folded:
        state[fm.FOLDING_METADATA_KEY] = _record(tp_size=2, tp_rank=tp_rank, ep_size=2, ep_rank=0)
    torch.save(state, tmp_path / f"layer_0_expert_{expert}_mp_rank_{tp_rank:02d}_model_states.pt")


def test_consolidate_joins_expert_files_and_refuses_folded_tp_shards(tmp_path) -> None:  # type: ignore[no-untyped-def]
    meta = [{"moe_layer_id": 0, "num_experts": 2, "expert_key_prefix": "experts"}]
    _expert_file(tmp_path, 0, 0, folded=False)
    _expert_file(tmp_path, 1, 1, folded=False)  # one file per expert, whichever rank wrote it: joined
    consolidate_autoep_expert_files(tmp_path, tmp_path / "out", meta)
    saved = torch.load(tmp_path / "out" / "zero" / "experts.w2" / "fp32.pt", weights_only=True)
    assert saved["param"].shape == (2, 2, 3) and saved["is_expert_param"] and saved["ep_num_experts"] == 2
    assert saved["param"][0].eq(0).all() and saved["param"][1].eq(11).all() and saved["cat_dim"] == 0
    _expert_file(tmp_path, 1, 0, folded=False)  # expert 0 on two ranks, no folding record
    with pytest.raises(NotImplementedError, match="several model-parallel ranks"):
        consolidate_autoep_expert_files(tmp_path, tmp_path / "out", meta)
    _expert_file(tmp_path, 1, 0, folded=True)
    with pytest.raises(NotImplementedError, match=r"folded AutoEP\+AutoTP expert shards"):
        expert_files(tmp_path)  # the importer's and to-universal's finder: the same refusal
    with pytest.raises(RuntimeError, match="ds_autoep_layers"):
        consolidate_autoep_expert_files(tmp_path, tmp_path / "out", None)


def test_load_moe_state_dict_checks_the_expert_files_records(tmp_path) -> None:  # type: ignore[no-untyped-def]
    from torch import nn

    from shardwise.checkpoint.deepspeed_moe import (
        expert_ckpt_name,
        load_moe_state_dict,
        moe_layers,
        split_experts,
    )
    from shardwise.moe.layer import MoE

    model = nn.Sequential(MoE(3, nn.Linear(3, 3), num_experts=2, ep_size=1))
    _, files = split_experts(model.state_dict(), moe_layers(model))
    (tmp_path / "t").mkdir()
    spec = build_folding_spec(world_size=4, pp_size=1, tp_size=2, ep_size=2)
    record = _record(tp_size=2, tp_rank=0, ep_size=2, ep_rank=0, zero_partition_count=spec.edp_size)
    for (layer, expert), tensors in files.items():
        torch.save({**tensors, fm.FOLDING_METADATA_KEY: record}, expert_ckpt_name(tmp_path, layer, expert, "t"))
    got: dict[str, torch.Tensor] = {}
    load_moe_state_dict(tmp_path, "t", got, old_moe_load=False, model=model, folding_spec=spec, checkpoint_mp_rank=0)
    assert fm.FOLDING_METADATA_KEY not in got and len(got) == 4  # two experts' weight and bias, record dropped
    with pytest.raises(RuntimeError, match="requires a folded runtime"):
        load_moe_state_dict(tmp_path, "t", {}, old_moe_load=False, model=model)
    wider = build_folding_spec(world_size=8, pp_size=1, tp_size=2, ep_size=4)
    with pytest.raises(RuntimeError, match="mismatch for ep_size"):
        load_moe_state_dict(tmp_path, "t", {}, old_moe_load=False, model=model, folding_spec=wider, checkpoint_mp_rank=0)
