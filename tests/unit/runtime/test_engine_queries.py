"""DeepSpeed's engine queries and hand-offs on a single-process engine (a world of one): ranks and
groups from the topology, DeepCompile's answers with the feature off, ``get_type``, ``super_offload``,
the data post-processing function, random-LTD's re-binding, and the refusals. The values DeepSpeed
0.19.8 gives for the same engine (CPU, stage 1, AdamW, one param group) are recorded beside each."""

from __future__ import annotations

import logging
from typing import Any

import pytest
import torch
from torch.utils.data import SequentialSampler

import shardwise
from shardwise.data_efficiency import convert_to_random_ltd
from shardwise.data_efficiency.random_ltd import random_ltd_layers
from shardwise.engine import ShardwiseEngine
from shardwise.testing.models import Block, GPTConfig, TinyGPT, TokenDataset

TINY = GPTConfig(vocab_size=64, block_size=16, n_layer=3, n_head=2, n_embd=32)


def _config(**extra: Any) -> dict[str, Any]:
    return {
        "train_micro_batch_size_per_gpu": 2,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
        "zero_optimization": {"stage": 1},
        **extra,
    }


def test_queries_answer_as_deepspeed_does(caplog: pytest.LogCaptureFixture) -> None:
    torch.manual_seed(0)
    engine, *_ = shardwise.initialize(model=TinyGPT(TINY), config=_config())
    assert engine.get_type() == [0.0]  # DeepSpeed: [0.0]
    assert (
        engine.get_data_parallel_rank(),
        engine.get_model_parallel_rank(),
        engine.get_tensor_parallel_rank(),
    ) == (0, 0, 0)
    assert engine.get_sequence_parallel_group() is None
    assert engine.is_first_weights_partition_group() is False  # DeepSpeed: False at stage 1
    # DeepSpeed with DeepCompile off: False False False []
    assert (
        engine.is_deepcompile_enabled(),
        engine.is_deepcompile_active(),
        engine.uses_parallelization_pass_only(),
    ) == (
        False,
        False,
        False,
    )
    assert engine.get_compile_time() == []
    assert engine.super_offload() is False
    assert isinstance(engine.collect_python_gc(), int)
    # DeepSpeed: True False True (a list is map-style; a TensorDataset too)
    assert ShardwiseEngine.is_map_style_dataset([1, 2]) and not engine.is_iterable_style_dataset([1])
    assert engine.is_map_style_dataset(torch.utils.data.TensorDataset(torch.zeros(2)))
    with pytest.raises(NotImplementedError, match="no DeepCompile graph passes"):
        engine.register_compile_pass("z3", lambda graph: graph)
    with pytest.raises(AssertionError, match="random_ltd enabled"):  # DeepSpeed: AssertionError too
        engine.random_ltd_initialize()
    with pytest.raises(ValueError, match="no training data loader"):
        engine.set_data_post_process_func(lambda data, state: data)
    with pytest.raises(ValueError, match="reduce_bucket_size"):
        engine.allreduce_gradients(bucket_size=1024)
    with caplog.at_level(logging.INFO, logger="shardwise"):
        engine.print_forward_breakdown(12.345)
    assert "time (ms) | fwd: 12.35" in caplog.text


class _StatefulSampler(SequentialSampler):
    """A sampler with the curriculum sampler's post-processing state."""

    def post_process_state(self) -> dict[str, Any]:
        return {"current_difficulties": {"seqlen": 4}, "curriculum_step": 1}


def test_data_post_process_func_reaches_the_training_loader() -> None:
    torch.manual_seed(0)
    data = TokenDataset(8, TINY.block_size, TINY.vocab_size, seed=3)
    engine, *_ = shardwise.initialize(model=TinyGPT(TINY), training_data=data, config=_config())
    with pytest.raises(ValueError, match="without a curriculum sampler"):
        engine.set_data_post_process_func(lambda batch, state: batch)
    engine.training_dataloader = engine.deepspeed_io(data, data_sampler=_StatefulSampler(data))
    engine.set_data_post_process_func(
        lambda batch, state: [t[:, : state["current_difficulties"]["seqlen"]] for t in batch]
    )
    x, y = next(iter(engine.training_dataloader))
    assert x.shape == (2, 4) and y.shape == (2, 4)  # truncated to the state's difficulty


def test_random_ltd_initialize_rebinds_the_wrapped_layers() -> None:
    torch.manual_seed(0)
    model = convert_to_random_ltd(TinyGPT(TINY), Block)
    ltd = {
        "enabled": True,
        "data_routing": {
            "enabled": True,
            "random_ltd": {
                "enabled": True,
                "total_layer_num": 3,
                "random_ltd_layer_num": 2,
                "random_ltd_layer_id": [0, 2],
                "model_type": "decoder",
                "hidden_state_order": "seq_batch_dim",
                "random_ltd_schedule": {
                    "min_value": 4,
                    "max_value": 16,
                    "schedule_type": "fixed_linear",
                    "schedule_config": {"require_steps": 6, "seq_per_step": 2},
                },
            },
        },
    }
    engine, *_ = shardwise.initialize(model=model, config=_config(data_efficiency=ltd))
    layers = random_ltd_layers(engine.module)
    for layer in layers:  # as if the layers were re-made after initialize
        layer.seq_dim, layer.kept_tokens = 1, None
    engine.random_ltd_initialize()
    active = [layer for layer in layers if layer.layer_id in (0, 2)]
    assert [layer.seq_dim for layer in active] == [0, 0]
    assert [layer.kept_tokens for layer in active] == [4, 4]  # the schedule's current kept length
    assert engine.step_hooks.named("random_ltd").layers == active
