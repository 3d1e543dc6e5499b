"""Tensor-parallel layer rules (pure): specs from partition_config, presets, a transformers _tp_plan,
DeepSpeed's name rules, slices and their reassembly, tp_model_init's merge into the config."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from shardwise.tensor_parallel.hf_plan import hf_tp_plan, specs_from_hf_plan
from shardwise.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear, TPGroup
from shardwise.tensor_parallel.model_init import merge_into_config, reset_recorded, tp_model_init
from shardwise.tensor_parallel.partitioner import split_model
from shardwise.tensor_parallel.presets import PRESETS, preset, resolve_plan
from shardwise.tensor_parallel.shards import Split, shard_sizes
from shardwise.tensor_parallel.specs import plan_from_dict


def test_partition_config_first_match_wins_and_bad_input_names_the_key() -> None:
    plan = plan_from_dict({"use_default_specs": False, "layer_specs": [
        {"patterns": [r".*\.o_proj\.weight$"], "partition_type": "row"},
        {"patterns": [r".*\.weight$"], "partition_type": "skip"},
    ]})
    assert plan.find("a.o_proj.weight").partition_type == "row"
    assert plan.find("a.q_proj.weight").partition_type == "skip"
    with pytest.raises(ValueError, match=r"partition_type.*column, row, skip"):
        plan_from_dict({"layer_specs": [{"patterns": ["x"], "partition_type": "diagonal"}]})
    with pytest.raises(ValueError, match=r"layer_specs\[0\]\.pattern"):
        plan_from_dict({"layer_specs": [{"pattern": "x"}]})
    with pytest.raises(ValueError, match="not a regular expression"):
        plan_from_dict({"layer_specs": [{"patterns": ["(unclosed"]}]})


def test_model_types_limit_a_spec() -> None:
    plan = plan_from_dict({"layer_specs": [{"patterns": [".*"], "model_types": ["llama"]}]})
    assert plan.find("w.weight", "LLaMA") is not None
    assert plan.find("w.weight", "gpt2") is None and plan.find("w.weight") is None


def test_presets_and_custom_specs_merge_custom_first() -> None:
    assert set(PRESETS) >= {"llama", "bloom", "chatglm", "mixtral", "deepseek_v2", "qwen2", "phi3"}
    llama = preset("LLaMA")
    assert llama.find("model.layers.0.self_attn.k_proj.weight").partition_type == "column"
    assert llama.find("model.layers.0.mlp.down_proj.weight").partition_type == "row"
    merged = resolve_plan(preset_model="llama", partition_config={
        "layer_specs": [{"patterns": [r".*\.k_proj\.weight$"], "partition_type": "skip"}]})
    assert merged.find("model.layers.0.self_attn.k_proj.weight").partition_type == "skip"
    assert merged.find("model.layers.0.self_attn.q_proj.weight").partition_type == "column"
    replaced = resolve_plan(preset_model="llama", partition_config={"use_default_specs": False, "layer_specs": []})
    assert replaced.find("model.layers.0.self_attn.q_proj.weight") is None
    assert resolve_plan(preset_model=None, partition_config=None) is None
    with pytest.raises(ValueError, match=r"preset_model = 'gpt9'.*llama"):
        preset("gpt9")


def test_a_transformers_tp_plan_becomes_specs() -> None:
    class Model(nn.Module):
        _tp_plan = {"lm_head": "colwise_rep"}

        def __init__(self) -> None:
            super().__init__()
            self.config = type("C", (), {"base_model_tp_plan": {
                "layers.*.self_attn.q_proj": "colwise", "layers.*.self_attn.o_proj": "rowwise",
                "layers.*.self_attn.q_norm": "replicated_with_grad_allreduce", "embed_tokens": "embedding_rowwise"}})()

    plan = hf_tp_plan(Model())
    specs = specs_from_hf_plan(plan)
    kinds = {s.patterns[0]: (s.partition_type, s.gather_output, s.grad_allreduce) for s in specs}
    assert kinds[r".*layers\..*\.self_attn\.q_proj\.weight$"] == ("column", False, False)
    assert kinds[r".*layers\..*\.self_attn\.o_proj\.weight$"] == ("row", False, False)
    assert kinds[r".*lm_head\.weight$"] == ("column", True, False)
    assert kinds[r".*layers\..*\.self_attn\.q_norm\.weight$"] == ("skip", False, True)
    assert kinds[r".*embed_tokens\.weight$"] == ("skip", False, False)
    with pytest.raises(ValueError, match="sequence_parallel"):
        specs_from_hf_plan({"norm": "sequence_parallel"})


def test_slices_are_near_equal_in_whole_units_and_rebuild_the_whole() -> None:
    assert shard_sizes(7, 2) == (4, 3) and shard_sizes(96, 2, unit=16) == (48, 48)
    assert shard_sizes(80, 2, unit=16) == (48, 32)
    full = torch.randn(12, 5)
    qkv = Split.plan(dim=0, total=12, parts=2, sub_sizes=(8, 2, 2))
    locals_ = [qkv.local(full, r) for r in range(2)]
    assert torch.equal(locals_[0], torch.cat([full[0:4], full[8:9], full[10:11]]))
    assert torch.equal(qkv.whole(locals_), full)
    rows = Split.plan(dim=1, total=5, parts=3)
    assert torch.equal(rows.whole([rows.local(full, r) for r in range(3)]), full)


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.q_proj, self.o_proj = nn.Linear(8, 8), nn.Linear(8, 8)
        self.up_proj, self.down_proj = nn.Linear(8, 12, bias=False), nn.Linear(12, 8, bias=False)
        self.gate = nn.Linear(8, 2)


class Tiny(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(10, 8)
        self.layers = nn.ModuleList([Block(), Block()])
        self.proj = nn.Linear(8, 8)
        self.lm_head = nn.Linear(8, 10, bias=False)


def test_deepspeeds_name_rules_split_blocks_and_the_head_only() -> None:
    torch.manual_seed(0)
    whole = Tiny()
    model = Tiny()
    model.load_state_dict(whole.state_dict())
    report = split_model(model, TPGroup(None, 1, 2), None)
    assert report.source == "names"
    assert report.kinds["layers.0.q_proj"] == "column" and report.kinds["layers.1.o_proj"] == "row"
    assert report.kinds["layers.0.down_proj"] == "row" and report.kinds["lm_head"] == "column+gather"
    assert "layers.0.gate" not in report.kinds and "proj" not in report.kinds and "embed" not in report.kinds
    q = model.layers[0].q_proj
    assert isinstance(q, ColumnParallelLinear) and q.weight.shape == (4, 8) and q.weight.tensor_model_parallel
    assert torch.equal(q.weight, whole.layers[0].q_proj.weight[4:]) and torch.equal(q.bias, whole.layers[0].q_proj.bias[4:])
    down = model.layers[0].down_proj
    assert isinstance(down, RowParallelLinear) and torch.equal(down.weight, whole.layers[0].down_proj.weight[:, 6:])
    assert report.replaced[id(report.originals[0])] is model.layers[0].q_proj.weight


def test_a_split_refuses_a_tied_weight_and_strict_mode_refuses_unmatched_linears() -> None:
    model = Tiny()
    model.lm_head.weight = model.embed.weight
    with pytest.raises(ValueError, match=r"lm_head.weight, which another module shares"):
        split_model(model, TPGroup(None, 0, 2), None)
    strict = plan_from_dict({"strict_mode": True, "layer_specs": [{"patterns": [r".*_proj\.weight$"]}]})
    with pytest.raises(ValueError, match=r"strict_mode: no layer spec matches layers.0.gate.weight"):
        split_model(Tiny(), TPGroup(None, 0, 2), strict)


def test_tp_model_init_fills_the_config_and_refuses_conflicts() -> None:
    reset_recorded()
    try:
        tp_model_init(nn.Linear(2, 2), tp_size=2, dtype=torch.bfloat16)
        merged = merge_into_config({"bf16": {"enabled": True}}, mpu=None)
        assert merged["tensor_parallel"]["autotp_size"] == 2 and merged["tensor_parallel"]["tp"]["tp_size"] == 2
        with pytest.raises(ValueError, match=r"tensor_parallel\.autotp_size"):
            merge_into_config({"tensor_parallel": {"autotp_size": 4}}, mpu=None)
        with pytest.raises(ValueError, match="Conflicting dtype"):
            merge_into_config({"fp16": {"enabled": True}}, mpu=None)
        with pytest.raises(ValueError, match="across multiple calls"):
            tp_model_init(nn.Linear(2, 2), tp_size=4, dtype=torch.bfloat16)
        reset_recorded()
        tp_model_init(nn.Linear(2, 2), tp_size=1, dtype=torch.float32, tp_group=object())
        with pytest.raises(ValueError, match="tp_model_init provided tp_group"):
            merge_into_config({}, mpu=object())
    finally:
        reset_recorded()
    assert merge_into_config({"a": 1}, mpu=None) == {"a": 1}


def test_a_batch_counting_the_tp_ranks_is_read_as_deepspeeds_arithmetic_and_said() -> None:
    from shardwise.config import ConfigError, load_config

    base = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 2, "tensor_parallel": {"autotp_size": 2}}
    resolved = load_config({**base, "train_batch_size": 8}, world_size=1)  # 1 data-parallel rank, 2 TP ranks
    assert resolved.batch.train_batch_size == 4
    assert any("issue 7298" in w and "= 4 samples" in w for w in resolved.warnings)
    assert load_config({**base, "train_batch_size": 4}, world_size=1).warnings == []
    with pytest.raises(ConfigError, match="train_batch_size"):
        load_config({**base, "train_batch_size": 6}, world_size=1)
