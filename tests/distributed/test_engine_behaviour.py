"""Engine behaviour on 2 gloo ranks: overflow handling, frozen/unused parameters,
no_sync, averaging options, client optimizers/schedulers, the data loader, amp and mpu."""

from __future__ import annotations

import math

import engine_cases as cases
import pytest
import torch

from shardwise.testing import run_distributed, run_distributed_cases

pytestmark = pytest.mark.distributed


def _run_grid(fn, stages=(0, 1, 2)):
    return dict(zip(stages, run_distributed_cases(fn, list(stages), world_size=2, timeout=600)))


def test_fp16_overflow_on_one_rank_skips_the_step_everywhere():
    for stage, ranks in _run_grid(cases.overflow_skips_the_step).items():
        for result in ranks:
            rec = result["record"]
            assert [r["applied"] for r in rec] == [True, False, False, True], stage
            assert [r["changed"] for r in rec] == [True, False, False, True], stage
            # hysteresis 2: the first overflow spends the budget, the second halves 16 -> 8
            assert [r["scale"] for r in rec] == [16.0, 16.0, 8.0, 8.0], stage
            assert [r["skipped"] for r in rec] == [0, 1, 2, 2]
            assert [r["global_steps"] for r in rec] == [1, 2, 3, 4]
            # the scheduler steps only on applied steps
            assert [r["sched_iter"] for r in rec] == [0, 0, 0, 1]
            assert math.isinf(rec[1]["norm"]) and math.isfinite(rec[3]["norm"])


def test_frozen_parameters_stay_and_unused_ones_still_step():
    for stage, ranks in _run_grid(cases.frozen_and_unused_parameters).items():
        for result in ranks:
            assert result["frozen_equal"] and result["frozen_grad_none"], stage
            assert result["sometimes_moves"] == [False, True, False], stage
            assert result["steps"] == 3


def test_no_sync_then_synced_backward_equals_accumulation():
    for stage, ranks in _run_grid(cases.no_sync_equals_accumulation, stages=(0, 1)).items():
        for result in ranks:
            assert result["max_diff"] < 1e-7, stage
    errors = run_distributed(cases.no_sync_refused_at_stage_2, 2, args=(2,), timeout=300)
    assert all("stage 2" in e["error"] and e["assertion"] for e in errors)


def test_averaging_options_and_wire_dtypes_give_the_same_mean():
    for _stage, ranks in _run_grid(cases.communication_options_keep_the_mean).items():
        result = ranks[0]
        default = torch.tensor(result["default"])
        scale = default.abs().max()
        ulp = 3e-7  # deltas are differences of parameters up to ~1.0: one fp32 ulp there is 1.2e-7
        for name, delta in result.items():
            delta = torch.tensor(delta)
            if name == "sum_op":  # no averaging: the update doubles at W=2 (as DeepSpeed, spec 7.2)
                torch.testing.assert_close(delta, 2 * default, rtol=1e-5, atol=ulp)
            elif name == "comm_bf16":  # gradients travel in bf16: 2^-8 relative rounding
                torch.testing.assert_close(delta, default, rtol=1e-2, atol=1e-2 * scale)
            else:
                torch.testing.assert_close(delta, default, rtol=1e-5, atol=ulp)


def test_client_optimizer_callable_and_torch_scheduler():
    for stage, ranks in _run_grid(cases.client_optimizer_and_schedulers).items():
        result = ranks[0]
        assert result["client_type"] == "AdamW", stage
        assert result["client_lrs"] == [pytest.approx(3e-3 * 0.5**3)]
        assert result["callable_type"] == "SGD" and result["callable_lr"] == [0.25]


def test_training_data_loader_reshuffles_each_epoch_and_counters_follow_deepspeed():
    for _stage, ranks in _run_grid(cases.data_loader_and_counters).items():
        a, b = ranks
        assert a["len"] == 4  # 16 samples / 2 ranks / micro batch 2
        assert a["orders"][0] != a["orders"][1], "set_epoch must change the order"
        first_tokens = {t for batch in a["orders"][0] + b["orders"][0] for t in batch}
        assert len(first_tokens) > 1
        assert a["global_steps"] == 4 and a["micro_steps"] == 8 and a["global_samples"] == 4 * 8
        assert tuple(a["batch_info"]) == (8, 2, 2)


