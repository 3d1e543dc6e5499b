"""The legacy curriculum hook: what the forward receives, state, errors; the truncation helper."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from shardwise.config import load_config
from shardwise.config.errors import ConfigError
from shardwise.data_efficiency.curriculum_hook import build_legacy_curriculum_hook
from shardwise.data_efficiency.truncation import SeqlenTruncation, truncate_to_seqlen
from shardwise.runtime.step_hooks import ForwardContext


def _config(**section: Any) -> Any:
    base = {
        "enabled": True,
        "min_difficulty": 8,
        "max_difficulty": 64,
        "schedule_type": "fixed_linear",
        "schedule_config": {"total_curriculum_step": 7, "difficulty_step": 8},
    }
    return load_config({"train_batch_size": 2, "curriculum_learning": {**base, **section}}).config.curriculum_learning


def test_training_forwards_get_the_difficulty_of_the_next_step() -> None:
    hook = build_legacy_curriculum_hook(_config())
    assert hook is not None
    seen = [hook.adjust_forward((), {"a": 1}, ForwardContext(step, True))[1] for step in range(8)]
    # step s+1 of 7: floor((s+1)/7 * 56 + 8) rounded down to a multiple of 8
    assert [kw["curriculum_seqlen"] for kw in seen] == [16, 24, 32, 40, 48, 56, 64, 64]
    assert all(kw["a"] == 1 for kw in seen)


def test_eval_forwards_get_nothing() -> None:
    hook = build_legacy_curriculum_hook(_config())
    assert hook.adjust_forward((), {}, ForwardContext(3, False)) == ((), {})


def test_disabled_or_absent_builds_no_hook() -> None:
    assert build_legacy_curriculum_hook(load_config({"train_batch_size": 2}).config.curriculum_learning) is None
    assert build_legacy_curriculum_hook(_config(enabled=False)) is None


def test_state_round_trip_continues_the_schedule() -> None:
    a = build_legacy_curriculum_hook(_config())
    a.adjust_forward((), {}, ForwardContext(2, True))
    b = build_legacy_curriculum_hook(_config())
    b.load_state_dict(a.state_dict())
    assert b.schedule.current == a.schedule.current == 32


def test_unknown_curriculum_type_names_the_key() -> None:
    with pytest.raises(ConfigError) as info:
        build_legacy_curriculum_hook(_config(curriculum_type="vocab"))
    assert info.value.key == "curriculum_learning.curriculum_type"


def test_custom_schedule_is_used() -> None:
    hook = build_legacy_curriculum_hook(_config(schedule_type="custom", schedule_config={}))
    hook.set_custom_schedule(lambda step: 8 * step)
    assert hook.adjust_forward((), {}, ForwardContext(1, True))[1] == {"curriculum_seqlen": 16}


def test_truncate_cuts_tensors_longer_than_seqlen_only() -> None:
    x = torch.arange(20).view(2, 10)
    out = truncate_to_seqlen({"ids": x, "n": 3, "short": torch.zeros(2, 2), "pair": (x, [x])}, 4)
    assert out["ids"].tolist() == x[:, :4].tolist()
    assert out["n"] == 3 and out["short"].shape == (2, 2)
    assert out["pair"][0].shape == (2, 4) and out["pair"][1][0].shape == (2, 4)
    assert truncate_to_seqlen(x, None) is x


def test_seqlen_truncation_wrapper_calls_the_model_on_cut_inputs() -> None:
    seen = []

    class Model(torch.nn.Module):
        def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
            seen.append((x.shape, y.shape))
            return x.sum()

    wrapped = SeqlenTruncation(Model())
    wrapped(torch.ones(2, 10), y=torch.ones(2, 10), curriculum_seqlen=6)
    wrapped(torch.ones(2, 10), y=torch.ones(2, 10))
    assert seen == [((2, 6), (2, 6)), ((2, 10), (2, 10))]
