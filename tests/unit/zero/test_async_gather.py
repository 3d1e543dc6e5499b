"""PendingGathers (shardwise.zero.async_gather): which waits happen where, with fake gathers."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from shardwise.zero.async_gather import PendingGathers
from shardwise.zero.flat_group import FlatGroup


class _Work:
    """A fake in-flight gather: records its wait in ``log``."""

    def __init__(self, name: str, log: list[str]) -> None:
        self.name, self.log = name, log

    def wait(self) -> None:
        self.log.append(self.name)


class _Net(nn.Module):
    def __init__(self, direct: bool = False) -> None:
        super().__init__()
        self.a = nn.Linear(4, 4)
        self.b = nn.Linear(4, 4)
        self.c = nn.Linear(4, 4)
        self.direct = direct  # read c's weight without calling c

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.b(self.a(x))
        return x @ self.c.weight.t() if self.direct else self.c(x)


def _pending(model: nn.Module) -> tuple[PendingGathers, dict[str, tuple[int, int]]]:
    """One flat group, one bucket per Linear (20 elements each)."""
    params = list(model.parameters())
    flat = FlatGroup(
        params,
        rank=0,
        world_size=1,
        bucket_numel=20,
        shard=True,
        full_grad_buffer=True,
        grad_dtype=torch.float32,
    )
    pending = PendingGathers([flat])
    keys = {name: pending.keys_of(getattr(model, name).parameters())[0] for name in ("a", "b", "c")}
    assert len(set(keys.values())) == 3
    pending.attach(model)
    return pending, keys


def _launch_all(pending: PendingGathers, keys: dict[str, tuple[int, int]], log: list[str]) -> None:
    for name, key in keys.items():
        pending.launch(key, [(_Work(name, log), lambda name=name: log.append(f"then-{name}"))])


def test_wait_for_completes_only_the_named_buckets_and_runs_then_after_wait():
    pending, keys = _pending(_Net())
    log: list[str] = []
    _launch_all(pending, keys, log)
    pending.wait_for([keys["b"]])
    assert log == ["b", "then-b"] and pending.busy
    pending.wait_all()
    assert log == ["b", "then-b", "a", "then-a", "c", "then-c"] and not pending.busy


def test_learning_forward_records_the_order_then_each_module_waits_for_its_own_bucket():
    model = _Net()
    pending, keys = _pending(model)
    # parameters sit in reverse registration order, so before learning the order is c, b, a
    assert pending.step_order() == [keys["c"], keys["b"], keys["a"]]
    model(torch.zeros(1, 4))  # the learning forward
    assert pending.learned and pending.step_order() == [keys["a"], keys["b"], keys["c"]]
    log: list[str] = []
    seen: list[list[str]] = []
    model.a.register_forward_hook(lambda m, i, o: seen.append(list(log)))
    model.b.register_forward_hook(lambda m, i, o: seen.append(list(log)))
    _launch_all(pending, keys, log)
    model(torch.zeros(1, 4))
    assert seen == [["a", "then-a"], ["a", "then-a", "b", "then-b"]]  # c still in flight while b ran
    assert not pending.busy  # the root's forward hook waited for the rest


def test_before_learning_the_root_waits_for_everything():
    model = _Net()
    pending, keys = _pending(model)
    log: list[str] = []
    seen: list[list[str]] = []
    model.a.register_forward_hook(lambda m, i, o: seen.append(list(log)))
    _launch_all(pending, keys, log)
    model(torch.zeros(1, 4))
    assert sorted(seen[0]) == sorted(["a", "b", "c", "then-a", "then-b", "then-c"])


def test_a_parameter_read_without_calling_its_module_is_waited_for_at_the_root():
    model = _Net(direct=True)
    pending, keys = _pending(model)
    model(torch.zeros(1, 4))
    assert pending.step_order()[0] == keys["c"]  # the root waits for it first, so it is updated first
    log: list[str] = []
    seen: list[list[str]] = []
    model.a.register_forward_pre_hook(lambda m, i: seen.append(list(log)))
    _launch_all(pending, keys, log)
    model(torch.zeros(1, 4))
    assert seen == [["c", "then-c", "a", "then-a"]]


def test_state_dict_and_load_state_dict_wait_for_everything():
    model = _Net()
    pending, keys = _pending(model)
    log: list[str] = []
    _launch_all(pending, keys, log)
    state = model.b.state_dict()  # a submodule's state_dict waits too
    assert not pending.busy and len(log) == 6
    _launch_all(pending, keys, log)
    model.load_state_dict({f"b.{k}": v for k, v in state.items()}, strict=False)
    assert not pending.busy and len(log) == 12


def test_detach_removes_every_hook():
    model = _Net()
    pending, keys = _pending(model)
    pending.detach()
    log: list[str] = []
    _launch_all(pending, keys, log)
    model(torch.zeros(1, 4))
    model.state_dict()
    assert log == [] and pending.busy


def test_a_forward_that_raises_still_ends_the_recording_and_waits():
    model = _Net()
    pending, keys = _pending(model)
    log: list[str] = []
    _launch_all(pending, keys, log)
    handle = model.b.register_forward_pre_hook(lambda m, i: (_ for _ in ()).throw(RuntimeError("boom")))
    with pytest.raises(RuntimeError, match="boom"):
        model(torch.zeros(1, 4))
    handle.remove()
    assert not pending.busy and pending.learned
    # c never ran a pre-hook in the recorded forward: the root waits for it (conservative, still exact)
    assert pending.step_order() == [keys["c"], keys["a"], keys["b"]]
