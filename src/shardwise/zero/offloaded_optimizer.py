"""The torch optimizer ZeRO calls when ``offload_optimizer`` is on, and its view for checkpoints.

:class:`OffloadedOptimizer` wraps the inner torch optimizer (built over an
:class:`~shardwise.zero.offload.OffloadStore`'s host tensors) so ZeRO calls it as before
(``step``, ``param_groups``, ``state``, ``state_dict``); :func:`checkpoint_view` shows it to
checkpoint code keyed by the device masters.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from shardwise.zero.offload import OffloadStore

__all__ = ["OffloadedOptimizer", "checkpoint_view"]


class OffloadedOptimizer(torch.optim.Optimizer):
    """A torch optimizer whose step runs through an :class:`OffloadStore`.

    ZeRO hands it the device masters' groups; the inner optimizer is built over the
    store's host tensors. ``param_groups`` and ``state`` are the inner optimizer's, so
    schedulers and checkpoints see the real thing.

    Example:
        >>> import torch
        >>> from shardwise.zero.offload import OffloadSpec, OffloadStore
        >>> w = torch.zeros(4); w.grad = torch.ones(4)
        >>> store = OffloadStore([{"params": [w], "lr": 0.5}], OffloadSpec(device="cpu"))
        >>> opt = OffloadedOptimizer(torch.optim.SGD(store.host_groups, lr=0.5), store)
        >>> opt.step(); w.tolist()
        [-0.5, -0.5, -0.5, -0.5]
    """

    def __init__(self, inner: torch.optim.Optimizer, store: OffloadStore) -> None:
        # Deliberately no super().__init__: the inner optimizer owns groups and state.
        self.inner = inner
        self.store = store
        self.defaults = inner.defaults
        self._optimizer_step_pre_hooks: OrderedDict[int, Any] = OrderedDict()
        self._optimizer_step_post_hooks: OrderedDict[int, Any] = OrderedDict()
        self._optimizer_state_dict_pre_hooks: OrderedDict[int, Any] = OrderedDict()
        self._optimizer_state_dict_post_hooks: OrderedDict[int, Any] = OrderedDict()
        self._optimizer_load_state_dict_pre_hooks: OrderedDict[int, Any] = OrderedDict()
        self._optimizer_load_state_dict_post_hooks: OrderedDict[int, Any] = OrderedDict()

    @property
    def param_groups(self) -> list[dict[str, Any]]:
        """The inner optimizer's groups (host tensors, live hyperparameters)."""
        return self.inner.param_groups

    @param_groups.setter
    def param_groups(self, value: list[dict[str, object]]) -> None:
        self.inner.param_groups = value

    @property
    def state(self) -> Any:
        """The inner optimizer's state (placeholders between steps with nvme)."""
        return self.inner.state

    @state.setter
    def state(self, value: Any) -> None:
        self.inner.state = value

    def step(self, closure: object = None) -> Any:
        """Step every tensor (closures are not supported with offload)."""
        if closure is not None:
            raise ValueError("optimizer offload does not support step(closure)")
        self.store.step(self.inner)
        return None

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Clear the device masters' gradients (host staging is refilled each step)."""
        for tensor in self.store.device_tensors:
            if set_to_none:
                tensor.grad = None
            elif tensor.grad is not None:
                tensor.grad.zero_()

    def state_dict(self) -> dict[str, Any]:
        """The inner optimizer's state dict, with nvme state read back into memory."""
        with self.store.resident_state(self.inner):
            packed = self.inner.state_dict()
            # torch shares the per-parameter dicts with the live state, which is evicted
            # again on leaving the block: hand out copies holding the loaded tensors
            packed["state"] = {k: dict(v) for k, v in packed["state"].items()}
            return packed

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load into the inner optimizer, then move the state back to its file (nvme)."""
        with self.store.resident_state(self.inner):
            self.inner.load_state_dict(state_dict)

    def __repr__(self) -> str:
        return f"OffloadedOptimizer({self.store.spec.device}, {self.inner!r})"


class _DeviceKeyedOptimizer:
    """An :class:`OffloadedOptimizer` as checkpoint code sees it.

    The device masters are the truth between steps (the host copies are refilled from
    them at every step, and with nvme they are empty), so checkpoints address parameters
    by their device masters: ``param_groups`` lists those, ``state`` is keyed by them (read
    from the swap file with nvme), and ``load_state_dict`` goes through the offloaded
    optimizer (which writes the state back to its file).
    """

    def __init__(self, proxy: OffloadedOptimizer) -> None:
        store = proxy.store
        self._device_of = {id(h): d for h, d in zip(store.host, store.device_tensors)}
        self._proxy = proxy
        self.param_groups = [
            {
                **{k: v for k, v in group.items() if k != "params"},
                "params": [self._device_of[id(h)] for h in group["params"]],
            }
            for group in proxy.inner.param_groups
        ]
        self._state: dict[torch.Tensor, dict[str, Any]] | None = None

    @property
    def state(self) -> dict[torch.Tensor, dict[str, Any]]:
        """Per device master, its state; read (from the swap file with nvme) on first use
        only, so a load, which replaces the state, never reads the old one."""
        if self._state is None:
            store = self._proxy.store
            snapshot = store.state_snapshot(self._proxy.inner)
            self._state = {self._device_of[id(h)]: snapshot[id(h)] for h in store.host if id(h) in snapshot}
        return self._state

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load (parameters by index, in the order of ``param_groups``)."""
        self._proxy.load_state_dict(state_dict)


def checkpoint_view(optimizer: object) -> Any:
    """``optimizer`` keyed by the tensors ZeRO handed it (device masters), for checkpoints.

    A plain optimizer is returned as it is; an :class:`OffloadedOptimizer` (whose inner
    optimizer works on host copies) as a view keyed by the device masters.
    """
    return _DeviceKeyedOptimizer(optimizer) if isinstance(optimizer, OffloadedOptimizer) else optimizer
