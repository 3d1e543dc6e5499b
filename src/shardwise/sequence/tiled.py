"""ALST's tiled compute: run a sequence-wise function a tile at a time, recomputing in backward.

At long sequence lengths an MLP's intermediate activations (``[b, s, 4h]`` and more) and the
logits (``[b, s, vocab]``) dwarf everything else. Because these functions act on each position
independently, they can be computed tile by tile along the sequence: forward keeps only the
input and the output (no autograd graph), backward recomputes one tile at a time with autograd
and accumulates the parameter gradients, so at most one tile's intermediates exist at once.

DeepSpeed's names and signatures (``deepspeed.runtime.sequence_parallel.ulysses_sp``):

* :class:`TiledMLP` ``.apply(fn, self, x, shards, compute_params)``;
* :func:`sequence_tiled_compute` / :class:`SequenceTiledCompute` (any function of keyword
  arguments, tiled on dimension 1);
* :class:`TiledFusedLogitsLoss` ``.apply(fn, self, x, y, mask, shards, compute_params,
  output_reduction)``: the loss without ever holding the whole logits tensor;
* :class:`AutogradComputeMLP`: the untiled recompute, for comparison.

``compute_params`` are marked ``ds_grad_is_ready = False`` until the last tile, as DeepSpeed does,
so ZeRO's gradient hooks (:mod:`shardwise.zero.reducer`) reduce each parameter once, after its
gradient holds every tile's sum. Unlike DeepSpeed's ``TiledFusedLogitsLoss``, which runs its
backward inside forward and only rescales the input's gradient by the incoming gradient, the
backward here recomputes each tile and scales every gradient (parameters too), so loss scaling
and gradient-accumulation division reach ``lm_head`` as well.

Example:
    >>> import torch
    >>> mlp = torch.nn.Linear(4, 4)
    >>> x = torch.randn(2, 6, 4, requires_grad=True)
    >>> y = TiledMLP.apply(lambda self, t: self(t), mlp, x, 3, [mlp.weight])
    >>> torch.allclose(y, mlp(x))
    True
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import Tensor

__all__ = [
    "AutogradComputeMLP",
    "SequenceTiledCompute",
    "TiledFusedLogitsLoss",
    "TiledMLP",
    "sequence_tiled_compute",
]


def _mark_ready(params: Sequence[Tensor] | None, ready: bool) -> None:
    for param in params or ():
        param.ds_grad_is_ready = ready  # type: ignore[attr-defined]


def _trainable(params: Sequence[Tensor] | None) -> list[Tensor]:
    return [p for p in (params or ()) if p.requires_grad]


def _leaf(t: Tensor, requires_grad: bool) -> Tensor:
    return t.detach().requires_grad_(requires_grad)


def _backward_tile(output: Tensor, grad: Tensor, tile_input: Tensor) -> None:
    """Backward of one recomputed tile (skipped when nothing upstream needs a gradient)."""
    if output.requires_grad:
        torch.autograd.backward(output, grad)
    elif tile_input.requires_grad:
        raise RuntimeError("tiled compute: the recomputed tile does not depend on its input; check fn")


class TiledMLP(torch.autograd.Function):
    """``fn(self, x)`` computed in ``shards`` tiles along dimension -2 (the sequence)."""

    @staticmethod
    def forward(
        ctx: Any, fn: Callable, self: Any, x: Tensor, shards: int, compute_params: Sequence[Tensor] | None
    ) -> Tensor:
        """Output of every tile, concatenated; no graph is kept."""
        ctx.fn, ctx.module, ctx.shards = fn, self, shards
        ctx.compute_params = _trainable(compute_params)
        ctx.save_for_backward(x)
        with torch.no_grad():
            return torch.cat([fn(self, tile) for tile in torch.chunk(x, shards, dim=-2)], dim=-2)

    @staticmethod
    def backward(ctx: Any, *grads: Tensor) -> tuple[Tensor | None, ...]:
        """Recompute tile by tile; parameter gradients accumulate, the input's is concatenated."""
        (x,) = ctx.saved_tensors
        tiles = torch.chunk(x, ctx.shards, dim=-2)
        grad_tiles = torch.chunk(grads[0], ctx.shards, dim=-2)
        x_grads = []
        for i, (tile, grad) in enumerate(zip(tiles, grad_tiles, strict=True)):
            _mark_ready(ctx.compute_params, i == len(tiles) - 1)
            leaf = _leaf(tile, x.requires_grad)
            with torch.enable_grad():
                output = ctx.fn(ctx.module, leaf)
            _backward_tile(output, grad, leaf)
            x_grads.append(leaf.grad if leaf.grad is not None else torch.zeros_like(tile))
        x_grad = torch.cat(x_grads, dim=-2) if x.requires_grad else None
        return None, None, x_grad, None, None


