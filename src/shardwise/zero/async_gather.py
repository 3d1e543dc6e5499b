"""Stages 1-2 with ``overlap_comm``: the post-step all-gather overlaps the next forward.

Without overlap the step ends by all-gathering every bucket's updated shards and waiting.
With ``zero_optimization.overlap_comm: true`` (stages 1-2, more than one rank) the step
updates the local shard bucket by bucket, starts each bucket's all-gather as soon as the
bucket is updated, and returns; :class:`PendingGathers` holds the gathers in flight and
waits for them where parameters are read:

- each module's forward pre-hook waits for the bucket(s) holding that module's own
  parameters (so the first forward waits for the first bucket it uses, and the rest of the
  gather runs behind the forward's compute);
- the root module's forward pre-hook waits for every bucket on the first forward it sees
  (that forward is the *learning* one: it records the order in which buckets are used,
  which becomes the order buckets are updated and gathered in, and which modules never ran
  a pre-hook; buckets of parameters owned by such modules, read by another module directly,
  are waited for at the root from then on); the root's forward hook (called even when the
  forward raises) waits for the rest;
- ``state_dict`` / ``load_state_dict`` of any hooked module (pre-hooks), the strategy's
  step, backward, checkpoint layouts (so checkpoints, ``safe_get_full_*`` and the other
  parameter accessors), ``GatheredParameters`` and ``close`` wait for everything first.

The one read that cannot be guarded: a raw parameter tensor read directly by user code
between ``step()`` and the next forward (``model.fc.weight.sum()``, ``p.data.clone()``,
``model.parameters()`` iteration) sees the bucket as the gather left it so far (the local
shard updated, the other ranks' parts possibly old). Call :meth:`PendingGathers.wait_all`
(``engine.optimizer.wait_for_parameters()``) first, or use a forward / ``state_dict``.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from typing import Any

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle

from shardwise.zero.flat_group import FlatGroup

__all__ = ["BucketKey", "Launched", "PendingGathers"]

BucketKey = tuple[int, int]  # (flat group index, bucket index)
Launched = list[tuple[Any, Callable[[], None]]]  # (work or None, then) pairs of one bucket


class PendingGathers:
    """Bucket-keyed all-gathers in flight, and the module hooks that wait for them.

    Args:
        groups: the strategy's flat groups (a parameter's bucket is found from its slot).

    Example:
        >>> pending = PendingGathers([])
        >>> pending.launch((0, 0), [(None, lambda: None)])
        >>> pending.busy
        True
        >>> pending.wait_all()
        >>> pending.busy
        False
    """

    def __init__(self, groups: Sequence[FlatGroup]) -> None:
        self._pending: dict[BucketKey, Launched] = {}
        self._bucket_of: dict[int, BucketKey] = {}
        self._all_keys: list[BucketKey] = []
        for gi, flat in enumerate(groups):
            self._all_keys.extend((gi, b) for b in range(len(flat.layout.buckets)))
            for param, slot in zip(flat.params, flat.layout.slots):
                self._bucket_of[id(param)] = (gi, slot.bucket)
        self._handles: list[RemovableHandle] = []
        self._module_keys: dict[int, tuple[BucketKey, ...]] = {}  # id(module) -> its own params' buckets
        self.learned = False  # a whole forward has been recorded
        self._recording = False
        self._seen_order: list[BucketKey] = []
        self._fired: set[int] = set()
        self._order: list[BucketKey] = list(self._all_keys)
        self._root_keys: tuple[BucketKey, ...] = ()

    # ------------------------------------------------------------------ queries
    @property
    def busy(self) -> bool:
        """Whether any gather is still in flight (not waited for)."""
        return bool(self._pending)

    def step_order(self) -> list[BucketKey]:
        """The buckets in the order to update and gather them: the order the learned forward used
        them in, then the ones it did not use; before learning, group by group, bucket by bucket."""
        return list(self._order)

    def keys_of(self, params: Iterable[torch.Tensor]) -> tuple[BucketKey, ...]:
        """The distinct buckets holding ``params`` (parameters of other owners are ignored), in order."""
        keys: list[BucketKey] = []
        for param in params:
            key = self._bucket_of.get(id(param))
            if key is not None and key not in keys:
                keys.append(key)
        return tuple(keys)

    # ------------------------------------------------------------------ launching and waiting
    def launch(self, key: BucketKey, launched: Launched) -> None:
        """Record the gathers just started for bucket ``key`` (waited for before it is read)."""
        if launched:
            self._pending.setdefault(key, []).extend(launched)

    def wait_for(self, keys: Iterable[BucketKey]) -> None:
        """Complete the gathers of the buckets ``keys`` (no-op for those not in flight)."""
        if not self._pending:
            return
        for key in keys:
            launched = self._pending.pop(key, None)
            if launched:
                _complete(launched)

    def wait_all(self) -> None:
        """Complete every gather in flight, in launch order."""
        while self._pending:
            key = next(iter(self._pending))
            _complete(self._pending.pop(key))

    # ------------------------------------------------------------------ hooks
    def attach(self, root: nn.Module) -> None:
        """Install the waits on ``root`` and its submodules (see the module docstring)."""
        self.detach()
        wait_everything = self._wait_everything_hook
        for module in root.modules():
            keys = self.keys_of(module.parameters(recurse=False))
            if not keys:
                continue
            self._module_keys[id(module)] = keys
            self._handles.append(module.register_forward_pre_hook(self._module_hook(id(module), keys)))
            self._handles.append(module.register_state_dict_pre_hook(wait_everything))
            self._handles.append(module.register_load_state_dict_pre_hook(wait_everything))
        self._handles.append(root.register_forward_pre_hook(self._root_pre_hook, prepend=True))
        # always_call: a forward that raises still ends the recording and waits for the rest
        self._handles.append(root.register_forward_hook(self._root_post_hook, always_call=True))
        if id(root) not in self._module_keys:
            self._handles.append(root.register_state_dict_pre_hook(wait_everything))
            self._handles.append(root.register_load_state_dict_pre_hook(wait_everything))

    def detach(self) -> None:
        """Remove every hook :meth:`attach` installed."""
        for handle in self._handles:
            handle.remove()
        self._handles = []
        self._module_keys = {}

    def _wait_everything_hook(self, *args: object, **kwargs: object) -> None:
        self.wait_all()

    def _module_hook(self, module_id: int, keys: tuple[BucketKey, ...]) -> Callable[..., None]:
        def hook(module: nn.Module, args: object) -> None:
            if self._recording:
                self._fired.add(module_id)
                self._seen_order.extend(k for k in keys if k not in self._seen_order)
            self.wait_for(keys)

        return hook

    def _root_pre_hook(self, module: nn.Module, args: object) -> None:
        if self._recording:
            return  # a nested call of the root inside the forward being recorded
        if self.learned:
            self.wait_for(self._root_keys)
            return
        self.wait_all()
        self._recording = True
        self._seen_order = []
        self._fired = set()

    def _root_post_hook(self, module: nn.Module, args: object, output: object) -> None:
        if self._recording:
            self._recording = False
            self.learned = True
            never_fired = [keys for mid, keys in self._module_keys.items() if mid not in self._fired]
            self._root_keys = tuple(dict.fromkeys(k for keys in never_fired for k in keys))
            # the root waits for its keys first, then modules use buckets in the recorded order
            self._order = list(dict.fromkeys([*self._root_keys, *self._seen_order, *self._all_keys]))
        self.wait_all()


def _complete(launched: Launched) -> None:
    for work, then in launched:
        if work is not None:
            work.wait()
        then()
