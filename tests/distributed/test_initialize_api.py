"""``initialize``'s DeepSpeed-compatible API on one rank: config sources, errors, batch changes."""

from __future__ import annotations

import initialize_cases
import pytest

from shardwise.testing import run_distributed

pytestmark = pytest.mark.distributed


def test_initialize_api(tmp_path):
    (out,) = run_distributed(initialize_cases.api_scenarios, 1, args=(str(tmp_path),), timeout=300)
    assert out["from_args"] == (2, "FusedAdam", None, None)  # DeepSpeed's class for "AdamW"
    assert out["alias"] == 2 and out["config_params"] == 2
    assert "both on the command line and to initialize" in out["both"]
    assert "needs a config" in out["none"]
    assert "needs model" in out["no_model"]
    opt, error = out["no_optimizer"]
    assert opt is None and "needs an optimizer" in error and "optimizer" in error
    assert tuple(out["stage3"]) == (3, 1)
    assert "zero_allow_untested_optimizer" in out["lamb_stage1"] and "Lamb" in out["lamb_stage1"]
    assert out["lamb_stage0_steps"] == 1
    assert tuple(out["set_tbs"]) == (8, 2, 4)
    assert tuple(out["set_tbs_config"]) == (8, 2, 4)  # engine.config and checkpoints see it too
    assert tuple(out["set_mbs"]) == (4, 1, 4)
    assert "multiple of micro batch" in out["bad_tbs"]
    assert out["getattr"] == (0, True)
    # bad learning rates are ConfigErrors naming the key, not torch's TypeError/ValueError
    assert out["lr_fast"].startswith("ConfigError: 'optimizer.params.lr' = 'fast'")
    assert out["lr_nan"].startswith("ConfigError: 'optimizer.params.lr' = nan")
    assert out["lr_negative"].startswith("ConfigError: 'optimizer.params.lr' = -0.001")
    assert all("fix:" in out[f"lr_{name}"] for name in ("fast", "nan", "negative"))
    assert out["not_utf8"].startswith("ConfigError:") and "latin1.json" in out["not_utf8"]
    assert "not UTF-8" in out["not_utf8"] and "fix:" in out["not_utf8"]
    # a setting shardwise ignores is named once, with what happens instead
    (warning,) = out["offload_param_warnings"]
    assert "'zero_optimization.offload_param'" in warning and "stage 3 only" in warning


def test_view_buffers_are_broadcast_safely():
    """A transposed buffer gets rank 0's values; an expanded one cannot be written element-wise: equal
    ones pass, differing ones are an error naming the buffer (broadcasting into it corrupted memory)."""
    outs = run_distributed(initialize_cases.odd_buffers, 2, timeout=300)
    for rank, out in enumerate(outs):
        assert out["transposed"] == [[float(4 * r + c) for r in range(3)] for c in range(4)]
        assert out["expanded"] == [[0.0] * 4] * 3
        assert "expanded views" in out["differs"]  # on every rank: none goes on alone to hang
        assert ("'expanded'" if rank == 1 else "(on another rank)") in out["differs"]


def test_returned_optimizer_is_deepspeeds_choice():
    """Stage 0 fp32: the bare torch optimizer (the client's object, its callable's, FusedAdam for
    "Adam"), as DeepSpeed returns; ZeRO stages and 16-bit training: the strategy. A script's
    zero_grad() on the bare one changes no step."""
    (out,) = run_distributed(initialize_cases.returned_optimizers, 1, timeout=300)
    assert out["client_object"] and out["callable_class"] == "AdamW"
    assert out["config_fusedadam_True"] and out["config_fusedadam_False"]
    assert out["stage1_strategy"] and out["bf16_strategy"]
    assert out["trained"] and out["zero_grad_harmless"]


def test_zero_force_ds_cpu_optimizer_refuses_a_client_torch_optimizer_with_offload():
    (out,) = run_distributed(initialize_cases.offload_client_optimizers, 1, timeout=300)
    assert "zero_force_ds_cpu_optimizer" in out["forced"] and "DeepSpeedCPUAdam" in out["forced"]
    assert out["opted_out"] == "Adam" and out["cpu_adam"] == "DeepSpeedCPUAdam"
