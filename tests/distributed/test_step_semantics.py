"""What one optimizer step means, on 2 gloo ranks: a non-finite gradient skips the update in
fp32, bf16 and fp16 at every ZeRO stage (counted once, weights stay finite, every rank agrees),
a run of them raises; step() without backward() moves nothing; step hooks act around forward
and after each step and keep their state through a checkpoint. One spawn runs every case."""

from __future__ import annotations

import math

import pytest
import step_cases as cases

from shardwise.testing import run_distributed_cases

pytestmark = pytest.mark.distributed

NONFINITE = [(stage, precision, True) for stage in (0, 1, 2, 3) for precision in ("fp32", "bf16", "fp16")]
NONFINITE += [(stage, "bf16", False) for stage in (1, 3)]  # bf16 without check_grad_overflow
CASES = [*NONFINITE, "limit", "no_backward", "hooks"]


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    tmp = str(tmp_path_factory.mktemp("step_semantics"))
    out = run_distributed_cases(cases.run_scenario, CASES, world_size=2, args=(tmp,), timeout=900)
    return dict(zip(CASES, out, strict=True))


@pytest.mark.parametrize("case", NONFINITE, ids=[f"stage{s}-{p}-check{c}" for s, p, c in NONFINITE])
def test_a_nan_loss_skips_one_step_and_leaves_the_weights_finite(results, case):
    _stage, precision, check = case
    for rank, result in enumerate(results[case]):
        rec = result["record"]
        assert [r["applied"] for r in rec] == [True, False, True, True], (case, rank)
        assert [r["changed"] for r in rec] == [True, False, True, True], (case, rank)
        assert all(r["finite"] for r in rec), (case, rank)
        assert [r["skipped"] for r in rec] == [0, 1, 1, 1], (case, rank)
        assert [r["global_steps"] for r in rec] == [1, 2, 3, 4], (case, rank)
        assert math.isinf(rec[1]["norm"]) and math.isfinite(rec[2]["norm"]), (case, rank)
        if precision == "fp16":
            # the dynamic scaler answers the overflow as before (hysteresis 2 keeps the scale once)
            # and logs it itself: no non-finite warning, nothing counted towards the limit
            assert [r["scale"] for r in rec] == [256.0] * 4, (case, rank)
            assert result["warnings"] == [], (case, rank)
        else:
            assert len(result["warnings"]) == 1 and result["warnings"][0].startswith("step 2:"), (case, rank)
        overflow_seen = precision == "fp16" or (precision == "bf16" and check)
        # the loss scaler sees an overflow only where the precision checks for one, as before
        assert (result["scaler_overflow_iter"] == 1) == overflow_seen, (case, rank)


def test_consecutive_nonfinite_steps_raise_naming_the_limit_the_step_and_the_fix(results):
    for result in results["limit"]:
        error = result["error"]
        assert error is not None
        # steps 1, 2 NaN; 3 finite (resets); 4, 5, 6 NaN: the third in a row raises at step 6
        assert error.startswith("3 consecutive optimizer steps, the last at global step 6,")
        assert "max_consecutive_nonfinite_steps=3" in error and "learning rate" in error
        assert result["global_steps"] == 6 and result["skipped"] == 5 and result["finite"]


def test_step_without_backward_moves_no_counter(results):
    for result in results["no_backward"]:
        assert result["first"] == (0, 0, 0, 0) and result["unchanged"]
        # two backwards, each followed by two step() calls: one optimizer step of 2 micro steps
        assert result["window"] == (1, 8, 2, 0) and result["changed"]
        assert len(result["warnings"]) == 3  # the first call and the two extra ones


def test_step_hooks_run_in_order_adjust_forward_and_keep_state_through_a_checkpoint(results):
    for result in results["hooks"]:
        micro = [("seqlen.forward", 0, True), ("watcher.forward", 2)]
        later = [("seqlen.forward", 1, True), ("watcher.forward", 3)]
        assert result["calls"] == [
            *micro,
            *micro,
            ("seqlen.step", 1, True),
            ("watcher.step", 1),
            *later,
            *later,
            ("seqlen.step", 2, True),
            ("watcher.step", 2),
            ("seqlen.forward", 2, False),  # an eval forward: hooks see it, flagged
            ("watcher.forward", 4),
        ]
        assert result["seen"] == [2, 2, 3, 3, 4]  # the module got the adjusted kwarg
        assert result["restored"] == (2, {"marker": "w"}, 2)
        assert result["kept"] == (7, None)  # no hook state in the checkpoint: nothing changes
        assert len(result["unused_warning"]) == 1 and "seqlen, watcher" in result["unused_warning"][0]
