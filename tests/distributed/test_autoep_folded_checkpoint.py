"""A folded AutoEP + AutoTP run's checkpoint on 4 gloo ranks (tp=2, ep=2, ZeRO 0): DeepSpeed's per-lane
model, expert and optimizer files are written, a fresh folded engine resumes to exactly the saved
weights and takes the same next step, and a load is refused without the files' layout record or
with another expert-parallel size (naming the axis)."""

from __future__ import annotations

from pathlib import Path

import pytest
from autoep_folded_checkpoint_cases import save_resume_refuse

from shardwise.testing import run_distributed_cases

pytestmark = pytest.mark.distributed


def test_folded_checkpoint_resumes_and_refuses_another_layout(tmp_path: Path) -> None:
    (runs,) = run_distributed_cases(save_resume_refuse, [{"dir": str(tmp_path)}], world_size=4, timeout=600)
    assert runs[0]["files"] == [
        "expp_rank_0_mp_rank_00_optim_states.pt", "expp_rank_1_mp_rank_01_optim_states.pt",
        *(f"layer_{lay}_expert_{e}_mp_rank_{e // 2:02d}_model_states.pt" for lay in (0, 1) for e in range(4)),
        "mp_rank_00_model_states.pt", "mp_rank_01_model_states.pt",
    ]
    for rank, run in enumerate(runs):
        assert run["differed"] and run["equal_after_load"] and run["equal_after_step"], (rank, run)
        assert "Missing AutoEP+AutoTP folding metadata" in run["missing"], (rank, run["missing"])
        assert "mismatch for ep_size" in run["other_layout"], (rank, run["other_layout"])
        assert "saved=2 runtime=4" in run["other_layout"], (rank, run["other_layout"])
