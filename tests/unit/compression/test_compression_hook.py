"""The compression step hook: built for a prepared model, advances the scheduler to the
engine's global step, and round-trips the scheduler's state."""

from __future__ import annotations

from torch import nn

from shardwise.compression.compress import init_compression
from shardwise.compression.hook import build_compression_hook
from shardwise.runtime.step_hooks import ForwardContext, StepOutcome

CFG = {
    "compression_training": {
        "weight_quantization": {
            "shared_parameters": {"enabled": True, "schedule_offset": 2},
            "different_groups": {
                "wq": {"params": {"start_bits": 8, "target_bits": 4, "quantization_period": 1}}
            },
        }
    }
}


def test_the_hook_follows_the_global_step_and_only_exists_for_a_prepared_model():
    assert build_compression_hook(nn.Linear(4, 4)) is None
    model = init_compression(nn.Sequential(nn.Linear(4, 4)), CFG)
    hook = build_compression_hook(model)  # prepared by the script: the config need not repeat it
    assert hook is not None and hook.name == "compression"
    technique = model[0].compression["weight_quantization"]
    assert not technique.active
    assert hook.adjust_forward((1,), {}, ForwardContext(global_step=0, training=True)) == ((1,), {})
    hook.after_optimizer_step(StepOutcome(global_step=3, global_samples=6, applied=True, grad_norm=1.0))
    assert technique.active and technique.bits == 7
    state = hook.state_dict()
    hook.after_optimizer_step(
        StepOutcome(global_step=9, global_samples=18, applied=False, grad_norm=float("inf"))
    )
    assert technique.bits == 5  # 7 quantized steps: drops after 1, 2 and 4
    hook.load_state_dict(state)
    assert hook.scheduler.training_steps == 3 and technique.bits == 7
