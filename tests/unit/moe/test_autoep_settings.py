"""The expert_parallel (AutoEP) section: what is acted on, what is refused by name."""

from __future__ import annotations

import pytest
import torch

from shardwise.moe.autoep import AutoEPSettings, autoep_settings, repoint


def test_disabled_or_missing_sections_do_nothing() -> None:
    assert autoep_settings(None) is None
    assert autoep_settings({"enabled": False, "autoep_size": 4}) is None


def test_enabled_section_is_read() -> None:
    got = autoep_settings({"enabled": True, "autoep_size": 2, "preset_model": "qwen3_moe", "top_k": 1})
    assert got == AutoEPSettings(autoep_size=2, preset_model="qwen3_moe", top_k=1)


@pytest.mark.parametrize(
    ("section", "match"),
    [
        ({"enabled": True, "load_balance_coeff": 0.01}, r"expert_parallel\.load_balance_coeff .*not supported"),
        ({"enabled": True, "autoep_size": 0}, r"expert_parallel\.autoep_size = 0"),
        ({"enabled": True, "preset_model": "llama"}, r"expert_parallel\.preset_model = 'llama'"),
        ({"enabled": True, "top_k": True}, r"expert_parallel\.top_k"),
    ],
)
def test_bad_keys_are_refused_by_name(section: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        autoep_settings(section)


def test_parameter_lists_are_repointed() -> None:
    old, new, other = (torch.nn.Parameter(torch.zeros(1)) for _ in range(3))
    replaced = {id(old): new}
    assert repoint([old, other], replaced) == [new, other]
    groups = repoint([{"params": [old], "lr": 0.1}], replaced)
    assert groups[0]["params"] == [new] and groups[0]["lr"] == 0.1
