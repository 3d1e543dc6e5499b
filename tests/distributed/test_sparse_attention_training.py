"""A tiny BERT-style model with sparse self-attention trains on 2 gloo ranks at ZeRO 2."""

from __future__ import annotations

import pytest
import sparse_attention_cases as cases

from shardwise.testing import run_distributed_cases

pytestmark = pytest.mark.distributed


def test_tiny_bert_with_sparse_self_attention_trains_at_zero_2() -> None:
    results = run_distributed_cases(cases.train_sparse_bert, ["bigbird", "fixed"], world_size=2, timeout=600)
    for mode, ranks in zip(["bigbird", "fixed"], results, strict=True):
        first, second = ranks
        expected = {"bigbird": "BigBirdSparsityConfig", "fixed": "FixedSparsityConfig"}[mode]
        assert first["attention"] == expected and first["built"] == expected
        assert not [m for m in first["ignored"] if "sparse_attention" in m]
        assert first["query_moved"], mode  # gradients flow through the sparse attention
        assert first["params"] == second["params"], mode  # ZeRO 2 keeps the replicas identical
        losses = first["losses"]
        assert all(loss == loss for loss in losses), mode  # no NaN from the padded keys
        assert sum(losses[-5:]) / 5 < 0.8 * sum(losses[:5]) / 5, (mode, losses)
