"""Sequence-sharded batches: ``deepspeed.runtime.sequence_parallel.ulysses_sp.UlyssesSPDataLoaderAdapter``.

All ranks of a sequence-parallel group work on one sample at a time. Each call to the wrapped loader
gives every rank its own batch; the adapter gathers the group's batches and then yields them one
after another, every rank receiving its contiguous slice of the same batch: step 1 is rank 0's
batch cut ``sp`` ways, step 2 rank 1's, and so on (``len`` is ``sp`` times the wrapped loader's).
``labels`` become ``shift_labels`` (the next token, ``-100`` after the last position) *before*
slicing, so no rank needs its neighbour's tokens for the loss; reduce it with
:func:`shardwise.sequence.loss.sequence_parallel_cross_entropy` (token-weighted over the group).

A length that is not a multiple of the SP size is refused, as DeepSpeed does; :func:`pad_to_multiple`
pads a batch (``-100`` labels, continuing positions) so that it is, and the padding counts for nothing
in the token-weighted loss.

Example:
    >>> import torch
    >>> batch = {"input_ids": torch.tensor([[5, 6, 7]]), "position_ids": torch.arange(3)[None],
    ...          "labels": torch.tensor([[5, 6, 7]])}
    >>> padded = pad_to_multiple(batch, 2, pad_token_id=0)
    >>> padded["input_ids"].tolist(), padded["labels"].tolist(), padded["position_ids"].tolist()
    ([[5, 6, 7, 0]], [[5, 6, 7, -100]], [[0, 1, 2, 3]])
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable, Iterator, Sequence
from typing import Any

import torch
from torch import Tensor

from shardwise.comm.group_type import Group
from shardwise.comm.sequence_exchange import all_gather_cat, all_gather_objects, all_gather_sizes
from shardwise.sequence.layout import padded_length, shard_bounds
from shardwise.sequence.loss import IGNORE_INDEX

__all__ = ["UlyssesSPDataLoaderAdapter", "pad_to_multiple", "shift_labels"]


def shift_labels(labels: Tensor, ignore_index: int = IGNORE_INDEX) -> Tensor:
    """The next token of each position; ``ignore_index`` after the last one."""
    return torch.nn.functional.pad(labels, (0, 1), value=ignore_index)[..., 1:].contiguous()


def pad_to_multiple(batch: dict[str, Any], multiple: int, pad_token_id: int) -> dict[str, Any]:
    """``batch`` with its ``[b, s]`` tensors padded on the right to a multiple of ``multiple``.

    ``input_ids`` get ``pad_token_id``, ``labels`` and ``shift_labels`` get ``-100`` (not counted),
    ``position_ids`` continue counting, ``attention_mask`` gets 0, any other tensor 0.
    """
    length = batch["input_ids"].shape[1]
    extra = padded_length(length, multiple) - length
    if extra == 0:
        return dict(batch)
    out = {}
    for key, value in batch.items():
        if not torch.is_tensor(value):
            out[key] = value
        elif key == "position_ids":
            tail = value[:, -1:] + torch.arange(1, extra + 1, dtype=value.dtype, device=value.device)
            out[key] = torch.cat([value, tail], dim=1)
        else:
            fill = {"input_ids": pad_token_id, "labels": IGNORE_INDEX, "shift_labels": IGNORE_INDEX}.get(
                key, 0
            )
            out[key] = torch.nn.functional.pad(value, (0, extra), value=fill)
    return out


class UlyssesSPDataLoaderAdapter:
    """Wrap ``dl`` so each rank of the SP group gets its sequence slice of the group's batches.

    Args:
        dl: any iterable of dict batches with ``input_ids``, ``position_ids`` and ``labels`` of
            shape ``[b, s, ...]``; other tensors are sliced too, non-tensors copied.
        sp_rank: this rank's place in the SP group.
        sp_group: the SP group.
        sp_world_size: the SP degree.
        device: where the gathered batches are staged (the slices are returned on the CPU, as
            DeepSpeed returns them).
    """

    def __init__(self, dl: Iterable, sp_rank: int, sp_group: Group, sp_world_size: int, device: Any) -> None:
        self.dl = dl
        self.sp_rank, self.sp_group, self.sp_world_size = sp_rank, sp_group, sp_world_size
        self.device = device
        self.iter = iter(dl)
        self.micro_batches: deque[dict[str, Any]] = deque()

    def __len__(self) -> int:
        """``sp_world_size`` times the wrapped loader's length."""
        return len(self.dl) * self.sp_world_size  # type: ignore[arg-type]

    def __iter__(self) -> Iterator[dict[str, Any]]:
        """The adapter is its own iterator (as DeepSpeed's)."""
        return self

    def __next__(self) -> dict[str, Any]:
        """This rank's slice of the next batch of the group."""
        if not self.micro_batches:
            self.refill()
        return self.micro_batches.popleft()

    def refill(self) -> None:
        """Gather one batch from every rank of the group and queue this rank's slice of each."""
        try:
            batch = next(self.iter)
        except StopIteration:
            self.iter = iter(self.dl)  # the next epoch starts afresh
            raise
        if "position_ids" not in batch:
            raise ValueError(
                "Ulysses SP needs position_ids in every batch so each token keeps its global position after "
                "the sequence is sliced: add position_ids = torch.arange(seq_len) per sample to the collator "
                "(reset at document boundaries for packed sequences)"
            )
        length = batch["input_ids"].shape[1]
        lengths = all_gather_sizes(length, self.sp_group, self.device)
        per_rank: list[dict[str, Any]] = [{} for _ in range(self.sp_world_size)]
        for key, value in batch.items():
            pieces: Sequence[Any]
            if torch.is_tensor(value):
                if value.shape[1] != length:
                    raise ValueError(
                        f"{key}'s shape {tuple(value.shape)} must match input_ids's shape "
                        f"{tuple(batch['input_ids'].shape)} in its first two dimensions"
                    )
                with torch.no_grad():
                    gathered = all_gather_cat(value.to(self.device), 1, self.sp_group, sizes=lengths)
                pieces = torch.split(gathered, lengths, dim=1)
            else:
                pieces = all_gather_objects(value, self.sp_group)
            for rank, piece in enumerate(pieces):
                per_rank[rank][key] = piece
        for whole in per_rank:
            self.micro_batches.append(self._slice(whole))

    def _slice(self, whole: dict[str, Any]) -> dict[str, Any]:
        length = whole["input_ids"].shape[1]
        if length % self.sp_world_size:
            raise ValueError(
                f"batch's seqlen={length} isn't divisible by sp-size={self.sp_world_size}: pad it in the collator "
                "(shardwise.sequence.data.pad_to_multiple; the padding's -100 labels are not counted)"
            )
        start, stop = shard_bounds(length, self.sp_world_size, self.sp_rank)
        labels = whole.pop("labels")
        whole["shift_labels"] = shift_labels(labels)
        return {k: v[:, start:stop].cpu() if torch.is_tensor(v) else v for k, v in whole.items()}
