"""shardwise.checkpointing.checkpoint / non_reentrant_checkpoint in one process: the recompute runs,
gradients and RNG draws equal plain execution (dropout on, tracker streams included), saved
bytes drop, frozen inputs still give the block's parameters gradients, no_grad runs plainly."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from shardwise import checkpointing
from shardwise.testing.models import GPTConfig, TinyGPT

GPT = GPTConfig(vocab_size=64, block_size=16, n_layer=3, n_head=2, n_embd=32, dropout=0.2)
MODES = {"reentrant": checkpointing.checkpoint, "non_reentrant": checkpointing.non_reentrant_checkpoint}
STORAGE = {
    "kept": {},
    "partition_mp1": {"partition_activations": True},
    "contiguous": {"partition_activations": True, "contiguous_checkpointing": True, "num_checkpoints": 3},
    "cpu": {"checkpoint_in_cpu": True},
}


@pytest.fixture(autouse=True)
def _defaults() -> Iterator[None]:
    checkpointing.configure(None)
    yield
    checkpointing.configure(None)


def _run(fn: Any) -> dict[str, Any]:
    torch.manual_seed(0)
    model = TinyGPT(GPT)
    model.checkpoint_fn = fn
    calls = [0]
    for block in model.blocks:
        block.register_forward_pre_hook(lambda *_: calls.__setitem__(0, calls[0] + 1))
    torch.manual_seed(5)
    x, y = torch.randint(0, 64, (2, 16)), torch.randint(0, 64, (2, 16))
    with checkpointing.SavedActivationMeter(exclude=model.parameters()) as meter:
        loss = model(x, y)
        peak = meter.peak_bytes
        loss.backward()
    return {
        "loss": loss.item(),
        "grads": [p.grad for p in model.parameters()],
        "peak": peak,
        "left": meter.current_bytes,
        "calls": calls[0],
        "next_draw": torch.rand(1).item(),
    }


@pytest.mark.parametrize("storage", STORAGE)
@pytest.mark.parametrize("mode", MODES)
def test_checkpointed_gpt_matches_plain_execution_bit_for_bit(mode: str, storage: str) -> None:
    plain = _run(None)
    checkpointing.configure(None, **STORAGE[storage])
    ckpt = _run(MODES[mode])
    assert ckpt["loss"] == plain["loss"]
    assert all(torch.equal(a, b) for a, b in zip(ckpt["grads"], plain["grads"], strict=True))
    assert ckpt["next_draw"] == plain["next_draw"]  # the recompute's draws were replayed, then undone
    assert ckpt["calls"] == 2 * plain["calls"] == 2 * GPT.n_layer  # each block ran again in backward
    assert ckpt["peak"] < plain["peak"] / 4  # only the block inputs are kept
    assert ckpt["left"] == plain["left"] == 0  # backward released everything


def test_the_rng_tracker_stream_is_replayed_in_the_recompute() -> None:
    """Dropout drawn from the model-parallel stream (Megatron style) gets the same mask twice."""
    lin = nn.Linear(8, 8)

    def block(x: torch.Tensor) -> torch.Tensor:
        with checkpointing.get_cuda_rng_tracker().fork():
            return F.dropout(lin(x), p=0.5, training=True)

    def grads(fn: Any) -> tuple[torch.Tensor, torch.Tensor]:
        checkpointing.model_parallel_cuda_manual_seed(11)
        lin.zero_grad()
        x = torch.ones(4, 8, requires_grad=True)
        (fn(block, x) if fn else block(x)).sum().backward()
        return lin.weight.grad.clone(), checkpointing.get_cuda_rng_tracker().get_states()[
            "model-parallel-rng"
        ]

    plain_grad, plain_state = grads(None)
    for fn in MODES.values():
        grad, state = grads(fn)
        assert torch.equal(grad, plain_grad) and torch.equal(state, plain_state)


@pytest.mark.parametrize("mode", MODES)
def test_frozen_inputs_still_give_the_block_parameters_gradients(mode: str) -> None:
    lin = nn.Linear(4, 4)
    x = torch.randn(2, 4)  # no input requires grad (frozen embeddings under LoRA)
    MODES[mode](lin, x).sum().backward()
    expected = torch.ones(2, 4).t() @ x
    assert lin.weight.grad is not None and torch.allclose(lin.weight.grad, expected)


def test_under_no_grad_the_block_just_runs() -> None:
    calls = []
    with torch.no_grad():
        out = checkpointing.checkpoint(lambda t: calls.append(1) or t * 2, torch.ones(2))
    assert torch.equal(out, torch.full((2,), 2.0)) and calls == [1]


def test_non_tensor_arguments_pass_through() -> None:
    x = torch.ones(3, requires_grad=True)
    for fn in MODES.values():
        fn(lambda t, k, name: t * k if name == "scale" else t, x, 3.0, "scale").sum().backward()
    assert torch.equal(x.grad, torch.full((3,), 6.0))
