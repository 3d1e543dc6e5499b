"""engine.config read like DeepSpeed's config dict; accelerate's infinite steps_per_print (issue 13)."""

from __future__ import annotations

import pytest

from shardwise.config import load_config


def test_infinite_steps_per_print_means_never() -> None:
    # accelerate always writes float("inf")
    assert (
        load_config({"train_batch_size": 2, "steps_per_print": float("inf")}).config.steps_per_print is None
    )
    with pytest.raises(Exception, match="steps_per_print"):
        load_config({"train_batch_size": 2, "steps_per_print": float("nan")})


def test_resolved_config_reads_like_deepspeeds_dict() -> None:
    cfg = load_config({"train_batch_size": 4, "zero_optimization": {"stage": 3}, "bf16": {"enabled": True}})
    assert cfg.get("zero_optimization", {}).get("stage") == 3
    assert cfg["bf16"]["enabled"] is True
    assert "fp16" in cfg and "no_such_key" not in cfg
    assert cfg.get("no_such_key", "default") == "default"
    with pytest.raises(KeyError):
        cfg["no_such_key"]
