"""What :class:`~shardwise.zero.init_context.Init`'s placeholders carry beside their full shape.

- their :class:`Stash`: this rank's dim-0 chunk of the initial value (FSDP2's chunking), kept on
  the placeholder (:func:`stash_of`) until ``initialize`` copies it into the shard, and gathered
  whole again by :func:`gather_stash` (``GatheredParameters``);
- their owners: the modules (and attribute names) that register a placeholder or a stage-3
  parameter (:func:`owners_of`), kept up to date by a global parameter-registration hook, so a
  gathered copy can be swapped in and out of every module that holds it.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.nn.modules.module import register_module_parameter_registration_hook

from shardwise.comm import collectives
from shardwise.comm.group_type import Group
from shardwise.zero.sharded_model import record_of

__all__ = ["Stash", "gather_stash", "owners_of", "stash_of"]


@dataclass
class Stash:
    """The rank's chunk of a parameter built under :class:`~shardwise.zero.init_context.Init`."""

    shard: torch.Tensor  # this rank's dim-0 chunk (may be empty), stash dtype
    shape: torch.Size
    dtype: torch.dtype
    group: Group
    world: int
    rank: int
    mapping: Any = None  # remote_device="nvme": the file map the chunk lives in
    placeholder: Any = None  # weak reference to the placeholder (its ds_tensor is the chunk)

    def release(self) -> None:
        """Drop a chunk kept in a file (``remote_device="nvme"``) once ``initialize`` copied it
        into its shard, so its pages and disk space go now rather than with the placeholder."""
        if self.mapping is None:
            return
        empty = self.shard.new_empty((0, *self.shard.shape[1:]))
        holder = self.placeholder() if self.placeholder is not None else None
        if holder is not None and getattr(holder, "ds_tensor", None) is self.shard:
            holder.ds_tensor = empty
        self.shard, self.mapping = empty, None


def stash_of(param: torch.Tensor) -> Stash | None:
    """The stash of a placeholder parameter built under ``Init``, else None."""
    return getattr(param, "_shardwise_stash", None)


def _chunk(full: torch.Tensor, world: int, rank: int) -> torch.Tensor:
    """FSDP2's dim-0 chunk of ``full`` for ``rank`` (``torch.chunk``, empty past the end)."""
    chunks = torch.chunk(full, world, dim=0)
    if rank < len(chunks):
        return chunks[rank]
    return full.new_empty((0, *full.shape[1:]))


def _padded_rows(shape: torch.Size, world: int) -> int:
    return -(-shape[0] // world) if shape[0] else 0


def gather_stash(stash: Stash) -> torch.Tensor:
    """All-gather a stash into the full tensor (collective over the stash's group)."""
    if stash.world == 1:
        return stash.shard.clone().reshape(stash.shape)
    rows = _padded_rows(stash.shape, stash.world)
    tail = tuple(stash.shape[1:])
    padded = stash.shard.new_zeros((rows, *tail))
    padded[: stash.shard.shape[0]].copy_(stash.shard)
    out = stash.shard.new_empty((rows * stash.world, *tail))
    collectives.all_gather_flat(out, padded.contiguous(), group=stash.group)
    return out[: stash.shape[0]].contiguous()


# --------------------------------------------------------------------------- owners
# Which modules register a placeholder: kept on the parameter itself (weak references to
# the modules); for a stage-3 parameter, in its ShardedModel record. Up to date through a
# global hook installed with the first Init, so ties made after construction
# (``tie_weights()``) are seen too.
_owner_hook: Any = None


def _record_owner(module: nn.Module, name: str, param: nn.Parameter | None) -> None:
    if param is None:
        return
    if stash_of(param) is None:
        record = record_of(param)
        if record is not None and record.resolve(param) is param:  # a current stage-3 parameter
            record.add_owner(param, module, name)
        return
    owners = param.__dict__.setdefault("_shardwise_owner_refs", [])
    if not any(ref() is module and n == name for ref, n in owners):
        owners.append((weakref.ref(module), name))


def _ensure_owner_hook() -> None:
    global _owner_hook
    if _owner_hook is None:

        def hook(module: nn.Module, name: str, param: nn.Parameter | None) -> None:
            _record_owner(module, name, param)

        _owner_hook = register_module_parameter_registration_hook(hook)


def owners_of(param: nn.Parameter) -> list[tuple[nn.Module, str]]:
    """Modules (and attribute names) that currently register ``param``."""
    out = []
    recorded = list(getattr(param, "_shardwise_owner_refs", []))
    record = record_of(param)
    if record is not None:
        recorded += record.owner_refs(param)
    seen = set()
    for ref, name in recorded:
        module = ref()
        if module is None or (id(module), name) in seen:
            continue
        if module._parameters.get(name) is param:
            seen.add((id(module), name))
            out.append((module, name))
    return out


def _set_on_owners(owners: list[tuple[nn.Module, str]], value: nn.Parameter) -> None:
    for module, name in owners:
        module._parameters[name] = value