def test_amp_and_torch_autocast_run_the_forward_in_16_bit_with_fp32_params():
    for _stage, ranks in _run_grid(cases.amp_and_autocast_train, stages=(1,)).items():
        result = ranks[0]
        assert result["amp"] == {
            "param_dtype": "torch.float32",
            "act_dtype": "torch.float16",
            "finite": True,
            "policy": "autocast-float16",
        }
        assert result["autocast_bf16"]["act_dtype"] == "torch.bfloat16"
        assert result["autocast_bf16"]["policy"] == "autocast-bfloat16"


def test_model_parallel_norm_counts_replicated_parameters_once():
    for stage, ranks in _run_grid(cases.mpu_clipping_norm, stages=(0, 1)).items():
        expected = math.sqrt(ranks[0]["tp_sq"] + ranks[1]["tp_sq"] + ranks[0]["rep_sq"])
        for result in ranks:
            assert result["norm"] == pytest.approx(expected, rel=1e-5), stage


def test_stages_0_to_2_reduce_finished_chunks_during_backward_with_identical_results():
    # the whole model in one bucket: reduced at the end of backward (chunk >= bucket), or in
    # ~300-element pieces as backward finishes them; over gloo (one host's ranks would otherwise
    # reduce through shared memory, in whole buckets at the end of backward)
    stages = (0, 1, 2)
    cases_ = [{"stage": stage, "chunk": chunk} for stage in stages for chunk in (1 << 30, 300)]
    results = run_distributed_cases(
        cases.reduction_overlaps_backward,
        cases_,
        world_size=2,
        timeout=300,
        env={"SHARDWISE_SHM_COLLECTIVES": "0"},
    )
    for stage, whole, chunked in zip(stages, results[0::2], results[1::2]):
        for a, b in zip(whole, chunked):
            assert a["losses"] == b["losses"], stage
            assert torch.equal(a["params"], b["params"]), stage
            # stages 1-2: only the shard owners get sums; stage 2 reduces every micro step (2 per step)
            kind = "all_reduce" if stage == 0 else "exchange"
            per_step = 2 if stage == 2 else 1
            assert a["gradient_reductions"] == [kind] * 3 * per_step, stage
            assert len(b["gradient_reductions"]) >= 3 * per_step * 5, stage  # really split up
            assert set(b["gradient_reductions"]) == {kind}, stage


@pytest.mark.parametrize("transport", [{}, {"SHARDWISE_SHM_COLLECTIVES": "0"}], ids=["shm", "gloo"])
def test_ranks_with_different_or_repeated_gradients_reduce_the_same_pieces(transport):
    grid = [{"stage": s, "reentrant": r} for s in (0, 1, 2) for r in (None, False, True)]
    results = run_distributed_cases(
        cases.divergent_gradient_patterns, grid, world_size=2, timeout=300, env=transport
    )
    by_case = {(c["stage"], c["reentrant"]): r for c, r in zip(grid, results)}
    for stage in (0, 1, 2):
        plain = by_case[(stage, None)]
        for reentrant in (False, True):
            checkpointed = by_case[(stage, reentrant)]
            for a, b in zip(plain, checkpointed):
                assert a["losses"] == b["losses"], (stage, reentrant)
                assert torch.equal(a["params"], b["params"]), (stage, reentrant)
        assert torch.equal(plain[0]["params"], plain[1]["params"])  # the ranks agree


def test_destroy_removes_the_gradient_hooks():
    for stage, ranks in _run_grid(cases.destroy_detaches_gradient_hooks).items():
        for result in ranks:
            assert result["before"]["fired"] > 0 and result["before"]["collectives"] > 0, stage
            assert result["after"] == {"fired": 0, "collectives": 0}, stage
            assert result["grads_are_autograds"], stage
