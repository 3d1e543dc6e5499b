"""deepspeed.runtime.utils' norm, clipping and overflow helpers (shardwise.precision.tensor_norms).

Expected numbers were produced by DeepSpeed 0.19.8's own functions on the same inputs (recorded here;
DeepSpeed is not imported); the norms are also checked bitwise against the plain torch computation."""

from __future__ import annotations

import math

import pytest
import torch

from shardwise.precision import tensor_norms as tn


def _tensors() -> list[torch.Tensor]:
    return [torch.tensor([1.0, -2.0, 2.0]), torch.tensor([[4.0], [-8.0]], dtype=torch.float16)]


def test_global_norm_of_tensors_matches_deepspeed_and_torch() -> None:
    ts = _tensors()
    two = tn.get_global_norm_of_tensors(ts)
    reference = torch.stack([t.float().norm(2) for t in ts]).pow(2).sum().pow(0.5)
    assert two.dtype == torch.float32 and torch.equal(two, reference)
    assert float(two) == pytest.approx(9.433980941772461, abs=0)  # DeepSpeed's value
    assert float(tn.get_global_norm_of_tensors(ts, norm_type=math.inf)) == 8.0
    assert float(tn.get_global_norm_of_tensors(ts, norm_type=1)) == 17.0
    assert float(tn.get_global_norm_of_tensors([torch.tensor([1.0, math.inf])])) == -1.0  # invalid marker
    with pytest.raises(NotImplementedError, match="gradient_clipping"):
        tn.get_global_norm_of_tensors(ts, mpu=object())


def test_clip_tensors_by_global_norm() -> None:
    ts = [t.float() for t in _tensors()]
    expected_coefficient = 2.0 / (tn.get_global_norm_of_tensors(ts) + 1e-6)
    reference = [t * expected_coefficient for t in ts]
    norm = tn.clip_tensors_by_global_norm(ts, max_norm=2.0)
    assert float(norm) == pytest.approx(9.433980941772461, abs=0)
    assert all(torch.equal(a, b) for a, b in zip(ts, reference))
    assert [x.tolist() for x in ts] == [  # DeepSpeed's clipped values
        [0.2119995653629303, -0.4239991307258606, 0.4239991307258606], [[0.8479982614517212], [-1.6959965229034424]]
    ]
    small = [torch.tensor([0.3, 0.4])]
    assert float(tn.clip_tensors_by_global_norm(small, max_norm=2.0)) == pytest.approx(0.5)
    assert small[0].tolist() == [0.30000001192092896, 0.4000000059604645]  # coefficient >= 1: untouched


def test_global_norm_and_combining_groups() -> None:
    assert tn.get_global_norm([3.0, 4.0]) == 5.0
    assert tn.get_global_norm([3.0, -1.0]) == math.inf and tn.get_global_norm([math.nan]) == math.inf
    assert float(tn.combine_grad_norm_groups([3.0, 4.0])) == 5.0
    assert float(tn.combine_grad_norm_groups([torch.tensor(3.0), -1.0])) == math.inf
    assert tn.is_invalid_grad_norm(-1) and not tn.is_invalid_grad_norm(2.0)
    assert tn.is_invalid_grad_norm(torch.tensor(math.nan))


def test_inf_nan_checks_and_masking() -> None:
    assert bool(tn.has_inf_or_nan(torch.tensor([1.0, math.inf])))
    assert bool(tn.has_inf_or_nan(torch.tensor([-math.inf])))
    assert bool(tn.has_inf_or_nan(torch.tensor([1.0, math.nan])))
    assert not bool(tn.has_inf_or_nan(torch.tensor([1.0]))) and not bool(tn.has_inf_or_nan(torch.empty(0)))
    x = torch.tensor([1.0, math.nan, math.inf, 2.0])
    tn.mask_nan_or_inf_with_val_inplace(x)
    assert x.tolist() == [1.0, -1.0, -1.0, 2.0]


def _params() -> list[torch.nn.Parameter]:
    p = torch.nn.Parameter(torch.zeros(6))
    p.grad = torch.tensor([3.0, 0.0, 4.0, 0.0, 12.0, 0.0])
    q = torch.nn.Parameter(torch.zeros(2))
    q.grad = torch.zeros(2)
    return [p, q, torch.nn.Parameter(torch.zeros(2))]  # the last has no gradient


def test_flattened_grad_norm_and_zero_count() -> None:
    p, q, r = _params()
    assert tn.get_flattened_grad_norm([p, q, r]) == 13.0
    assert tn.get_flattened_grad_norm([p], norm_type=math.inf) == 12.0
    assert tn.get_flattened_grad_norm([p], grad_norm_mask=[torch.tensor([[4, 6]])]) == 5.0
    assert tn.get_flattened_grad_norm([p], grad_norm_mask=[torch.tensor([[0, 1], [4, 5]])]) == 4.0
    assert tn.get_grad_zeros([p, q, r]) == 5.0
    p.ds_pipe_replicated = True  # type: ignore[attr-defined]
    assert tn.get_grad_zeros([p, q]) == 2.0


def test_small_tensor_helpers() -> None:
    assert [t.numel() for t in tn.align_dense_tensors([torch.ones(3), torch.ones(2)], 4)] == [3, 2, 3]
    assert [t.numel() for t in tn.align_dense_tensors([torch.ones(4)], 4)] == [4]
    assert tn.get_only_unique_item([5, 5]) == 5
    with pytest.raises(RuntimeError, match=r"only one unique element in \[1, 2\]"):
        tn.get_only_unique_item([1, 2])
    item = {"a": torch.ones(2), "b": [torch.ones(3, dtype=torch.float16), (torch.ones(1, dtype=torch.int64),)], "c": 3}
    assert tn.get_tensor_bytes(item) == 22
