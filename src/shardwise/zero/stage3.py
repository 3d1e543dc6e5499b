"""ZeRO stage 3 on FSDP2: the optimizer side, with the same interface as ``ZeroOptimizer``.

The model was wrapped by :func:`shardwise.zero.fsdp_wrap.shard_model` (called from
``initialize`` through ``factory.prepare_module``): FSDP2 gathers parameters per shard
unit, and reduce-scatters every micro step's gradients into fp32 shards (a plain sum;
accumulation across micro steps adds into the shard). ``Stage3Optimizer`` then does what
``ZeroOptimizer`` does at its step, on those shards:

- the inner torch optimizer steps plain tensors that *are* this rank's fp32 shards
  (views of FSDP2's sharded storage: no DTensor dispatch in the step, no copies), plus
  the fp32 masters of the unsharded small parameters;
- one all-reduce of the squared norm of the local shards, then the shared step maths
  (:func:`shardwise.zero.step_math.plan_step`: a non-finite norm skips the step, else one
  division averages over ranks, unscales and clips, folded into torch's fused AdamW where it
  can be: :mod:`shardwise.zero.grad_fold`);
- the step (through an :class:`~shardwise.zero.offload.OffloadStore` with
  ``offload_optimizer``; without one, over sub-groups of at most ``sub_group_size`` elements
  of the local shard in turn, bitwise one step for torch's element-wise optimizers:
  :func:`~shardwise.zero.optimizer_subset.step_in_sub_groups`), then the unsharded parameters
  are refreshed from their masters.

There is no all-gather after the step: FSDP2 gathers the updated shards at the next
forward. It implements :class:`~shardwise.zero.strategy.ZeroStrategy` and declares no
gradient-sync toggle: ``no_sync`` is refused, as DeepSpeed does from stage 2 on.

Two things FSDP2 does not do by itself, measured on the benchmark GPT (2 gloo ranks):

- inside an accumulation window, units that stay gathered between forward and backward
  also stay gathered until the next micro step (``set_reshard_after_backward``): the
  weights cannot change before the step, so the next forward needs no all-gather;
- on CPU, when all ranks share a host, FSDP2's all-gathers and reduce-scatters go through
  shared memory (:mod:`shardwise.comm.fsdp_shared_hooks`); otherwise reduce-scatters are
  issued asynchronously during backward and waited when it ends
  (:class:`DeferredReduceScatter`), so they overlap the rest of backward (~12% per step at
  GAS 4); gradients are then moved out of ``param.grad`` into accumulators, in the order
  FSDP2 would have added them.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

from shardwise.comm import collectives
from shardwise.comm.fsdp_internals import is_dtensor, local_tensor
from shardwise.comm.init import group_source_rank
from shardwise.utils.logging import logger
from shardwise.zero.deferred_reduce_scatter import DeferredReduceScatter
from shardwise.zero.grad_fold import divide_, scaled_step
from shardwise.zero.offload import OffloadedOptimizer, OffloadStore
from shardwise.zero.offload_states import OffloadStateType, StateOffloading
from shardwise.zero.optimizer_subset import step_in_sub_groups, steps_per_tensor
from shardwise.zero.param_owner import register_owner
from shardwise.zero.param_swap import SwappedMasters
from shardwise.zero.replicated import ReplicatedParams
from shardwise.zero.sharded_model import ShardedModel
from shardwise.zero.sharded_optimizer import OptimizerFactory
from shardwise.zero.stage3_layouts import Stage3Layouts
from shardwise.zero.stage3_memory import breakdown
from shardwise.zero.stage3_policy import Stage3Policy as Stage3Policy  # re-exported: its old home
from shardwise.zero.stage3_policy import UnitHooks as UnitHooks
from shardwise.zero.stage3_policy import choose_unit_hooks as choose_unit_hooks
from shardwise.zero.state_tensors import stage3_states
from shardwise.zero.step_math import plan_step
from shardwise.zero.strategy import StepResult, ZeroStrategy, sharded_gradients_refusal
from shardwise.zero.unused_parameters import raise_if_unused


class Stage3Optimizer(Stage3Layouts, StateOffloading, ZeroStrategy):
    """ZeRO stage 3 over an FSDP2-wrapped module (a :class:`~shardwise.zero.strategy.ZeroStrategy`).

    Args:
        record: what wrapping produced (``factory.prepare_module``).
        param_groups: the user's parameter groups (original or wrapped parameter objects).
        optimizer_factory: builds the inner torch optimizer over plain tensors.
        policy: the stage-3 policy.

    Example:
        >>> # engine, optimizer, _, _ = shardwise.initialize(model=m, config={"zero_optimization": {"stage": 3}, ...})
        >>> # type(optimizer).__name__ -> 'Stage3Optimizer'
    """

    def __init__(
        self,
        record: ShardedModel,
        param_groups: Sequence[dict[str, Any]],
        optimizer_factory: OptimizerFactory,
        policy: Stage3Policy,
    ) -> None:
        self.record = record
        self.policy = policy
        self.mean_divisor = policy.post_divisor / policy.pre_multiplier  # FSDP2 reduces by a plain sum
        self.gradient_sync_toggle = False  # gradients are reduce-scattered into shards every micro step
        self.gradient_sync_refusal = sharded_gradients_refusal(3)
        self.overflow = False  # the last boundary step was skipped (DeepSpeed's name)
        self._global_grad_norm: float | None = None  # the last boundary step's norm (DeepSpeed's name)
        self.sharded: list[nn.Parameter] = []  # trainable sharded params, optimizer order
        self.masters: list[torch.Tensor] = []  # their local fp32 shards (views)
        group_members, replicated_params = self._sort_parameters(param_groups)
        self.replicated = ReplicatedParams(
            replicated_params,
            policy.process_group,
            policy.world_size,
            policy.reduce_bucket_numel,
            policy.comm_dtype,
        )
        self._build_inner_optimizer(self._inner_groups(param_groups, group_members), optimizer_factory)
        # every trainable sharded parameter's accumulated gradient (local fp32 shard); the
        # optimizer's masters take theirs from here
        self._trainable = [p for p in record.sharded if p.requires_grad]
        self._acc: dict[int, torch.Tensor] = {}
        self._arrived: set[int] = set()  # id of each sharded parameter a gradient reached this window
        self._deferred = self._install_unit_hooks()
        self._kept_units = [u for u, r in zip(record.units, record.reshard) if r is False] + [record.module]
        self._resharding_after_backward = True
        record.replicated_listener = self._on_replicated_edit
        self._grads_ready = False  # a backward reduced gradients that no step or zero_grad dropped yet
        register_owner(self, [*self.sharded, *self.replicated.params])

    # ------------------------------------------------------------------ construction steps
    def _sort_parameters(
        self, param_groups: Sequence[dict[str, Any]]
    ) -> tuple[list[list[tuple[str, nn.Parameter]]], list[nn.Parameter]]:
        """Per user group, its trainable parameters as ``(kind, current parameter)`` (``kind``:
        sharded or replicated; each parameter once), and the replicated ones in order."""
        record = self.record
        replicated_params: list[nn.Parameter] = []
        seen: set[int] = set()
        known = {id(p) for p in record.sharded} | {id(p) for p in record.replicated}
        group_members: list[list[tuple[str, nn.Parameter]]] = []
        for group in param_groups:
            members = []
            for param in group["params"]:
                current = record.resolve(param)
                if id(current) not in known:
                    raise ValueError(
                        "an optimizer parameter group holds a tensor that is not a parameter of the model given "
                        "to shardwise.initialize; at stage 3 only the model's own parameters can be optimised"
                    )
                if not current.requires_grad or id(current) in seen:
                    continue
                seen.add(id(current))
                kind = "sharded" if is_dtensor(current) else "replicated"
                members.append((kind, current))
                if kind == "replicated":
                    replicated_params.append(current)
            group_members.append(members)
        return group_members, replicated_params

    def _inner_groups(
        self, param_groups: Sequence[dict[str, object]], group_members: list[list[tuple[str, nn.Parameter]]]
    ) -> list[dict[str, object]]:
        """The inner optimizer's groups: the user's hyperparameters over plain fp32 tensors (a sharded
        parameter's local shard, the replicated ones' masters); fills ``sharded``/``masters``."""
        inner_groups: list[dict[str, object]] = []
        for group, members in zip(param_groups, group_members):
            hyper = {k: v for k, v in group.items() if k != "params"}
            tensors = []
            for kind, param in members:
                if kind == "sharded":
                    master = local_tensor(param).detach()
                    self.sharded.append(param)
                    self.masters.append(master)
                    tensors.append(master)
                else:
                    found = self.replicated.master_of(param)
                    assert found is not None, "a replicated parameter lost its master"
                    tensors.append(found)
            inner_groups.append({**hyper, "params": tensors})
        return inner_groups

    def _build_inner_optimizer(self, inner_groups: list[dict[str, object]], factory: OptimizerFactory) -> None:
        """The inner optimizer, behind an offload store when ``offload_optimizer`` asks for one;
        with NVMe parameters and NVMe state, masters are swapped in next to their state."""
        self.store: OffloadStore | None = None
        spec = self.policy.optimizer_offload
        if spec is not None and not (spec.masters_on_host and spec.device == "cpu"):
            self.store = OffloadStore(inner_groups, spec, rank=self.policy.rank)
            self.optimizer: torch.optim.Optimizer = OffloadedOptimizer(
                factory(self.store.host_groups), self.store
            )
        else:
            self.optimizer = factory(inner_groups)
        self.sub_group_size = self._sub_group_size(self.policy.sub_group_size)
        # NVMe parameters with NVMe optimizer state: the step brings masters in a sub-group at a
        # time next to their state, instead of the whole model (a model larger than memory)
        self._swapped_masters: SwappedMasters | None = None
        if self.record.swapper is not None and self.store is not None and self.store.is_nvme:
            self._swapped_masters = SwappedMasters(self.record.swapper, self.store.device_tensors)
            self.store.companion = self._swapped_masters

    def _install_unit_hooks(self) -> DeferredReduceScatter | None:
        """Give every unit the collectives :func:`choose_unit_hooks` picks; returns the deferred
        reduce-scatter when that is the one (the step waits for it)."""
        hooks = choose_unit_hooks(self.record, self.policy)
        for module in self.record.fsdp_modules():
            if hooks.reduce_scatter is not None:
                module.set_custom_reduce_scatter(hooks.reduce_scatter)  # type: ignore[operator]
            if hooks.all_gather is not None:
                module.set_custom_all_gather(hooks.all_gather)  # type: ignore[operator]
        return hooks.reduce_scatter if isinstance(hooks.reduce_scatter, DeferredReduceScatter) else None

    def _sub_group_size(self, requested: int) -> int | None:
        """Elements per step call without an offload store (which splits its own steps); None:
        one call (the optimizer couples its tensors, so splitting would change the update)."""
        if self.store is not None:
            return None
        if steps_per_tensor(self.optimizer):
            return requested
        total = sum(t.numel() for group in self.optimizer.param_groups for t in group["params"])
        if total > requested:
            logger.warning(
                "'zero_optimization.sub_group_size' = %d has no effect: %s is not one of torch's "
                "element-wise optimizers, so its step cannot be split into sub-groups without changing the update; the "
                "%d-element local shard steps at once",
                requested,
                type(self.optimizer).__name__,
                total,
            )
        return None

    # ------------------------------------------------------------------ wiring
    @property
    def param_groups(self) -> list[dict[str, Any]]:
        """The inner optimizer's param groups (schedulers write ``lr`` here)."""
        return self.optimizer.param_groups

    def _on_replicated_edit(self, param: nn.Parameter) -> None:
        master = self.replicated.master_of(param)
        if master is not None and master.data_ptr() != param.data_ptr():
            with torch.no_grad():
                master.copy_(param)

    def broadcast_parameters(self) -> None:
        """Make every rank hold the first data-parallel rank's unsharded parameters.

        Sharded parameters were broadcast whole before they were sharded
        (``fsdp_wrap.shard_model``), so only the unsharded ones need it here.
        """
        if self.policy.world_size == 1:
            return
        src = group_source_rank(self.policy.process_group)
        for param in self.record.replicated:
            collectives.broadcast(param.data, src=src, group=self.policy.process_group)
        self.replicated.refresh_masters()

    def _rebind_masters(self) -> None:
        """Follow FSDP2 if it replaced a shard's storage (``module.to``, ``load_state_dict(assign=True)``)."""
        for param, master in zip(self.sharded, self.masters):
            local = local_tensor(param)
            if (
                local.untyped_storage().data_ptr() != master.untyped_storage().data_ptr()
                or local.shape != master.shape
            ):
                master.data = local.detach()

    # ------------------------------------------------------------------ micro steps
    def prepare_backward(self, is_boundary: bool) -> None:
        """Gradients are reduced every micro step (DeepSpeed's stage-3 behaviour); what the
        boundary decides is whether units kept gathered through forward and backward
        (``reshard_after_forward=False``) are also kept until the next micro step's forward:
        they are, inside an accumulation window, since the weights cannot change before the
        optimizer step, which saves one all-gather per unit and micro step."""
        if is_boundary != self._resharding_after_backward:
            for module in self._kept_units:
                module.set_reshard_after_backward(is_boundary, recurse=False)  # type: ignore[operator]
            self._resharding_after_backward = is_boundary
        self._collect_grads()
        if self._deferred is not None:
            self._deferred.armed = True

    def end_window(self) -> None:
        """Unmanaged accumulation: gradients were reduced at every backward; the units the window's
        backwards kept gathered are resharded, so the next forward gathers the updated weights."""
        if not self._resharding_after_backward:
            for module in self._kept_units:
                module.reshard()  # type: ignore[operator]

    def after_backward(self) -> None:
        """All-reduce the unsharded parameters' gradients of this backward (FSDP2 already
        reduce-scattered the sharded ones in its post-backward)."""
        self._collect_grads()
        if self._deferred is not None:
            self._deferred.armed = False
        self.replicated.reduce_micro_step()
        self._grads_ready = True

    def reduce_pending_gradients(self) -> None:
        """Nothing is left to reduce at stage 3 (every backward reduce-scatters); deferred
        reductions in flight are waited for and their gradients collected."""
        self._collect_grads()

    def _collect_grads(self) -> None:
        """Wait for deferred reductions, then move each shard gradient out of ``param.grad``
        into its accumulator: ``acc = g`` the first time (a view, no copy), ``acc += g``
        after, exactly the order FSDP2's own accumulation would use."""
        if self._deferred is not None:
            self._deferred.wait_all()
        for param in self._trainable:
            grad = param.grad
            if grad is None:
                continue
            local = local_tensor(grad)
            self._arrived.add(id(param))
            previous = self._acc.get(id(param))
            self._acc[id(param)] = local if previous is None else previous.add_(local)
            param.grad = None

    def set_gradient_sync(self, enabled: bool) -> None:
        """Gradients are always reduced at stage 3: switching it off raises (``gradient_sync_refusal``)."""
        if not enabled:
            raise RuntimeError(self.gradient_sync_refusal)

    def zero_grad(self) -> None:
        """Drop accumulated gradients (sharded and unsharded)."""
        self._collect_grads()
        self._acc = {}
        self._arrived = set()
        self._grads_ready = False
        for master in self.masters:
            master.grad = None
        self.replicated.zero_grad()

    # ------------------------------------------------------------------ the step
    def _bind_grads(self) -> list[torch.Tensor]:
        self._collect_grads()
        grads = []
        for param, master in zip(self.sharded, self.masters):
            grad = self._acc.get(id(param))
            local = grad if grad is not None else torch.zeros_like(master)
            if local.dtype != master.dtype:
                local = local.to(master.dtype)
            master.grad = local
            grads.append(local)
        self.replicated.bind_grads()
        return grads

    def _is_tp(self, param: nn.Parameter) -> bool:
        names = self.policy.param_names or {}
        return self.policy.mp_size > 1 and names.get(id(param)) in self.policy.tp_param_names

    def _squared_norm(self, sharded_grads: list[torch.Tensor]) -> float:
        """The whole model's squared gradient norm: shards summed over the data-parallel group;
        parameters split over tensor-parallel ranks summed over that group too, the others (equal
        on every tensor-parallel rank) counted once."""
        device = self.masters[0].device if self.masters else torch.device("cpu")
        totals = torch.zeros(2, dtype=torch.float32, device=device)  # [whole on every tp rank, tp-split]
        for index, grads in enumerate(self._by_tp(self.sharded, sharded_grads)):
            if grads:
                totals[index] += torch.stack(torch._foreach_norm(grads, 2.0)).float().pow(2).sum()
        if self.policy.world_size > 1:
            collectives.all_reduce(totals, op="sum", group=self.policy.process_group)
        replicated = self.replicated.grads()
        if replicated:
            # identical on every data-parallel rank after the all-reduce: counted once, locally
            for index, grads in enumerate(self._by_tp(self.replicated.params, replicated)):
                if grads:
                    totals[index] += torch.stack(torch._foreach_norm(grads, 2.0)).float().pow(2).sum().to(device)
        if self.policy.mp_size > 1:
            split = totals[1:].clone()
            collectives.all_reduce(split, op="sum", group=self.policy.mp_group)
            totals[1] = split[0]
        return float(totals.sum())

    def _by_tp(
        self, params: Sequence[nn.Parameter], grads: Sequence[torch.Tensor]
    ) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        whole: list[torch.Tensor] = []
        split: list[torch.Tensor] = []
        for param, grad in zip(params, grads):
            (split if self._is_tp(param) else whole).append(grad)
        return whole, split

    def step(self, loss_scale: float = 1.0) -> StepResult:
        """One optimizer step at an accumulation boundary (every rank must call it)."""
        policy = self.policy
        if self._swapped_masters is not None:
            self._swapped_masters.bring_in_unstreamed(self.store)
        else:
            self.record.ensure_resident()
        if policy.fail_on_unused:  # ignore_unused_parameters: false
            params = [*self._trainable, *self.replicated.params]
            raise_if_unused(params, self._arrived | self.replicated.arrived, policy.param_names)
        self._rebind_masters()
        sharded_grads = self._bind_grads()
        plan = plan_step(
            self._squared_norm(sharded_grads),
            mean_divisor=self.mean_divisor,
            loss_scale=loss_scale,
            max_norm=policy.gradient_clipping,
            check_overflow=policy.check_overflow,
        )
        self.overflow = not plan.apply  # DeepSpeed's name: accelerate reads it as 'step skipped'
        self._global_grad_norm = plan.grad_norm  # DeepSpeed's optimizer attribute (the unclipped global norm)
        if not plan.apply:
            self.zero_grad()
            return plan.result()
        grads, divisor = sharded_grads + self.replicated.grads(), plan.divisor  # folded where it can be
        scaled_step(self.optimizer, grads, divisor, lambda: self._scale_gradients(grads, divisor), self._step)
        self.replicated.publish()
        self.zero_grad()
        self.record.evict()
        return plan.result()

    def _step(self) -> None:
        """The inner step: one call, or one per ``sub_group_size`` sub-group of the local shard."""
        if self.sub_group_size is None:
            self.optimizer.step()
        else:
            step_in_sub_groups(self.optimizer, self.sub_group_size)

    def _scale_gradients(self, grads: list[torch.Tensor], divisor: float) -> None:
        """Average, unscale and clip: one division of every gradient the optimizer reads."""
        divide_(grads, divisor)

    def release_gathered_parameters(self) -> None:
        """Reshard every unit FSDP2 holds gathered (those kept between micro steps of a window, or
        not resharded after forward); the next forward gathers them again."""
        for module in self.record.fsdp_modules():
            module.reshard()  # type: ignore[operator]

    # ------------------------------------------------------------------ offload_states (zero.offload_states)
    def held_states(self) -> dict[OffloadStateType, list[torch.Tensor]]:
        """Local shards, masters, accumulators per state name (:func:`~shardwise.zero.state_tensors.stage3_states`)."""
        return stage3_states(self)

    def host_states(self) -> frozenset[OffloadStateType]:
        """With ``offload_optimizer`` the optimizer state lives on the host already."""
        return frozenset({OffloadStateType.optim_states}) if self.store is not None else frozenset()

    def offload_refusal(self) -> str:
        """Parameters offloaded by the config (``offload_param``) are not moved again (DeepSpeed refuses too)."""
        if self.record.policy.param_offload is None and self.record.swapper is None:
            return ""
        return (
            "zero_optimization.offload_param keeps the parameters on the host or NVMe already; "
            "remove offload_param to move states with offload_states()"
        )

    def prepare_offload(self) -> None:
        """Gathered copies are freed (DeepSpeed empties the partition cache too) and this window's
        gradients collected into their accumulators, so every state has one place to move."""
        self.release_gathered_parameters()
        self._collect_grads()

    # ------------------------------------------------------------------ introspection
    def memory_breakdown(self) -> dict[str, int]:
        """Model-state bytes held by this rank, by role (:func:`~shardwise.zero.stage3_memory.breakdown`)."""
        self._collect_grads()
        return breakdown(self)

    def model_state_bytes(self) -> int:
        """Bytes of parameters, gradients, masters and optimizer state this rank holds in
        memory (device and host; NVMe files excluded)."""
        parts = self.memory_breakdown()
        return parts["params"] + parts["grads"] + parts["optimizer"] + parts["offloaded_host"]

    def close(self) -> None:
        """Delete offload swap files."""
        if self.store is not None:
            self.store.close()
        if self.record.swapper is not None:
            self.record.swapper.close()
            self.record.swapper = None
