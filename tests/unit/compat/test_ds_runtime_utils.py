"""deepspeed.runtime.utils: partitioning, clipping, norms, call_to_str, see_memory_usage."""

from __future__ import annotations

import itertools

import pytest
import torch

from shardwise.compat import runtime_utils as ru


def _spread(weights: list[float], bounds: list[int]) -> float:
    sums = [sum(weights[b:e]) for b, e in itertools.pairwise(bounds)]
    return max(sums) - min(sums)


@pytest.mark.parametrize(("weights", "parts", "spread"), [
    ([1, 2, 1], 4, 2), ([1, 1, 1, 1], 4, 0), ([1, 1, 1, 1, 1], 4, 1), ([1, 1, 1, 1, 0, 1], 4, 1),
    ([5, 1, 1, 1, 1, 1], 2, 0), ([3, 3, 3, 3, 3, 3, 3, 3], 3, 3),
])
def test_partition_balanced(weights: list[float], parts: int, spread: float) -> None:
    bounds = ru.partition_balanced(weights, parts)
    assert len(bounds) == parts + 1 and bounds[0] == 0 and bounds[-1] == len(weights)
    assert bounds == sorted(bounds) and _spread(weights, bounds) == spread


def test_prefix_sum_inc() -> None:
    assert ru.prefix_sum_inc([3, 4, 5]) == [3, 7, 12]
    assert ru.prefix_sum_inc([0.5, 0.25]) == [0.5, 0.75] and ru.prefix_sum_inc([]) == []


def test_partition_uniform() -> None:
    assert ru.partition_uniform(10, 4) == [0, 3, 6, 8, 10]
    assert ru.partition_uniform(2, 4) == [0, 1, 2, 2, 2]


def test_call_to_str() -> None:
    assert ru.call_to_str("int") == "int()"
    assert ru.call_to_str("int", 3, "jeff") == "int(3, 'jeff')"
    assert ru.call_to_str("hello", 1138, val=3) == "hello(1138, val=3)"


def test_clip_grad_norm_matches_torch() -> None:
    def params() -> list[torch.nn.Parameter]:
        ps = [torch.nn.Parameter(torch.zeros(1)) for _ in range(2)]
        for p in ps:
            p.grad = torch.ones(1)
        return ps

    expected, actual = params(), params()
    torch.nn.utils.clip_grad_norm_(expected, 0.1)
    norm = ru.clip_grad_norm_(actual, max_norm=0.1)
    assert norm == pytest.approx(2**0.5) and all(torch.equal(e.grad, a.grad) for e, a in zip(expected, actual))
    with pytest.raises(NotImplementedError, match="mpu"):
        ru.clip_grad_norm_(actual, 0.1, mpu=object())


def test_get_weight_norm() -> None:
    assert ru.get_weight_norm([torch.tensor([3.0]), torch.tensor([4.0])]) == 5.0
    assert ru.get_weight_norm([torch.tensor([float("inf")])]) == -1.0


def test_see_memory_usage_logs_only_when_forced(monkeypatch: pytest.MonkeyPatch) -> None:
    said: list[str] = []
    monkeypatch.setattr(ru.logger, "info", lambda fmt, *args: said.append(fmt % args))
    ru.see_memory_usage("quiet")
    ru.see_memory_usage("after init", force=True)
    assert len(said) == 1 and said[0].startswith("after init | MA ")


def test_count_used_parameters_in_backward_counts_what_this_backward_reaches() -> None:
    from shardwise.compat.runtime_utils import count_used_parameters_in_backward

    used = torch.nn.Parameter(torch.ones(2))
    shared = torch.nn.Parameter(torch.ones(2))
    unused = torch.nn.Parameter(torch.ones(2))
    frozen = torch.ones(2)  # no gradient
    counts: list[int] = []
    params = [used, shared, shared, unused, frozen]
    used.register_hook(lambda grad: counts.append(count_used_parameters_in_backward(params)) or grad)
    (used * shared).sum().backward()
    assert counts == [2]  # used and shared (once); not the unused one nor the frozen tensor
    counts.clear()
    (used * 3).sum().backward()  # a second backward: only `used` now
    assert counts == [1]
    with pytest.raises(RuntimeError, match="no backward pass is running"):
        count_used_parameters_in_backward(params)


def test_internal_api_check_follows_torch(monkeypatch: pytest.MonkeyPatch) -> None:
    assert ru.check_internal_apis_for_count_used_parameters() is True  # torch 2.11+ has the introspection
    monkeypatch.delattr(torch._C, "_current_graph_task_id")
    assert ru.check_internal_apis_for_count_used_parameters() is False
    with pytest.raises(RuntimeError, match="upgrade torch"):
        ru.count_used_parameters_in_backward([])
