"""Do the tensor-parallel lanes hold the same routed payload? (``assert_tp_payload_consistent`` of
``deepspeed.moe.ep_tp_dispatch``).

Folded dispatch (:mod:`~shardwise.autoep.tp_dispatch`) lets each lane send only the assignments it
owns, which is right only when every lane routed the same tokens the same way. The check sums each
field of the payload into a fingerprint (its length and two position-weighted sums of its exact bit
patterns modulo two primes) and compares the lanes' fingerprints with one all-reduce: the maximum
of ``[f, -f]`` gives every lane the group's maximum and minimum at once.
"""

from __future__ import annotations

import zlib
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor

import shardwise.comm as dist

if TYPE_CHECKING:
    from shardwise.autoep.tp_dispatch import RoutedAssignmentPayload

__all__ = ["assert_tp_payload_consistent", "payload_fingerprint"]

_PRIME_A = 2_147_483_587
_PRIME_B = 2_147_483_563
_FIELDS = ("token_indices", "expert_indices", "assignment_indices", "capacity_slots", "combine_weights",
           "drop_mask", "pad_mask", "input_splits", "output_splits", "extra")
_INT_OF_WIDTH = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def _words(value: Any, device: torch.device) -> Tensor:
    """``value`` as int64 words: a tensor's exact bits (floats viewed as integers), numbers and lists
    as tensors, anything else by the CRC of its ``repr``."""
    if not isinstance(value, Tensor):
        if isinstance(value, (bool, int, float, list, tuple)):
            value = torch.tensor(value, device=device)
        else:
            value = torch.tensor([zlib.crc32(repr(value).encode())], device=device)
    flat = value.detach().reshape(-1)
    if flat.is_complex():
        flat = torch.view_as_real(flat).reshape(-1)
    if flat.is_floating_point():
        flat = flat.contiguous().view(_INT_OF_WIDTH[flat.element_size()])
    return flat.to(device=device, dtype=torch.long)


def _sums(words: Tensor) -> tuple[Tensor, Tensor]:
    """Two position-weighted sums of ``words``: linear weights modulo one prime, quadratic modulo the other."""
    if words.numel() == 0:
        zero = torch.zeros((), dtype=torch.long, device=words.device)
        return zero, zero.clone()
    position = torch.arange(1, words.numel() + 1, dtype=torch.long, device=words.device)
    linear = (position * 48_271 + 11).remainder_(_PRIME_A)
    square = (position * position).remainder_(_PRIME_B)
    a = (words.remainder(_PRIME_A) * linear).remainder_(_PRIME_A).sum().remainder(_PRIME_A)
    b = (words.remainder(_PRIME_B) * square).remainder_(_PRIME_B).sum().remainder(_PRIME_B)
    return a, b


def payload_fingerprint(payload: RoutedAssignmentPayload) -> Tensor:
    """``[len(fields), 3]`` int64: per field (the seven per-row tensors, both split lists, and
    ``extra`` folded key by key) its element count and two position-weighted sums."""
    device = payload.token_indices.device
    rows = []
    for name in _FIELDS:
        if name != "extra":
            words = _words(getattr(payload, name), device)
            rows.append(torch.stack((torch.tensor(words.numel(), device=device), *_sums(words))))
            continue
        folded = torch.zeros(3, dtype=torch.long, device=device)
        for key in sorted(payload.extra):
            words = _words(payload.extra[key], device)
            a, b = _sums(words)
            salt = zlib.crc32(key.encode())
            folded[0] += words.numel()
            folded[1] = (folded[1] * 31 + a + salt).remainder(_PRIME_A)
            folded[2] = (folded[2] * 37 + b + salt).remainder(_PRIME_B)
        rows.append(folded)
    return torch.stack(rows)


def assert_tp_payload_consistent(payload: RoutedAssignmentPayload, *, tp_group: Any, tp_size: int) -> None:
    """Raise unless every lane of ``tp_group`` holds the same payload (bit for bit); one all-reduce of
    ``6 * len(fields)`` int64s. Nothing to compare when ``tp_size`` is 1.

    Raises:
        RuntimeError: "routing decisions differ across tensor-parallel lanes", naming the fields that
            differ; or no process group with ``tp_size`` > 1.
    """
    if tp_size <= 1:
        return
    if not dist.is_initialized():
        raise RuntimeError(f"assert_tp_payload_consistent: tp_size={tp_size} needs the process group; fix: "
                           "call deepspeed.init_distributed() first (or pass tp_size=1)")
    mine = payload_fingerprint(payload)
    both = torch.cat((mine.reshape(-1), -mine.reshape(-1)))
    dist.all_reduce(both, op="max", group=tp_group)
    high, low = both[: mine.numel()].view_as(mine), -both[mine.numel():].view_as(mine)
    if torch.equal(high, low):
        return
    differing = [name for name, h, lo in zip(_FIELDS, high, low, strict=True) if not torch.equal(h, lo)]
    raise RuntimeError(
        f"AutoEP+AutoTP routing decisions differ across tensor-parallel lanes (fields {differing}); rule: "
        "folded dispatch needs every lane of a tensor-parallel group to route the same tokens identically "
        "before the assignments are partitioned; fix: give the lanes the same input and router weights and a "
        "deterministic router (no per-rank noise or dropout before the router)"
    )
