"""Which tensors hold each named state of a ZeRO strategy (for ``offload_states``).

Every reference the strategy keeps into a state's storage is listed, so that moving the storage
(:mod:`shardwise.zero.offload_states`) can point each one at the moved copy: a flat buffer and its
per-parameter views, a master and the gradient bound to it. Two states may share one storage (fp32
training: the masters *are* the parameters at stages 0-2; at stage 3 a sharded parameter's local
shard is its fp32 master): moving either moves both. A state a strategy does not have is not a key
(stages 0-2 have no ``contiguous_grad_buffer``, as in DeepSpeed); stage 3 lists it with no tensors
(DeepSpeed's reduction bucket; shardwise's buffers live only during a reduction).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch

from shardwise.comm.fsdp_internals import local_tensor
from shardwise.zero.offload_states import OffloadStateType

if TYPE_CHECKING:
    from shardwise.zero.sharded_optimizer import ZeroOptimizer
    from shardwise.zero.stage3 import Stage3Optimizer

Held = dict[OffloadStateType, list[torch.Tensor]]


def optimizer_state_tensors(optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    """Every tensor of the optimizer's per-parameter state (moments, step counts)."""
    return [v for state in optimizer.state.values() for v in state.values() if torch.is_tensor(v)]


def _grads(tensors: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    return [t.grad for t in tensors if t.grad is not None]


def flat_zero_states(strategy: ZeroOptimizer) -> Held:
    """Stages 0-2: the flat parameter buffers and the parameters' views (lp), the fp32 masters (hp),
    the full gradient buffers or shard accumulators and what is bound to them (grads)."""
    lp: list[torch.Tensor] = []
    hp: list[torch.Tensor] = []
    grads: list[torch.Tensor] = []
    for flat in strategy.groups:
        lp.append(flat.param_buffer)
        lp.extend(flat.params)
        hp.extend(flat.master)
        master_flat = getattr(flat, "_master_flat", None)
        if master_flat is not None:
            hp.append(master_flat)
        if flat.grad_buffer is not None:
            grads.append(flat.grad_buffer)
        grads.extend(flat.grad)
        grads.extend(_grads(flat.params))
        grads.extend(_grads(flat.master))
    return {
        OffloadStateType.lp_params: lp,
        OffloadStateType.hp_params: hp,
        OffloadStateType.lp_grads: grads,
        OffloadStateType.optim_states: optimizer_state_tensors(strategy.optimizer),
    }  # no contiguous_grad_buffer: DeepSpeed's stages 1-2 do not list it either


def stage3_states(strategy: Stage3Optimizer) -> Held:
    """Stage 3: the sharded parameters' local shards and the unsharded parameters (lp), their fp32
    masters (hp: the same local shards, plus the unsharded parameters' separate masters), the
    accumulated gradient shards and unsharded accumulators (grads)."""
    record = strategy.record
    replicated = strategy.replicated
    lp = [local_tensor(p) for p in record.sharded] + list(record.replicated)
    hp = list(strategy.masters) + list(replicated.masters)
    grads = list(strategy._acc.values()) + [a for a in replicated.accumulators if a is not None]
    grads += _grads(strategy.masters) + _grads(replicated.masters)
    return {
        OffloadStateType.lp_params: lp,
        OffloadStateType.hp_params: hp,
        OffloadStateType.lp_grads: grads,
        OffloadStateType.optim_states: optimizer_state_tensors(strategy.optimizer),
        OffloadStateType.contiguous_grad_buffer: [],
    }
