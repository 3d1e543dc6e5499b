"""``deepspeed.utils.safe_get/set_full_*`` and ``*_local_*`` at ZeRO stages 0-3, fp32 and bf16, on 2 gloo ranks."""

from __future__ import annotations

import param_access_cases as cases
import pytest
import torch

from shardwise.testing import run_distributed_cases

pytestmark = pytest.mark.distributed

CASES = [(0, "fp32"), (1, "bf16"), (2, "fp32"), (2, "bf16"), (3, "fp32"), (3, "bf16")]


def _whole(pieces: list[torch.Tensor], full: torch.Tensor) -> torch.Tensor:
    """The ranks' local parts put together (an unsharded parameter's part is the whole value)."""
    return pieces[0] if pieces[0].shape == full.shape else torch.cat(pieces)


def test_getters_and_setters_follow_each_stage() -> None:
    results = run_distributed_cases(cases.access, CASES, world_size=2, timeout=900)
    for (stage, precision), ranks in zip(CASES, results):
        label = f"stage {stage} {precision}"
        for result in ranks:
            assert "only available after a backward" in result["before_backward"], label
            assert "only available after a backward" in result["after_step"], label
            assert (
                "'momentum_buffer' not found" in result["no_state_key"]
                and "exp_avg" in result["no_state_key"]
            )
            assert result["masters_match_module"], label
            # the full gradient is the mean over ranks (bf16: computed in bf16, so only close)
            assert result["grad_error"] < (1e-4 if precision == "fp32" else 5e-2), (
                label,
                result["grad_error"],
            )
            # exp_avg / exp_avg_sq / the updated master equal a torch AdamW fed the gathered values
            assert result["step1_error"] < 1e-5, (label, result["step1_error"])
            assert result["written"], label
            # the written fp32 value, exp_avg and gradient are what the next step used
            assert result["step2_error"] < 1e-5, (label, result["step2_error"])
            if stage < 3:
                assert "use safe_get_full_fp32_param" in result["local_fp32"], label
        if stage == 3:
            rank0, rank1 = ranks
            for name, full in rank0["full_masters"].items():
                assert torch.equal(full, rank1["full_masters"][name])
                assert torch.equal(
                    _whole([rank0["local_pieces"][name], rank1["local_pieces"][name]], full), full
                )
                grad = rank0["full_grads"][name]
                assert torch.equal(
                    _whole([rank0["local_grads"][name], rank1["local_grads"][name]], grad), grad
                )
