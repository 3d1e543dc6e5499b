"""DeepSpeed's ``"optimizer": {"type": "Muon"}``: torch's Muon for hidden matrices, AdamW for the rest.

:class:`MuonWithAdamW` takes param groups flagged ``use_muon`` (:mod:`shardwise.optim.muon_groups`
builds them as DeepSpeed does). A Muon group gets ``torch.optim.Muon``'s update exactly: the
momentum buffer ``lerp``, the Nesterov blend, torch's own Newton-Schulz iteration
(``torch.optim._muon._zeropower_via_newtonschulz``, bf16, quintic coefficients) and torch's
learning-rate adjustment for the matrix shape, then decoupled weight decay. The other groups are
stepped by a ``torch.optim.AdamW`` that shares their dicts and the state (so schedulers and
checkpoints see one optimizer).

Whole matrices are needed for the orthogonalisation. Where the optimizer steps whole tensors
(ZeRO stage 0's per-parameter masters, stage 3's unsharded Muon parameters) it uses them as they
are. ZeRO stages 1-2 hand it flat shards of buckets; :meth:`MuonWithAdamW.attach_flat_matrices`
then tells it, per shard, which matrices its bucket holds. The momentum and the Nesterov blend
stay element-wise on the shard (so the momentum is partitioned, and checkpointed, like Adam's
moments); the blended update of the whole bucket is assembled on every rank (each rank adds its
shard into zeros and the buckets are summed over the group: every element is one rank's value plus
zeros, so exact), every matrix is orthogonalised on every rank, and each rank applies its own
slice. ``newton_schulz_matrices`` / ``newton_schulz_iterations`` count what ran on this rank, so
a test can see the orthogonalisation is never off.

``ns_method``: DeepSpeed's ``"standard"`` is torch's iteration; ``"gram"`` (DeepSpeed's default) is
a reformulation of the same polynomial iteration on the Gram matrix, which shardwise runs as the
standard iteration (same maths, other rounding) and says so once.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any, cast

import torch
from torch.optim._muon import _adjust_lr, _zeropower_via_newtonschulz  # torch 2.13's Muon maths

from shardwise.optim.muon_groups import ADAM_KEYS, MUON_KEYS
from shardwise.utils.logging import logger

__all__ = ["NS_METHODS", "FlatMatrices", "MuonWithAdamW"]

NS_METHODS = ("gram", "standard")
"""DeepSpeed's ``ns_method`` values."""

_MUON_DEFAULTS: dict[str, Any] = {
    "lr": 0.02,
    "momentum": 0.95,
    "weight_decay": 0.0,
    "ns_method": "gram",
    "nesterov": True,
    "ns_coefficients": (3.4445, -4.7750, 2.0315),
    "eps": 1e-7,
    "ns_steps": 5,
    "adjust_lr_fn": None,
}
"""DeepSpeed's Muon defaults (lr, momentum, weight decay, ns_method) and torch's for the rest."""

_ADAM_DEFAULTS: dict[str, Any] = {"lr": 3e-4, "betas": (0.9, 0.95), "eps": 1e-10, "weight_decay": 0.0}
"""DeepSpeed's defaults for the AdamW half."""

_said_gram = False


@dataclass(frozen=True)
class FlatMatrices:
    """What one flat shard (a master the optimizer steps at ZeRO stages 1-2) belongs to.

    Attributes:
        bucket_numel: elements of the whole bucket the shard is part of.
        own: ``(lo, hi)``: the shard's range in the bucket.
        matrices: ``(offset, shape)`` of every Muon parameter in the bucket (offset in the bucket).
        assemble: sums a bucket-sized tensor over the data-parallel group in place.
    """

    bucket_numel: int
    own: tuple[int, int]
    matrices: tuple[tuple[int, tuple[int, ...]], ...]
    assemble: Callable[[torch.Tensor], None]


def _as_matrix(update: torch.Tensor, shape: Sequence[int]) -> torch.Tensor:
    """The update as the 2-D matrix Newton-Schulz runs on (more dimensions: rows x the rest, as DeepSpeed)."""
    return update.reshape(shape[0], -1)


