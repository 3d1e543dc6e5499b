"""Cut a batch to the curriculum's sequence length, for models whose forward does not take
``curriculum_seqlen`` themselves.

DeepSpeed's contract (spec 12.1) leaves truncation to the model: a Megatron-style model reads
``curriculum_seqlen`` and slices its inputs (and labels) to that many positions. Any other model
can be wrapped in :class:`SeqlenTruncation`, which does it for every tensor argument.

Example:
    >>> import torch
    >>> x = torch.arange(12).view(2, 6)
    >>> truncate_to_seqlen((x, x + 1), 4)[0].shape
    torch.Size([2, 4])
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

__all__ = ["SeqlenTruncation", "truncate_to_seqlen"]


def truncate_to_seqlen(value: object, seqlen: int | None, dim: int = 1) -> Any:
    """Slice every tensor in ``value`` (nested tuples, lists and dicts too) whose dimension
    ``dim`` is longer than ``seqlen`` to its first ``seqlen`` positions; other values pass.
    ``seqlen=None`` returns ``value`` unchanged."""
    if seqlen is None:
        return value
    if isinstance(value, torch.Tensor):
        if value.dim() > dim and value.shape[dim] > seqlen:
            return value.narrow(dim, 0, int(seqlen))
        return value
    if isinstance(value, tuple):
        return tuple(truncate_to_seqlen(v, seqlen, dim) for v in value)
    if isinstance(value, list):
        return [truncate_to_seqlen(v, seqlen, dim) for v in value]
    if isinstance(value, dict):
        return {k: truncate_to_seqlen(v, seqlen, dim) for k, v in value.items()}
    return value


class SeqlenTruncation(nn.Module):
    """Wraps a model: takes ``curriculum_seqlen=``, truncates the tensor arguments along
    ``seq_dim`` and calls the model without it.

    Args:
        module: the model (registered as ``module``: its state dict keys gain a ``module.`` prefix).
        seq_dim: the sequence dimension of the inputs (1 for ``[batch, seq]``).
    """

    def __init__(self, module: nn.Module, seq_dim: int = 1) -> None:
        super().__init__()
        self.module = module
        self.seq_dim = seq_dim

    def forward(self, *args: object, curriculum_seqlen: int | None = None, **kwargs: object) -> Any:
        """Call the model on the inputs cut to ``curriculum_seqlen`` positions."""
        args = truncate_to_seqlen(args, curriculum_seqlen, self.seq_dim)
        kwargs = truncate_to_seqlen(kwargs, curriculum_seqlen, self.seq_dim)
        return self.module(*args, **kwargs)
