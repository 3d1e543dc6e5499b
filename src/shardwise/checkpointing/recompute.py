"""``checkpoint`` (reentrant) and ``non_reentrant_checkpoint``: run a block without keeping its
activations, recompute it in backward (spec 6.6).

Both are ``torch.utils.checkpoint`` (``use_reentrant`` True or False), extended in three places:

1. **RNG tracker.** torch restores the CPU and CUDA generators for the recompute; the block
   runs inside :class:`~shardwise.checkpointing.profile.Boundaries`, which also restores the
   Megatron-style tracker's streams (dropout in tensor-parallel regions draws from them), and
   adds the boundary syncs and timing of ``synchronize_checkpoint_boundary`` / ``profile``.
2. **Stored inputs.** Both of torch's variants keep the block's inputs with a
   ``ctx.save_for_backward`` made *outside* their own hooks (reentrant: ``CheckpointFunction``;
   non-reentrant: ``_NoopSaveInputs``, whose saved tensors feed the recompute), while the
   block's own saves happen inside (reentrant: not at all, under no_grad; non-reentrant:
   under torch's inner hooks, which take precedence). Wrapping the call in
   ``saved_tensors_hooks`` with the storage's pack/unpack therefore partitions / offloads /
   buffers exactly the inputs and nothing else.
3. **Frozen inputs.** Reentrant checkpoints of blocks none of whose inputs require grad
   (frozen embeddings under LoRA) would give the block's parameters no gradient in torch; a
   dummy input that requires grad is added so they get one, as DeepSpeed's users expect (the non-reentrant variant
   needs none).

Example:
    >>> import torch
    >>> layer = torch.nn.Linear(4, 4)
    >>> x = torch.randn(2, 4, requires_grad=True)
    >>> checkpoint(layer, x).sum().backward()
    >>> layer.weight.grad is not None and x.grad is not None
    True
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any

import torch
import torch.utils.checkpoint as torch_checkpoint

from shardwise.checkpointing.profile import Boundaries
from shardwise.checkpointing.rng import get_cuda_rng_tracker
from shardwise.checkpointing.settings import current_settings
from shardwise.checkpointing.storage import active_storage

__all__ = ["checkpoint", "non_reentrant_checkpoint"]


def checkpoint(function: Callable[..., object], *args: object) -> Any:
    """DeepSpeed's ``deepspeed.checkpointing.checkpoint``: reentrant recompute in backward.

    Args:
        function: the block (a module or any callable).
        *args: its positional inputs.

    Returns:
        What ``function(*args)`` returns.
    """
    return _checkpoint(function, args, reentrant=True)


def non_reentrant_checkpoint(function: Callable[..., object], *args: object) -> Any:
    """DeepSpeed's ``non_reentrant_checkpoint``: the recompute runs from the saved-tensor hooks,
    so nested checkpoints, ``torch.autograd.grad`` and frozen inputs work."""
    return _checkpoint(function, args, reentrant=False)


def _checkpoint(function: Callable[..., object], args: tuple[object, ...], reentrant: bool) -> object:
    if not torch.is_grad_enabled():
        return function(*args)  # no graph: nothing is saved, nothing to recompute
    settings = current_settings()
    storage = active_storage()
    needs_dummy = reentrant and not any(isinstance(a, torch.Tensor) and a.requires_grad for a in args)
    run = Boundaries(
        function,
        profile=settings.profile,
        synchronize=settings.synchronize_checkpoint_boundary,
        tracked=get_cuda_rng_tracker().get_states(),
        drop_last=needs_dummy,
    )
    extra = (torch.empty(0, requires_grad=True),) if needs_dummy else ()
    hooks = (
        torch.autograd.graph.saved_tensors_hooks(storage.pack, storage.unpack)
        if storage is not None
        else contextlib.nullcontext()
    )
    with hooks:
        return torch_checkpoint.checkpoint(run, *args, *extra, use_reentrant=reentrant)