class AutogradComputeMLP(torch.autograd.Function):
    """``fn(self, x)`` with no saved graph: recomputed whole in backward (one tile of :class:`TiledMLP`)."""

    @staticmethod
    def forward(ctx: Any, fn: Callable, self: Any, x: Tensor) -> Tensor:
        """The output; only ``x`` is saved."""
        ctx.fn, ctx.module = fn, self
        ctx.save_for_backward(x)
        with torch.no_grad():
            return fn(self, x)

    @staticmethod
    def backward(ctx: Any, *grads: Tensor) -> tuple[Tensor | None, ...]:
        """Recompute and backpropagate."""
        (x,) = ctx.saved_tensors
        leaf = _leaf(x, x.requires_grad)
        with torch.enable_grad():
            output = ctx.fn(ctx.module, leaf)
        _backward_tile(output, grads[0], leaf)
        return None, None, leaf.grad


def _reduce(outputs: Tensor, reduction: str | None) -> Tensor:
    if reduction is None:
        return outputs
    if reduction == "mean":
        return outputs.mean()
    if reduction == "sum":
        return outputs.sum()
    raise ValueError(f"output_reduction={reduction!r}: valid values are None, 'mean' and 'sum'")


class SequenceTiledCompute(torch.autograd.Function):
    """Generic tiled compute; call it through :func:`sequence_tiled_compute` (DeepSpeed's argument order)."""

    @staticmethod
    def forward(
        ctx: Any,
        fn: Callable,
        seqlen: int,
        shards: int,
        keys_to_shard: list[str],
        keys_to_pass: list[str],
        grad_requiring_tensor_key: str,
        compute_params: Sequence[Tensor] | None,
        output_unshard_dimension: int,
        output_reduction: str | None,
        *args: Any,
    ) -> Tensor:
        """Every tile's ``fn`` output concatenated on ``output_unshard_dimension``, then reduced."""
        if grad_requiring_tensor_key not in keys_to_shard:
            raise ValueError(
                f"grad_requiring_tensor_key={grad_requiring_tensor_key!r} must be one of kwargs_to_shard's keys {keys_to_shard}"
            )
        sharded = dict(zip(keys_to_shard, args[: len(keys_to_shard)], strict=True))
        passed = dict(zip(keys_to_pass, args[len(keys_to_shard) :], strict=True))
        step = math.ceil(seqlen / shards)
        ctx.saved = (
            fn,
            seqlen,
            step,
            sharded,
            passed,
            grad_requiring_tensor_key,
            output_unshard_dimension,
            output_reduction,
        )
        ctx.compute_params = _trainable(compute_params)
        ctx.n_args, ctx.grad_index = len(args), keys_to_shard.index(grad_requiring_tensor_key)
        with torch.no_grad():
            outputs = [fn(**_tile(sharded, i, step), **passed) for i in range(math.ceil(seqlen / step))]
        ctx.tile_sizes = [
            1 if output_unshard_dimension == 0 else o.shape[output_unshard_dimension] for o in outputs
        ]
        if output_unshard_dimension == 0:  # one scalar per tile (a loss)
            outputs = [o.unsqueeze(0) for o in outputs]
        joined = torch.cat(outputs, dim=output_unshard_dimension)
        ctx.numel = joined.numel()
        return _reduce(joined, output_reduction)

    @staticmethod
    def backward(ctx: Any, *grads: Tensor) -> tuple[Tensor | None, ...]:
        """Recompute tile by tile with autograd; return the gradient of the grad-requiring input."""
        fn, _, step, sharded, passed, key, out_dim, reduction = ctx.saved
        incoming = grads[0]
        target = sharded[key]
        input_grads = []
        offset = 0
        for i, size in enumerate(ctx.tile_sizes):
            _mark_ready(ctx.compute_params, i == len(ctx.tile_sizes) - 1)
            tile = _tile(sharded, i, step)
            leaf = _leaf(tile[key], target.requires_grad)
            tile[key] = leaf
            with torch.enable_grad():
                output = fn(**tile, **passed)
            if reduction is not None:
                scale = incoming / ctx.numel if reduction == "mean" else incoming
                grad = scale.expand_as(output)
            elif out_dim == 0:
                grad = incoming[i]
            else:
                grad = incoming.narrow(out_dim, offset, size)
            offset += size
            _backward_tile(output, grad, leaf)
            input_grads.append(leaf.grad if leaf.grad is not None else torch.zeros_like(leaf))
        arg_grads: list[Tensor | None] = [None] * ctx.n_args
        if target.requires_grad:
            arg_grads[ctx.grad_index] = torch.cat(input_grads, dim=1)
        return (None,) * 9 + tuple(arg_grads)


def _tile(sharded: dict[str, Tensor], i: int, step: int) -> dict[str, Tensor]:
    return {k: v[:, i * step : (i + 1) * step] for k, v in sharded.items()}


