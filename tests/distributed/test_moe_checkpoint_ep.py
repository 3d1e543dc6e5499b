"""MoE checkpoints across expert-parallel sizes on 2 gloo ranks: expert tensors are saved by global
expert index, so EP=2 resumes at EP=1 and the reverse with bitwise-equal weights and the same loss."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from moe_cases import save_then_resume

from shardwise.testing import run_distributed_cases

pytestmark = pytest.mark.distributed


@pytest.mark.parametrize("stage", [0, 1, 2])
def test_expert_weights_survive_a_change_of_expert_parallelism(tmp_path: Path, stage: int) -> None:
    cases = [
        {"stage": stage, "save_ep": save, "load_ep": load, "dir": str(tmp_path / f"{save}to{load}"),
         "optimizer_states": True}
        for save, load in ((2, 1), (1, 2))
    ]
    results = run_distributed_cases(save_then_resume, cases, world_size=2, timeout=300)
    for case, per_rank in zip(cases, results):
        saved = {k: v for r in per_rank for k, v in r["saved"].items()}
        for r in per_rank:
            assert r["loaded"], case
            for key, value in r["loaded"].items():
                assert torch.equal(value, saved[key]), (case, key)
            assert r["resumed_loss"] == pytest.approx(r["next_loss"], abs=1e-6), case
