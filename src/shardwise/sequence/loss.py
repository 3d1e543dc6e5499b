"""The loss over a sequence split across the sequence-parallel group, reduced as DeepSpeed's ALST does.

Each rank holds a slice of every sequence, so its cross-entropy covers only its own tokens, and
the slices may hold different numbers of counted tokens (labels of ``-100`` -- the padding that
makes a length a multiple of the SP size, the last position with no next token -- count for
nothing). The loss that matches SP=1 is the mean over *all* counted tokens of the sequence:

    loss = sum_r (loss_r * n_r) / sum_r n_r

computed identically on every rank from the per-rank terms gathered with a differentiable
all-gather (:func:`shardwise.comm.sequence_exchange.all_gather_cat`). Its backward sums the
gradient each rank computed for rank ``r``'s term, so rank ``r`` receives ``sp`` times the true
gradient of its own tokens' contribution. ZeRO then averages gradients over the sequence-data-
parallel group (``dp x sp`` ranks, the topology's ``shard_group``): the factor ``sp`` cancels and
each data-parallel replica contributes the gradient of its sequences' token mean, exactly what
SP=1 computes for the same sequences (see ``docs/sequence-parallelism.md``).

A rank whose slice holds no counted token contributes ``0 * n_r = 0`` instead of a NaN: use
:func:`sequence_parallel_cross_entropy`, which works from the token *sum*.

Example (a group of one rank: the plain token mean):
    >>> import torch
    >>> logits = torch.zeros(1, 3, 5)
    >>> labels = torch.tensor([[1, -100, 2]])
    >>> round(sequence_parallel_cross_entropy(logits, labels, group=None).item(), 4)
    1.6094
"""

from __future__ import annotations

import torch
from torch import Tensor

from shardwise.comm.group_type import Group
from shardwise.comm.sequence_exchange import all_gather_cat, all_reduce_sum, group_size

__all__ = ["IGNORE_INDEX", "sequence_parallel_cross_entropy", "token_weighted_loss"]

IGNORE_INDEX = -100
"""The label that counts for nothing (PyTorch's and Hugging Face's convention)."""


def token_weighted_loss(loss: Tensor, num_tokens: Tensor | int, group: Group) -> Tensor:
    """``sum_r loss_r * n_r / sum_r n_r`` over ``group``: the token mean of the whole sequence.

    Args:
        loss: this rank's mean loss over its ``num_tokens`` counted tokens (a scalar).
        num_tokens: this rank's counted tokens.
        group: the sequence-parallel group.

    Returns:
        The same scalar on every rank, differentiable (see the module docstring for the
        gradient convention). A rank with ``num_tokens == 0`` must pass a finite ``loss``.
    """
    n = torch.as_tensor(num_tokens, device=loss.device).to(loss.dtype).reshape(1)
    if group_size(group) == 1:
        return loss
    losses = all_gather_cat(loss.reshape(1), 0, group)
    counts = all_gather_cat(n, 0, group).detach()
    return (losses * counts).sum() / counts.sum()


def sequence_parallel_cross_entropy(
    logits: Tensor, shift_labels: Tensor, group: Group, ignore_index: int = IGNORE_INDEX
) -> Tensor:
    """Token-mean cross-entropy of a sequence split over ``group``, already shifted.

    Args:
        logits: ``[b, s_local, vocab]``, this rank's positions.
        shift_labels: ``[b, s_local]``, the next token of each position (``ignore_index`` where none).
        group: the sequence-parallel group.
        ignore_index: the label that is not counted.

    Returns:
        The mean over every counted token of the whole sequence, identical on every rank,
        finite even when this rank counts no token.
    """
    flat = logits.reshape(-1, logits.shape[-1]).float()
    labels = shift_labels.reshape(-1).to(logits.device)
    total = torch.nn.functional.cross_entropy(flat, labels, ignore_index=ignore_index, reduction="sum")
    if group_size(group) == 1:
        count = (labels != ignore_index).sum().clamp(min=1)
        return total / count
    count = all_reduce_sum((labels != ignore_index).sum().to(total.dtype), group).clamp(min=1)
    return all_gather_cat(total.reshape(1), 0, group).sum() / count
