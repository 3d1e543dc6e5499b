"""ZeRO stages 0-2: the optimizer step over flat, (optionally) sharded buffers.

``ZeroOptimizer`` owns the flat groups, the gradient reducer and the inner torch
optimizer (which sees only the fp32 tensors this rank updates). Its ``step`` is, in
order: finish reductions; one all-reduce of the squared gradient norm (which also
detects inf/NaN: no separate flag collective); the shared step maths
(:func:`shardwise.zero.step_math.plan_step`: skip a non-finite step, else one division that
averages over ranks, unscales and clips, folded into torch's fused AdamW where it can be:
:mod:`shardwise.zero.grad_fold`); the inner optimizer step; copy fp32 masters into
16-bit parameters; all-gather updated shards. It implements
:class:`~shardwise.zero.strategy.ZeroStrategy`.

With ``overlap_comm`` at stages 1-2 (more than one rank, built with the module) the last three
go bucket by bucket and the all-gathers are left in flight for the next forward to wait for,
bucket by bucket (:mod:`shardwise.zero.async_gather`).

Stage 0: no sharding (each rank steps the whole buffer; grads all-reduced).
Stage 1: optimizer state sharded; grads reduce-scattered at the accumulation boundary.
Stage 2: stage 1 plus sharded gradients, reduce-scattered every micro step.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Sequence
from dataclasses import replace
from typing import Any

import torch
from torch import nn

from shardwise.comm import collectives
from shardwise.comm.host_transport import HostTransport, choose_host_transport
from shardwise.comm.init import group_source_rank
from shardwise.optim.clipping import squared_norm
from shardwise.optim.exchanging import GradientExchangingOptimizer
from shardwise.utils.logging import logger
from shardwise.zero.async_gather import BucketKey, PendingGathers
from shardwise.zero.flat_group import FlatGroup
from shardwise.zero.flat_layouts import FlatLayouts
from shardwise.zero.full_buffer_reducer import FullBufferReducer
from shardwise.zero.grad_fold import divide_, scaled_step
from shardwise.zero.muon_shards import attach_flat_matrices
from shardwise.zero.offload_states import OffloadStateType, StateOffloading
from shardwise.zero.offloaded_optimizer import OffloadedOptimizer
from shardwise.zero.optimizer_subset import restricted, steps_per_tensor
from shardwise.zero.param_owner import register_owner
from shardwise.zero.param_publish import launch_publish
from shardwise.zero.reducer import GradientReducer, ReducePolicy
from shardwise.zero.reducer_set import ReducerSet
from shardwise.zero.reduction_domain import (
    DATA,
    ReductionDomain,
    distinct,
    refuse_experts,
    split_by_kind,
)
from shardwise.zero.shard_accumulator_reducer import ShardAccumulatorReducer
from shardwise.zero.sharded_optimizer_policy import ZeroPolicy as ZeroPolicy  # re-exported: its old home
from shardwise.zero.state_tensors import flat_zero_states
from shardwise.zero.step_math import plan_step
from shardwise.zero.strategy import StepResult, ZeroStrategy, sharded_gradients_refusal
from shardwise.zero.unused_parameters import raise_if_unused

OptimizerFactory = Callable[[list[dict[str, Any]]], torch.optim.Optimizer]


class ZeroOptimizer(FlatLayouts, StateOffloading, ZeroStrategy):
    """Flat-buffer ZeRO (stages 0, 1, 2) around a torch optimizer built on the masters.

    ``module``: the model the parameters belong to; with ``policy.overlap_comm`` at stages 1-2
    and more than one rank, the post-step all-gather then overlaps the next forward (hooks on
    ``module`` wait for it). Without a module the gather is waited for inside ``step``.
    """

    def __init__(
        self,
        param_groups: Sequence[dict[str, Any]],
        optimizer_factory: OptimizerFactory,
        policy: ZeroPolicy,
        module: nn.Module | None = None,
    ) -> None:
        self.policy = policy
        self.mean_divisor = policy.post_divisor  # the collective summed pre_multiplier-scaled grads
        self.gradient_sync_toggle = policy.stage < 2  # stage 2 reduce-scatters every micro step
        self.gradient_sync_refusal = (
            "" if self.gradient_sync_toggle else sharded_gradients_refusal(policy.stage)
        )
        self.overflow = False  # the last boundary step was skipped (DeepSpeed's name)
        self._global_grad_norm: float | None = None  # the last boundary step's norm (DeepSpeed's name)
        self.groups: list[FlatGroup] = []
        self.domains: list[ReductionDomain] = []  # flat group -> the group its gradients reduce over
        self.group_index: list[int] = []  # flat group -> user param group
        self.tp_flags: list[bool] = []
        self.optimizer = optimizer_factory(self._build_flat_groups(param_groups))
        if policy.stage >= 1:  # Muon: where each shard's matrices lie (offloaded or not)
            attach_flat_matrices(self.optimizer, self.groups, self.group_index, param_groups, policy.process_group)
        self.reducer = self._build_reducer()
        self.exchanging: GradientExchangingOptimizer | None = (
            self.optimizer if isinstance(self.optimizer, GradientExchangingOptimizer) else None
        )
        if self.exchanging is not None:
            refuse_experts(self.domains, type(self.optimizer).__name__)
            self.exchanging.attach_process_group(policy.process_group)
        self._bind_master_grads()
        self._report_transport()
        register_owner(self, [p for flat in self.groups for p in flat.params])
        self.gathers = self._pending_gathers(module)

    # ------------------------------------------------------------------ construction steps
    def _build_flat_groups(self, param_groups: Sequence[dict[str, Any]]) -> list[dict[str, object]]:
        """One :class:`FlatGroup` per user group, parameter kind (device, dtype, tensor parallel)
        and reduction domain (dense or expert parameters, :mod:`shardwise.zero.reduction_domain`);
        returns the inner optimizer's groups over their masters."""
        policy = self.policy
        inner_groups: list[dict[str, object]] = []
        devices = {p.device for group in param_groups for p in group["params"] if p.requires_grad}
        data = policy.data_domain()
        self.transports: dict[str, HostTransport] = {}
        for gi, group in enumerate(param_groups):
            params = [p for p in group["params"] if p.requires_grad]
            hyper = {k: v for k, v in group.items() if k != "params"}
            masters: list[torch.Tensor] = []
            for key, members in split_by_kind(params, data, policy.experts).items():
                domain = key[3]
                if domain.name not in self.transports:
                    self.transports[domain.name] = self._choose_transport(devices, domain)
                flat = FlatGroup(
                    members,
                    rank=domain.rank,
                    world_size=domain.world_size,
                    bucket_numel=policy.bucket_numel,
                    shard=policy.stage >= 1,
                    full_grad_buffer=policy.stage < 2,
                    grad_dtype=policy.grad_dtype,
                    transport=self.transports[domain.name],
                )
                self.groups.append(flat)
                self.domains.append(domain)
                self.group_index.append(gi)
                self.tp_flags.append(key[2])
                masters.extend(flat.master_params())
            inner_groups.append({"params": masters, **hyper})
        first = self.transports.get(DATA) or next(iter(self.transports.values()), None)
        self.transport: HostTransport = first if first is not None else self._choose_transport(devices, data)
        return inner_groups

    def _choose_transport(self, devices: set[torch.device], domain: ReductionDomain) -> HostTransport:
        """The transport of one domain's flat buffers (shared memory when every rank of its group
        runs on this host with the parameters on the CPU over gloo, else gloo; ``comm.host_transport``
        decides)."""
        policy = self.policy
        return choose_host_transport(
            devices,
            domain.group,
            label=f"ZeRO stage {policy.stage}" + ("" if domain.name == DATA else f" ({domain.name} experts)"),
            rank=domain.rank,
            world_size=domain.world_size,
        )

    def _report_transport(self) -> None:
        """Say once (rank 0) which transport the buffers took (``comm.host_transport`` words it)."""
        stage = self.policy.stage
        whole_staged = all(store.synchronous for flat in self.groups for store in flat.staging)
        detail = {0: "gradients are all-reduced", 1: "gradients are reduced and parameters gathered"}.get(
            stage,
            "gradients are reduced (staged in a buffer of one bucket, given back after each reduction) "
            "and parameters gathered"
            if whole_staged
            else "parameters are gathered (stage 2 reduces its gradient buckets through gloo: the model "
            "does not fit in one reduce_bucket_size)",
        )
        self.transport.report(f"ZeRO stage {stage}", detail, "gradients and parameters")

    def _build_reducer(self) -> ReducerSet:
        """One gradient reducer per reduction domain, for the stage's layout: whole buffers (0-1)
        or shard accumulators (2). Both domains pre-multiply alike (the same divisor follows)."""
        policy = self.policy
        reducer_class = FullBufferReducer if policy.stage < 2 else ShardAccumulatorReducer
        reduce_policy = ReducePolicy(
            shard=policy.stage >= 1,
            every_micro_step=policy.stage >= 2,
            overlap=policy.overlap_comm,
            comm_dtype=policy.comm_dtype,
            pre_multiplier=policy.pre_multiplier,
            all_reduce_gradients=policy.all_reduce_gradients,
        )
        members: list[tuple[GradientReducer, list[int]]] = []
        for name, domain in distinct(self.domains).items():
            indices = [i for i, d in enumerate(self.domains) if d.name == name]
            groups = [self.groups[i] for i in indices]
            local = domain.name != DATA and domain.world_size == 1  # experts on one rank: no collective
            members.append(
                (reducer_class(groups, replace(reduce_policy, local=local), domain.group), indices)
            )
        return ReducerSet(members)

    def _pending_gathers(self, module: nn.Module | None) -> PendingGathers | None:
        """``overlap_comm`` at stages 1-2: the post-step all-gathers left in flight behind the next
        forward (hooks on ``module`` wait for them); None when the gather finishes inside the step
        (one rank, no module, or a transport whose gathers are done when they return: a copy)."""
        policy = self.policy
        in_flight = not all(flat.param_store.synchronous for flat in self.groups)
        if not (
            policy.overlap_comm
            and policy.stage in (1, 2)
            and policy.world_size > 1
            and module is not None
            and in_flight
        ):
            return None
        gathers = PendingGathers(self.groups)
        gathers.attach(module)
        if policy.rank == 0:
            logger.info(
                "zero_optimization.overlap_comm at stage %d: the post-step all-gather runs behind the "
                "next forward; code that reads parameter tensors directly between engine.step() and "
                "the next forward must call engine.optimizer.wait_for_parameters() first",
                policy.stage,
            )
        return gathers

    def wait_for_parameters(self) -> None:
        """Complete the post-step all-gathers still in flight (``overlap_comm``), so every rank's
        parameters hold the updated values; a no-op when none is. Reads through the model's
        forward or ``state_dict`` and through this strategy wait by themselves; call it before
        reading parameter tensors directly between ``step()`` and the next forward."""
        if self.gathers is not None:
            self.gathers.wait_all()

    # ------------------------------------------------------------------ wiring
    def _bind_master_grads(self) -> None:
        for flat in self.groups:
            for master, grad in zip(flat.master, flat.grad):
                master.grad = grad if grad.dtype == master.dtype else None

    @property
    def param_groups(self) -> list[dict[str, Any]]:
        """The inner optimizer's param groups (schedulers write ``lr`` here)."""
        return self.optimizer.param_groups

    def broadcast_parameters(self) -> None:
        """Make every rank start from the first data-parallel rank's parameters (and masters)."""
        self.wait_for_parameters()
        for flat, domain in zip(self.groups, self.domains):
            if domain.world_size > 1:  # expert parameters: from the first rank of their expert-data group
                collectives.broadcast(
                    flat.param_buffer, src=group_source_rank(domain.group), group=domain.group
                )
            flat.refresh_masters()

    # ------------------------------------------------------------------ micro steps
    def prepare_backward(self, is_boundary: bool) -> None:
        """Tell the reducer whether this backward ends an accumulation window, and whether the
        optimizer exchanges by itself at the next step (then gradients stay local)."""
        self.wait_for_parameters()  # a backward with no forward since the step reads nothing, but be safe
        self.reducer.reduce_this_backward = is_boundary
        self.reducer.optimizer_exchanges = self._optimizer_exchanges()

    def _optimizer_exchanges(self) -> bool:
        return self.exchanging is not None and self.exchanging.exchanges_gradients

    def _silent_step(self) -> bool:
        """The optimizer's next step sends nothing, and no overflow check needs the ranks to agree."""
        return not getattr(self.exchanging, "communicates_next_step", True) and not self.policy.check_overflow

    def after_backward(self) -> None:
        """Complete this backward's reductions (waits for in-flight buckets)."""
        self.reducer.finish()

    def fold_gradients(self) -> None:
        """Every gradient of this window into the flat buffers, unreduced (see ``BucketReducer.fold_window``)."""
        self.reducer.fold_window()

    def end_window(self) -> None:
        """Unmanaged accumulation: stages 0-1 reduce the window's local gradients now; stage 2
        reduce-scattered them at every backward already."""
        if self.policy.stage < 2:
            self.reduce_gradients()

    def reduce_gradients(self) -> None:
        """Reduce this window's accumulated gradients now, as a boundary backward would (a pipeline's
        ReduceGrads, after the backwards of its micro batches ran with ``prepare_backward(False)``)."""
        self.reducer.optimizer_exchanges = self._optimizer_exchanges()
        self.reducer.reduce_window()

    def reduce_pending_gradients(self) -> None:
        """Reduce this window's gradients if no backward did (stages 0-1: backwards under ``no_sync``);
        nothing when a reducing backward did, or at stage 2 (each backward reduce-scatters its own)."""
        if self.policy.stage < 2 and not self.reducer.gradients_ready:
            self.reduce_gradients()

    def accumulated_gradient(self, param: torch.Tensor) -> torch.Tensor:
        """``param``'s gradient accumulated in this window and not yet reduced (stages 0-1), as a
        view of the full gradient buffer: a pipeline sums tied weights' gradients over its stages
        there, before the data-parallel reduction."""
        for flat in self.groups:
            for index, p in enumerate(flat.params):
                if p is param:
                    return flat.gradient_slot(index)
        raise KeyError(f"parameter of shape {tuple(param.shape)} is not optimized by this ZeRO optimizer")

    def zero_grad(self) -> None:
        """Clear accumulated gradients."""
        for flat in self.groups:
            flat.zero_grads()
        self.reducer.new_window()

    def set_gradient_sync(self, enabled: bool) -> None:
        """Reduce gradients in backward (True) or accumulate them locally (False; stages 0-1)."""
        if not enabled and not self.gradient_sync_toggle:
            raise RuntimeError(self.gradient_sync_refusal)
        self.reducer.sync_enabled = enabled

    # ------------------------------------------------------------------ the step
    def _squared_norm(self, local_gradients: bool = False) -> torch.Tensor:
        """Sum of squares of the reduced gradients (``local_gradients``: of every rank's own,
        un-reduced gradients, summed over the ranks)."""
        device = self.groups[0].device
        mp_rank0 = self.policy.mp_rank == 0
        domains = distinct(self.domains)
        parts = {name: torch.zeros((), dtype=torch.float32, device=device) for name in domains}
        for flat, is_tp, domain in zip(self.groups, self.tp_flags, self.domains):
            if not (is_tp or mp_rank0 or domain.spans_model_parallel):
                continue  # replicated across model-parallel ranks: count it once
            parts[domain.name] += squared_norm(flat.grad).to(device)
        summed = self.policy.stage >= 1 or local_gradients  # shards (or local gradients) add up
        total = torch.zeros((), dtype=torch.float32, device=device)
        whole = torch.zeros((), dtype=torch.float32, device=device)  # already summed over every lane
        for name, part in parts.items():
            domain = domains[name]
            if summed and domain.world_size > 1:
                collectives.all_reduce(part, op="sum", group=domain.group)
            if domain.spread_size > 1:  # other experts on the other expert-parallel ranks
                collectives.all_reduce(part, op="sum", group=domain.spread_group)
            if domain.spans_model_parallel:
                whole += part
            else:
                total += part
        if self.policy.mp_size > 1:
            collectives.all_reduce(total, op="sum", group=self.policy.mp_group)
        return total + whole

    def step(self, loss_scale: float = 1.0) -> StepResult:
        """One optimizer step at an accumulation boundary (every rank must call it)."""
        self.wait_for_parameters()
        self.reducer.finish()
        if self.policy.fail_on_unused:
            self._check_all_used()
        for flat in self.groups:
            flat.settle()  # slots no gradient reached in this window (e.g. no_sync at the boundary)
        local = self._optimizer_exchanges()
        if local and self._silent_step():
            # A step that sends nothing (0/1 Adam's local step) and no overflow check to agree on:
            # this rank's own norm, no collective; clipping uses it (the ranks' parameters differ
            # until the next sync anyway, as in DeepSpeed). A non-finite one cannot be skipped on
            # this rank alone (the ranks' step counts would part), so it stops training here.
            squared = float(self._squared_norm())
            if not math.isfinite(squared):
                raise RuntimeError(
                    f"rank {self.policy.rank}: non-finite gradients in a communication-free local step of "
                    f"{type(self.exchanging).__name__}; other ranks cannot skip it with this rank. Lower the "
                    "learning rate or set gradient_clipping, or use fp16 with loss scaling (then ranks agree on skips)."
                )
        elif local:
            # Un-reduced gradients (the optimizer averages its momentum itself): each rank's own
            # gradient is unscaled as it is, and clipped by the root mean square of the ranks' norms
            # (an upper bound of the mean's norm), the same divisor on every rank.
            squared = float(self._squared_norm(local_gradients=True)) / self.policy.world_size
        else:
            squared = float(self._squared_norm())
        plan = plan_step(
            squared,
            mean_divisor=1.0 if local else self.mean_divisor,
            loss_scale=loss_scale,
            max_norm=self.policy.gradient_clipping,
            check_overflow=self.policy.check_overflow,
        )
        self.overflow = not plan.apply  # DeepSpeed's name: accelerate reads it as 'step skipped'
        self._global_grad_norm = plan.grad_norm  # DeepSpeed's optimizer attribute (the unclipped global norm)
        if not plan.apply:
            self.zero_grad()
            return plan.result()
        self._bind_master_grads()  # again: a script's zero_grad() on the inner optimizer drops them
        self._update(plan.divisor)
        self.zero_grad()
        return plan.result()

    def _update(self, divisor: float) -> None:
        """The inner step on the gradients over ``divisor``, then the parameters published:
        all at once with a waited gather, or (``overlap_comm``) bucket by bucket in the forward's
        order, each bucket's gather started as soon as it is updated and left in flight."""
        if self.gathers is None:
            grads = [g for flat in self.groups for g in flat.grad]
            scaled_step(self.optimizer, grads, divisor, lambda: self._scale_gradients(divisor))
            self._publish_parameters()
            return
        order = self.gathers.step_order()
        per_bucket = steps_per_tensor(self.optimizer)  # else its step couples tensors: one step
        if not per_bucket:
            grads = [g for flat in self.groups for g in flat.grad]
            scaled_step(self.optimizer, grads, divisor, lambda: self._scale_gradients(divisor))
        for key in order:
            if per_bucket:
                self._step_bucket(key, divisor)
            self._cast_masters_to_params([key])
            self._gather_shards([key])

    def _step_bucket(self, key: BucketKey, divisor: float) -> None:
        """The inner step on one bucket's master only (exact for per-tensor optimizers)."""
        gi, b = key
        flat = self.groups[gi]
        with restricted(self.optimizer, {id(flat.master[b])}):
            scale = functools.partial(self._scale_gradients, divisor, (key,))
            scaled_step(self.optimizer, [flat.grad[b]], divisor, scale)

    def _scale_gradients(self, divisor: float, keys: Sequence[BucketKey] | None = None) -> None:
        """Average, unscale and clip: one division of the reduced gradients (of the buckets
        ``keys``, default all), then fp32 copies for masters of another dtype."""
        chosen = [(flat, range(len(flat.grad))) for flat in self.groups]
        if keys is not None:
            chosen = [(self.groups[gi], range(b, b + 1)) for gi, b in keys]
        for flat, buckets in chosen:
            divide_([flat.grad[b] for b in buckets], divisor)
            for b in buckets:
                if flat.grad[b].dtype != flat.master[b].dtype:
                    flat.master[b].grad = flat.grad[b].to(flat.master[b].dtype)

    def _check_all_used(self) -> None:
        """``ignore_unused_parameters: false``: raise naming the parameters without a gradient this window."""
        arrived = {id(self.groups[gi].params[pi]) for gi, pi in self.reducer.arrived}
        params = [p for flat in self.groups for p in flat.params]
        raise_if_unused(params, arrived, self.policy.param_names)

    def _publish_parameters(self) -> None:
        """Masters -> parameter buffer, then (sharded) bring every rank's updated shards to all
        ranks (:mod:`shardwise.zero.param_publish`: one all-gather per bucket by default)."""
        self._cast_masters_to_params()
        self._gather_shards()

    def _cast_masters_to_params(self, keys: Sequence[BucketKey] | None = None) -> None:
        """Updated fp32 masters (of the buckets ``keys``, default all) -> the (16-bit) parameter
        buffers' owned ranges (fp32: nothing to do)."""
        if keys is None:
            for flat in self.groups:
                flat.copy_master_to_params()
            return
        for gi, b in keys:
            self.groups[gi].copy_master_to_params(b)

    def _gather_shards(self, keys: Sequence[BucketKey] | None = None) -> None:
        """Sharded stages: every rank's updated shards to all ranks; all buckets waited here, or
        (``keys``, with ``overlap_comm``) those buckets' gathers started and left in flight."""
        if self.policy.stage == 0:
            return
        publish = self.policy.publish
        if keys is not None and self.gathers is not None:
            for gi, b in keys:
                domain = self.domains[gi]
                if domain.world_size > 1:
                    self.gathers.launch(
                        (gi, b), launch_publish(self.groups[gi], publish, domain.group, buckets=[b])
                    )
            return
        pending = []
        for flat, domain in zip(self.groups, self.domains):
            if domain.world_size > 1:
                pending.extend(launch_publish(flat, publish, domain.group))
        for work, then in pending:
            if work is not None:
                work.wait()
            then()

    def release_gathered_parameters(self) -> None:
        """Nothing to free: at stages 0-2 every rank holds the parameters whole, never gathered."""

    # ------------------------------------------------------------------ offload_states (zero.offload_states)
    def held_states(self) -> dict[OffloadStateType, list[torch.Tensor]]:
        """The flat buffers and their views per state name (:func:`~shardwise.zero.state_tensors.flat_zero_states`)."""
        return flat_zero_states(self)

    def host_states(self) -> frozenset[OffloadStateType]:
        """With ``offload_optimizer`` the optimizer state lives on the host already."""
        on_host = isinstance(self.optimizer, OffloadedOptimizer)
        return frozenset({OffloadStateType.optim_states}) if on_host else frozenset()

    def prepare_offload(self) -> None:
        """Parameters gathered in flight (``overlap_comm``) land before their buffers move."""
        self.wait_for_parameters()

    def close(self) -> None:
        """Complete gathers in flight, detach the hooks and delete optimizer-offload swap files (nvme)."""
        self.wait_for_parameters()
        if self.gathers is not None:
            self.gathers.detach()
        self.reducer.remove_hooks()
        store = getattr(self.optimizer, "store", None)
        if store is not None:
            store.close()

    # ------------------------------------------------------------------ introspection
    def model_state_bytes(self) -> int:
        """Bytes of parameters, gradients, masters and optimizer state held by this rank."""
        total = sum(flat.state_bytes() for flat in self.groups)
        for state in self.optimizer.state.values():
            for value in state.values():
                if torch.is_tensor(value) and value.dim() > 0:
                    total += value.numel() * value.element_size()
        return total
