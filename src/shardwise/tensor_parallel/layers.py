"""Tensor-parallel layers: each holds only this rank's slice of its weight, as a plain parameter.

Why plain local slices (DeepSpeed AutoTP's layout) rather than DTensor ``parallelize_module``:
ZeRO stages 0-2 keep parameters in flat buffers of plain tensors and reduce gradients over the
data-parallel group only, so a layer whose parameters *are* the local slices trains at stages 0-2
with no change to them; at stage 3 FSDP2 shards those slices over the data dimension, which is a
true 2-D (dp_shard x tp) layout, again with no DTensor on the TP dimension to reconcile with
FSDP2's own. The two collectives of a layer are explicit autograd functions
(:mod:`shardwise.tensor_parallel.functions`), so what is exchanged is visible and exact.

* :class:`ColumnParallelLinear`: the output features are split; input gradients are summed over
  the group; ``gather_output`` concatenates the output slices;
* :class:`RowParallelLinear`: the input features are split; partial outputs are summed over the
  group, then the whole bias is added once (a replicated input is sliced locally first);
* :class:`ParallelEmbedding`: the embedding dimension split (outputs gathered) or the vocabulary
  split (rows outside the slice give zeros, summed over the group).

The constructors also take DeepSpeed's ``(module, mp_group, name=...)`` form (a process group
instead of a :class:`TPGroup`; ``tp_meta``, DeepSpeed's head-count hint, is accepted and unused:
the cut is given by ``unit``), so ``deepspeed.module_inject.layers.LinearLayer`` /
``LinearAllreduce`` are these classes.

Split parameters carry ``tensor_model_parallel = True`` (Megatron's and DeepSpeed's marker;
ZeRO's gradient norm counts them on every rank, replicated ones once). Each layer keeps the
:class:`~shardwise.tensor_parallel.shards.Split` of each split parameter in ``splits``
(checkpoints gather whole tensors with it).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from shardwise.comm import init as comm_init
from shardwise.comm.group_type import Group
from shardwise.tensor_parallel.functions import copy_to_group, gather_from_group, reduce_from_group
from shardwise.tensor_parallel.shards import Split

__all__ = ["ColumnParallelLinear", "ParallelEmbedding", "RowParallelLinear", "TPGroup", "TensorParallelLayer"]


@dataclass(frozen=True)
class TPGroup:
    """The tensor-parallel group a layer communicates over (``group`` None only when ``size`` is 1)."""

    group: Group
    rank: int
    size: int


def as_tp_group(tp: TPGroup | Group) -> TPGroup:
    """``tp`` itself, or the :class:`TPGroup` of a process group (DeepSpeed's layer signature takes the
    group; None is the world)."""
    if isinstance(tp, TPGroup):
        return tp
    return TPGroup(tp, comm_init.get_rank(tp), comm_init.get_world_size(tp))


def _local_parameter(full: torch.Tensor, split: Split, rank: int, requires_grad: bool) -> nn.Parameter:
    param = nn.Parameter(split.local(full.detach(), rank), requires_grad=requires_grad)
    param.tensor_model_parallel = True  # type: ignore[attr-defined]
    param.partition_dim = split.dim  # type: ignore[attr-defined]
    return param


class TensorParallelLayer(nn.Module):
    """Common state: the group, and the :class:`Split` of each split parameter by name."""

    def __init__(self, tp: TPGroup | Group, name: str | None = None) -> None:
        super().__init__()
        self.tp = as_tp_group(tp)
        self.name = name
        self.splits: dict[str, Split] = {}

    def extra_repr(self) -> str:
        cuts = ", ".join(f"{name}: dim {s.dim} {s.total}->{s.local_size(self.tp.rank)}" for name, s in self.splits.items())
        return f"tp={self.tp.size}, rank={self.tp.rank}, {cuts}"


class ColumnParallelLinear(TensorParallelLayer):
    """``nn.Linear`` with its output features split over the group (weight rows, bias)."""

    def __init__(self, linear: nn.Linear, tp: TPGroup | Group = None, name: str | None = None, *,
                 gather_output: bool = False, sub_sizes: tuple[int, ...] = (), unit: int = 1, tp_meta: object = None) -> None:
        super().__init__(tp, name)
        tp = self.tp
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.gather_output = gather_output
        split = Split.plan(dim=0, total=linear.out_features, parts=tp.size, sub_sizes=sub_sizes, unit=unit)
        if gather_output and len(split.rank_sizes[0]) > 1:
            raise ValueError("gather_output with packed sub-parameters (a layer spec 'shape') is not supported: "
                             "the gathered output would interleave the sub-parameters; drop gather_output or shape")
        self.weight = _local_parameter(linear.weight, split, tp.rank, linear.weight.requires_grad)
        self.splits["weight"] = split
        self.bias = None
        if linear.bias is not None:
            bias_split = Split(dim=0, total=split.total, rank_sizes=split.rank_sizes)
            self.bias = _local_parameter(linear.bias, bias_split, tp.rank, linear.bias.requires_grad)
            self.splits["bias"] = bias_split

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """This rank's output features (all of them with ``gather_output``)."""
        out = F.linear(copy_to_group(x, self.tp.group, self.tp.size), self.weight, self.bias)
        if self.gather_output:
            sizes = tuple(self.splits["weight"].local_size(r) for r in range(self.tp.size))
            out = gather_from_group(out, self.tp.group, self.tp.rank, sizes)
        return out


