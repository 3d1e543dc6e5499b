"""The token-weighted loss and the batch helpers on one process (shardwise.sequence.loss, .data)."""

from __future__ import annotations

import torch

from shardwise.sequence.data import pad_to_multiple, shift_labels
from shardwise.sequence.loss import sequence_parallel_cross_entropy, token_weighted_loss


def test_cross_entropy_is_the_token_mean_and_finite_without_tokens() -> None:
    torch.manual_seed(0)
    logits = torch.randn(1, 6, 5, requires_grad=True)
    labels = torch.tensor([[1, 2, -100, 3, -100, 4]])
    loss = sequence_parallel_cross_entropy(logits, labels, group=None)
    expected = torch.nn.functional.cross_entropy(logits.view(-1, 5), labels.view(-1), ignore_index=-100)
    torch.testing.assert_close(loss, expected)
    empty = sequence_parallel_cross_entropy(logits, torch.full((1, 6), -100), group=None)
    assert empty.item() == 0.0
    empty.backward()
    assert torch.isfinite(logits.grad).all()


def test_token_weighted_loss_without_a_group_is_the_loss() -> None:
    loss = torch.tensor(2.5)
    assert token_weighted_loss(loss, 7, group=None) is loss


def test_shift_and_pad() -> None:
    assert shift_labels(torch.tensor([[5, 6, 7]])).tolist() == [[6, 7, -100]]
    batch = {
        "input_ids": torch.tensor([[1, 2, 3]]),
        "position_ids": torch.tensor([[4, 5, 6]]),
        "shift_labels": torch.tensor([[2, 3, -100]]),
        "attention_mask": torch.ones(1, 3),
        "tag": "x",
    }
    padded = pad_to_multiple(batch, 4, pad_token_id=0)
    assert padded["input_ids"].tolist() == [[1, 2, 3, 0]]
    assert padded["position_ids"].tolist() == [[4, 5, 6, 7]]
    assert padded["shift_labels"].tolist() == [[2, 3, -100, -100]]
    assert padded["attention_mask"].tolist() == [[1, 1, 1, 0]]
    assert padded["tag"] == "x"
    assert pad_to_multiple(batch, 3, pad_token_id=0)["input_ids"].tolist() == [[1, 2, 3]]