class MuonWithAdamW(torch.optim.Optimizer):
    """Muon for the groups with ``use_muon``, torch's AdamW for the others (see the module docstring).

    Args:
        params: param groups, each with ``use_muon`` (a plain list: matrices Muon, the rest AdamW).
        adam_kernel: ``fused``/``foreach`` for the AdamW half.
        **defaults: settings for groups that do not set them (Muon's and AdamW's keys).

    Example:
        >>> w, b = torch.nn.Parameter(torch.eye(2)), torch.nn.Parameter(torch.zeros(2))
        >>> opt = MuonWithAdamW([{"params": [w], "use_muon": True}, {"params": [b], "use_muon": False}])
        >>> w.grad, b.grad = torch.ones(2, 2), torch.ones(2)
        >>> _ = opt.step()
        >>> opt.newton_schulz_matrices, opt.newton_schulz_iterations, sorted(opt.state[w])
        (1, 5, ['momentum_buffer'])
    """

    def __init__(
        self, params: Iterable[Any], adam_kernel: dict[str, bool] | None = None, **defaults: Any
    ) -> None:
        groups: list[Any] = [dict(g) if isinstance(g, dict) else g for g in params]
        if groups and not isinstance(groups[0], dict):
            tensors = list(groups)
            groups = [
                {"params": [p for p in tensors if p.dim() >= 2], "use_muon": True},
                {"params": [p for p in tensors if p.dim() < 2], "use_muon": False},
            ]
            groups = [g for g in groups if g["params"]]
        for group in groups:
            muon = bool(group.get("use_muon"))
            base, settable = (_MUON_DEFAULTS, MUON_KEYS) if muon else (_ADAM_DEFAULTS, ADAM_KEYS)
            for key, value in base.items():  # the config's keys of this half only (Adam's eps is not Muon's)
                group.setdefault(key, defaults[key] if key in settable and key in defaults else value)
            group["use_muon"] = bool(group.get("use_muon"))
            if group["use_muon"]:
                _check_muon_group(group)
        super().__init__(groups, {})
        adam_groups = [g for g in self.param_groups if not g["use_muon"]]
        self._adam = (
            torch.optim.AdamW(adam_groups, **cast(dict[str, Any], adam_kernel or {}), **_ADAM_DEFAULTS)
            if adam_groups
            else None
        )
        if self._adam is not None:
            self._adam.state = self.state
        self._flat: dict[int, FlatMatrices] = {}
        self.newton_schulz_matrices = 0
        self.newton_schulz_iterations = 0

    def attach_flat_matrices(self, shards: dict[int, FlatMatrices]) -> None:
        """ZeRO stages 1-2: which matrices each flat master (by ``id``) holds pieces of."""
        self._flat = dict(shards)

    def _orthogonalize(self, update: torch.Tensor, group: dict[str, Any]) -> torch.Tensor:
        self.newton_schulz_matrices += 1
        self.newton_schulz_iterations += int(group["ns_steps"])
        return _zeropower_via_newtonschulz(update, group["ns_coefficients"], group["ns_steps"], group["eps"])

    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        """One step of every group (Muon, then AdamW)."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            if group["use_muon"]:
                self._muon_group(group)
        if self._adam is not None:
            # the same dicts, re-read each step (a restricted step or a load replaces the list)
            self._adam.param_groups = [g for g in self.param_groups if not g["use_muon"]]
            self._adam.state = self.state
            if self._adam.param_groups:
                self._adam.step()
        return loss

    def _muon_group(self, group: dict[str, Any]) -> None:
        lr, wd, beta = group["lr"], group["weight_decay"], group["momentum"]
        for p in group["params"]:
            flat = self._flat.get(id(p))
            if p.grad is None and flat is None:
                continue
            grad = p.grad if p.grad is not None else torch.zeros_like(p)
            state = self.state[p]
            if "momentum_buffer" not in state:
                state["momentum_buffer"] = torch.zeros_like(p)
            buf = state["momentum_buffer"]
            buf.lerp_(grad, 1 - beta)
            update = grad.lerp(buf, beta) if group["nesterov"] else buf
            if flat is None and p.dim() < 2:
                raise RuntimeError(
                    f"Muon got a {p.dim()}-D tensor of {p.numel()} elements with no map to its matrices: a flat "
                    "shard whose strategy did not call attach_flat_matrices; fix: give Muon whole matrices, or "
                    "attach the flat layout (shardwise.zero.muon_shards.attach_flat_matrices)"
                )
            if flat is None:
                ortho = self._orthogonalize(_as_matrix(update, p.shape), group).view(p.shape)
                p.mul_(1 - lr * wd)
                p.add_(ortho, alpha=-_adjust_lr(lr, group["adjust_lr_fn"], _as_matrix(p, p.shape).shape))
            else:
                self._flat_step(p, update, flat, group)

    def _flat_step(
        self, shard: torch.Tensor, update: torch.Tensor, flat: FlatMatrices, group: dict[str, Any]
    ) -> None:
        """Orthogonalise every matrix of the shard's bucket from the assembled update; apply this shard's slice."""
        lo, hi = flat.own
        whole = torch.zeros(flat.bucket_numel, dtype=update.dtype, device=update.device)
        whole[lo:hi] = update
        flat.assemble(whole)
        lr, wd = group["lr"], group["weight_decay"]
        for offset, shape in flat.matrices:
            numel = int(torch.Size(shape).numel())
            matrix = _as_matrix(whole[offset : offset + numel], shape)
            ortho = self._orthogonalize(matrix, group).reshape(-1)
            start, stop = max(lo, offset), min(hi, offset + numel)
            if start >= stop:
                continue
            piece = shard[start - lo : stop - lo]
            piece.mul_(1 - lr * wd)
            piece.add_(
                ortho[start - offset : stop - offset],
                alpha=-_adjust_lr(lr, group["adjust_lr_fn"], matrix.shape),
            )

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """torch's load, then the AdamW half re-linked to the new group dicts and state.

        A plain-number ``step`` (DeepSpeed's universal checkpoints hold ints) becomes the float32
        tensor torch's AdamW steps with, as ``AdamW.__setstate__`` does for its own loads.
        """
        super().load_state_dict(state_dict)
        if self._adam is not None:
            self._adam.param_groups = [g for g in self.param_groups if not g["use_muon"]]
            self._adam.state = self.state
            for group in self._adam.param_groups:
                for p in group["params"]:
                    state = self.state.get(p, {})
                    if "step" in state and not torch.is_tensor(state["step"]):
                        state["step"] = torch.tensor(float(state["step"]), dtype=torch.float32)


def _check_muon_group(group: dict[str, Any]) -> None:
    global _said_gram
    method = group["ns_method"]
    if method not in NS_METHODS:
        raise ValueError(
            f"optimizer.params.ns_method = {method!r}: DeepSpeed's Muon takes one of {list(NS_METHODS)}; "
            'fix: use "gram" (the default) or "standard"'
        )
    if method == "gram" and not _said_gram:
        _said_gram = True
        logger.info(
            'Muon ns_method "gram": DeepSpeed\'s Gram-matrix form of the Newton-Schulz iteration; shardwise '
            "runs torch.optim.Muon's standard form of the same iteration (same maths, other rounding)"
        )