def sequence_tiled_compute(
    fn: Callable,
    seqlen: int,
    shards: int,
    kwargs_to_shard: dict[str, Tensor],
    kwargs_to_pass: dict[str, Any],
    grad_requiring_tensor_key: str,
    compute_params: Sequence[Tensor] | None = None,
    output_unshard_dimension: int = 1,
    output_reduction: str | None = "mean",
) -> Tensor:
    """Tiled ``fn(**kwargs_to_shard, **kwargs_to_pass)``: the tensors of ``kwargs_to_shard``
    (``[b, seqlen, ...]``) cut into ``shards`` tiles on dimension 1.

    Args:
        fn: the function of one tile.
        seqlen: the length of dimension 1.
        shards: the number of tiles (the last may be shorter).
        kwargs_to_shard: tensors tiled on dimension 1.
        kwargs_to_pass: arguments passed whole to every call.
        grad_requiring_tensor_key: the key of ``kwargs_to_shard`` that receives a gradient.
        compute_params: the weights ``fn`` uses (gradient hooks fire once, after the last tile).
        output_unshard_dimension: where the tiles' outputs are concatenated (0: scalars per tile).
        output_reduction: None, ``"mean"`` or ``"sum"`` of the concatenated output.
    """
    return SequenceTiledCompute.apply(
        fn,
        seqlen,
        shards,
        list(kwargs_to_shard),
        list(kwargs_to_pass),
        grad_requiring_tensor_key,
        compute_params,
        output_unshard_dimension,
        output_reduction,
        *kwargs_to_shard.values(),
        *kwargs_to_pass.values(),
    )


class TiledFusedLogitsLoss(torch.autograd.Function):
    """A loss ``fn(self, x, y[, mask])`` over ``shards`` tiles of the flattened ``[b*s]`` positions;
    the whole logits tensor never exists. ``output_reduction`` combines the tiles' losses
    (``"mean"``: mean of the tile losses, as DeepSpeed; ``"sum"``: their sum)."""

    @staticmethod
    def forward(
        ctx: Any,
        fn: Callable,
        self: Any,
        x: Tensor,
        y: Tensor,
        mask: Tensor | None,
        shards: int,
        compute_params: Sequence[Tensor] | None,
        output_reduction: str,
    ) -> Tensor:
        """The combined loss; only ``x``, ``y`` and ``mask`` are kept."""
        if output_reduction not in ("mean", "sum"):
            raise ValueError(f"output_reduction={output_reduction!r}: valid values are 'mean' and 'sum'")
        if x.dim() < 2 or y.dim() < 2 or x.shape[:2] != y.shape[:2]:
            raise ValueError(
                f"x {tuple(x.shape)} and y {tuple(y.shape)} must both be [batch, seq, ...] with the same batch and seq"
            )
        if mask is not None and mask.shape != x.shape[:2]:
            raise ValueError(f"mask {tuple(mask.shape)} must be [batch, seq] = {tuple(x.shape[:2])}")
        ctx.fn, ctx.module, ctx.shards, ctx.reduction = fn, self, shards, output_reduction
        ctx.compute_params = _trainable(compute_params)
        ctx.has_mask = mask is not None
        ctx.save_for_backward(x, y, *(() if mask is None else (mask,)))
        with torch.no_grad():
            losses = torch.stack([fn(self, *tile) for tile in _loss_tiles(x, y, mask, shards)])
        ctx.count = losses.numel()
        return losses.mean() if output_reduction == "mean" else losses.sum()

    @staticmethod
    def backward(ctx: Any, *grads: Tensor) -> tuple[Tensor | None, ...]:
        """Recompute each tile's loss with autograd, scaled by the incoming gradient."""
        x, y, *rest = ctx.saved_tensors
        mask = rest[0] if ctx.has_mask else None
        scale = grads[0] / ctx.count if ctx.reduction == "mean" else grads[0]
        tiles = _loss_tiles(x, y, mask, ctx.shards)
        x_grads = []
        for i, (x_tile, *others) in enumerate(tiles):
            _mark_ready(ctx.compute_params, i == len(tiles) - 1)
            leaf = _leaf(x_tile, x.requires_grad)
            with torch.enable_grad():
                loss = ctx.fn(ctx.module, leaf, *others)
            _backward_tile(loss, scale, leaf)
            x_grads.append(leaf.grad if leaf.grad is not None else torch.zeros_like(x_tile))
        x_grad = torch.cat(x_grads).view(x.shape) if x.requires_grad else None
        return None, None, x_grad, None, None, None, None, None


def _loss_tiles(x: Tensor, y: Tensor, mask: Tensor | None, shards: int) -> list[tuple[Tensor, ...]]:
    flat_x = x.reshape(-1, *x.shape[2:])
    flat_y = y.reshape(-1, *y.shape[2:])
    parts = [torch.chunk(flat_x, shards), torch.chunk(flat_y, shards)]
    if mask is not None:
        parts.append(torch.chunk(mask.reshape(-1), shards))
    return list(zip(*parts, strict=True))