class RowParallelLinear(TensorParallelLayer):
    """``nn.Linear`` with its input features split over the group; outputs summed, bias added once."""

    def __init__(self, linear: nn.Linear, tp: TPGroup | Group = None, name: str | None = None, *,
                 sub_sizes: tuple[int, ...] = (), unit: int = 1, tp_meta: object = None) -> None:
        super().__init__(tp, name)
        tp = self.tp
        self.in_features, self.out_features = linear.in_features, linear.out_features
        split = Split.plan(dim=1, total=linear.in_features, parts=tp.size, sub_sizes=sub_sizes, unit=unit)
        self.weight = _local_parameter(linear.weight, split, tp.rank, linear.weight.requires_grad)
        self.splits["weight"] = split
        self.bias = linear.bias  # replicated: the same gradient on every rank

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """The whole output from this rank's input slice (a whole input is sliced here)."""
        split = self.splits["weight"]
        local = split.local_size(self.tp.rank)
        if self.tp.size > 1 and x.shape[-1] != local:
            if x.shape[-1] != self.in_features:
                raise ValueError(f"{type(self).__name__}: input has {x.shape[-1]} features; expected this rank's "
                                 f"{local} or all {self.in_features}")
            x = Split(dim=x.dim() - 1, total=split.total, rank_sizes=split.rank_sizes).local(
                copy_to_group(x, self.tp.group, self.tp.size), self.tp.rank)
        out = reduce_from_group(F.linear(x, self.weight), self.tp.group, self.tp.size)
        return out if self.bias is None else out + self.bias


class ParallelEmbedding(TensorParallelLayer):
    """``nn.Embedding`` split on the embedding dimension (``dim=1``: outputs gathered) or the
    vocabulary (``dim=0``: each rank looks up its rows, the results summed)."""

    def __init__(self, embedding: nn.Embedding, tp: TPGroup | Group = None, name: str | None = None, *,
                 dim: int = 1) -> None:
        super().__init__(tp, name)
        tp = self.tp
        if dim not in (0, 1):
            raise ValueError(f"tensor_parallel.partition_config.embedding_partition_dim = {dim}: it must be 0 "
                             "(vocabulary) or 1 (embedding dimension)")
        if embedding.max_norm is not None or embedding.sparse:
            raise ValueError("a tensor-parallel embedding cannot use max_norm or sparse gradients; "
                             "leave it whole with a 'skip' layer spec")
        self.num_embeddings, self.embedding_dim = embedding.num_embeddings, embedding.embedding_dim
        self.padding_idx, self.dim = embedding.padding_idx, dim
        split = Split.plan(dim=dim, total=embedding.weight.shape[dim], parts=tp.size)
        self.weight = _local_parameter(embedding.weight, split, tp.rank, embedding.weight.requires_grad)
        self.splits["weight"] = split

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        """The embeddings of ``ids``, whole on every rank."""
        split = self.splits["weight"]
        if self.dim == 1:
            out = F.embedding(ids, self.weight, padding_idx=self.padding_idx)
            sizes = tuple(split.local_size(r) for r in range(self.tp.size))
            return gather_from_group(out, self.tp.group, self.tp.rank, sizes)
        start = sum(split.local_size(r) for r in range(self.tp.rank))
        local_ids = ids - start
        outside = (local_ids < 0) | (local_ids >= split.local_size(self.tp.rank))
        pad = self.padding_idx
        pad = pad - start if pad is not None and 0 <= pad - start < split.local_size(self.tp.rank) else None
        out = F.embedding(local_ids.masked_fill(outside, 0), self.weight, padding_idx=pad)
        out = out.masked_fill(outside.unsqueeze(-1), 0.0)
        return reduce_from_group(out, self.tp.group, self.tp.size)
