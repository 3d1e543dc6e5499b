"""``expert_parallel.use_grouped_mm`` through ``initialize``: bf16 AutoEP training on 2 gloo ranks with
the experts as ``torch._grouped_mm`` equals the loop of matrix products bit for bit (torch's CPU grouped
GEMM computes the same per-group products), and the grouped kernel is what ran; ``gate_up_impl: "fused"``
reaches the experts and gives the same first loss."""

from __future__ import annotations

import pytest
import torch
from autoep_grouped_cases import train_bf16

from shardwise.testing import run_distributed_cases

pytestmark = pytest.mark.distributed


def test_grouped_mm_trains_as_the_loop() -> None:
    cases = [{"grouped": True}, {"grouped": False}, {"grouped": True, "gate_up": "fused"}]
    grouped, loop, fused = run_distributed_cases(train_bf16, cases, world_size=2, timeout=600)
    for rank in range(2):
        assert grouped[rank]["kernels"] == ["grouped_mm"] and loop[rank]["kernels"] == ["loop"]
        assert grouped[rank]["loss"] == loop[rank]["loss"]
        assert grouped[rank]["loss"][-1] < grouped[rank]["loss"][0]
        for name, weight in loop[rank]["weights"].items():
            assert torch.equal(grouped[rank]["weights"][name], weight), name
        # gate_up_impl="fused" reaches the experts; its forward is the separate one bit for bit (the
        # first loss), its input gradients round once instead of twice (later steps differ slightly)
        assert fused[rank]["kernels"] == ["fused", "grouped_mm"]
        assert fused[rank]["loss"][0] == grouped[rank]["loss"][0]
        assert fused[rank]["loss"][-1] < fused[rank]["loss"][0]
