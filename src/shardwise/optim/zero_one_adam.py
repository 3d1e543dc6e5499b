"""0/1 Adam (DeepSpeed's ``ZeroOneAdam``, Lu et al., 2022): adaptive variance freezing, 1-bit
synchronisation and local steps.

DeepSpeed's algorithm with every documented key (the schedule is
:mod:`shardwise.optim.zero_one_schedule`); ``t`` counts the updates, from 1:

- **t <= var_freeze_step**, a *variance step* (exponentially spaced, ``var_update_scaler``): the
  ZeRO stage all-reduces the gradients in full precision, and ``m``, ``v`` are updated as in Adam.
- **t <= var_freeze_step**, any other step: the gradient stays local (:attr:`exchanges_gradients`)
  and is averaged by the error-compensated 1-bit all-reduce; only ``m`` is updated with it.
- **t > var_freeze_step**: ``v`` is frozen; every rank takes *local* steps with its own gradient,
  accumulating its displacement ``u``; at a *sync step* (every ``local_step_interval`` steps,
  doubling each ``local_step_scaler`` steps up to ``local_step_clipper``) the displacement,
  scaled by ``sqrt(v) + eps``, is averaged by the 1-bit all-reduce, the parameters move by the
  average instead of their own, and ``m`` is reset to ``-avg / sum(lr)``. Steps between syncs
  send nothing at all.

Every step applies ``p -= lr * (m / (sqrt(v) + eps) + weight_decay * p)`` without bias correction
(DeepSpeed accepts ``bias_correction`` and ignores it); while the first ``var_update_scaler``
steps are all variance steps this is :class:`~shardwise.optim.adam.AdamNoBiasCorrection` in
AdamW form, bit for bit. Differences from DeepSpeed, each a choice: DeepSpeed's first ``step()``
only sets up buffers (here every step updates, so its ``t`` is ours plus one); with one process
DeepSpeed skips the momentum update on non-variance steps (here the 1-bit average of one rank is
its gradient); a checkpoint keeps the error buffers and, inside a local interval, each rank's own
parameters, momentum and displacement (DeepSpeed resets the errors and keeps rank 0's values).
``cuda_aware`` and ``comm_backend_name`` pick DeepSpeed's MPI/NCCL backends; here the collectives
use the process group's own backend, so they change nothing.

Example:
    >>> import torch
    >>> model = torch.nn.Linear(4, 2)
    >>> opt = ZeroOneAdam(model.parameters(), lr=1e-3, var_freeze_step=10)
    >>> model(torch.randn(3, 4)).sum().backward()
    >>> opt.step(); opt.exchanges_gradients  # one process: nothing to exchange
    False
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch import Tensor

from shardwise.comm.group_type import Group
from shardwise.optim.group_state import collect_group, run_closure
from shardwise.optim.onebit_exchange import OneBitExchange
from shardwise.optim.zero_one_schedule import is_sync_step, is_variance_step

__all__ = ["ZeroOneAdam"]


class ZeroOneAdam(torch.optim.Optimizer):
    """Adam with adaptively frozen variance, 1-bit communication and local steps (0/1 Adam).

    Args:
        params: parameters or parameter groups.
        lr: learning rate.
        bias_correction: accepted for DeepSpeed configs; 0/1 Adam never bias-corrects.
        betas: coefficients of the running averages of the gradient and its square.
        eps: added to ``sqrt(v)``.
        eps_inside_sqrt: must be False (DeepSpeed's update adds eps after the square root).
        weight_decay: added to the update as ``weight_decay * p``.
        max_grad_norm: must be 0 (DeepSpeed ignores it; use ``gradient_clipping``).
        var_freeze_step: the last step that may update the variance (default 100000).
        var_update_scaler: variance updates per interval before the interval doubles (default 16).
        local_step_scaler: steps after the freeze per doubling of the local interval (default 32678).
        local_step_clipper: the largest local interval (default 16).
        amsgrad: must be False (DeepSpeed raises for it too).
        cuda_aware: DeepSpeed's MPI switch; no effect here.
        comm_backend_name: DeepSpeed's backend choice; no effect here.
    """

    def __init__(
        self,
        params: Iterable[Tensor] | Iterable[dict[str, Any]],
        lr: float = 1e-3,
        bias_correction: bool = True,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        eps_inside_sqrt: bool = False,
        weight_decay: float = 0.0,
        max_grad_norm: float = 0.0,
        var_freeze_step: int = 100000,
        var_update_scaler: int = 16,
        local_step_scaler: int = 32678,
        local_step_clipper: int = 16,
        amsgrad: bool = False,
        cuda_aware: bool = False,
        comm_backend_name: str = "nccl",
    ) -> None:
        if amsgrad:
            raise ValueError("ZeroOneAdam: amsgrad=True is not supported (DeepSpeed raises for it too).")
        if eps_inside_sqrt:
            raise ValueError(
                "ZeroOneAdam: eps_inside_sqrt=True is not supported; eps is added after the sqrt."
            )
        if max_grad_norm != 0.0:
            raise ValueError(
                f"ZeroOneAdam: max_grad_norm={max_grad_norm} has no effect in 0/1 Adam (DeepSpeed ignores it); "
                "use the top-level gradient_clipping instead."
            )
        for name, value, least in (
            ("var_freeze_step", var_freeze_step, 0),
            ("var_update_scaler", var_update_scaler, 1),
            ("local_step_scaler", local_step_scaler, 1),
            ("local_step_clipper", local_step_clipper, 1),
        ):
            if int(value) != value or value < least:
                raise ValueError(f"ZeroOneAdam: {name} must be an integer >= {least}, got {value!r}.")
        beta1, beta2 = betas
        if not (0.0 <= beta1 < 1.0 and 0.0 <= beta2 < 1.0):
            raise ValueError(f"ZeroOneAdam: betas must lie in [0, 1), got {tuple(betas)}.")
        defaults = {"lr": lr, "betas": (float(beta1), float(beta2)), "eps": eps, "weight_decay": weight_decay}
        super().__init__(params, defaults)
        self.bias_correction = bias_correction
        self.var_freeze_step = int(var_freeze_step)
        self.var_update_scaler = int(var_update_scaler)
        self.local_step_scaler = int(local_step_scaler)
        self.local_step_clipper = int(local_step_clipper)
        self.cuda_aware = cuda_aware
        self.comm_backend_name = comm_backend_name
        self._exchange = OneBitExchange("ZeroOneAdam")
        self._accumulator: Tensor | None = None  # this rank's displacement since the last sync (u)
        self._lr_sums: list[float] = []  # per param group: sum of its learning rates since the last sync

    # ------------------------------------------------------------------ the schedule
    def steps_taken(self) -> int:
        """Steps this optimizer has applied (restored with its state from a checkpoint)."""
        counts = [int(s["step"].item()) for s in self.state.values() if "step" in s]
        return max(counts, default=0)

    def _variance_step(self, t: int) -> bool:
        return t <= self.var_freeze_step and is_variance_step(t, self.var_update_scaler)

    def _sync_step(self, t: int) -> bool:
        return is_sync_step(
            t,
            var_freeze_step=self.var_freeze_step,
            scaler=self.local_step_scaler,
            clipper=self.local_step_clipper,
        )

    # ------------------------------------------------------------------ GradientExchangingOptimizer
    def attach_process_group(self, group: Group) -> None:
        """Exchange over ``group`` (None: the world)."""
        self._exchange.attach(group)

    @property
    def exchanges_gradients(self) -> bool:
        """True unless the next step is a variance step (then ZeRO all-reduces the gradients)."""
        return self._exchange.world_size > 1 and not self._variance_step(self.steps_taken() + 1)

    @property
    def communicates_next_step(self) -> bool:
        """False for a local step after the freeze: the next ``step()`` sends nothing at all."""
        t = self.steps_taken() + 1
        return self._exchange.world_size > 1 and (t <= self.var_freeze_step or self._sync_step(t))

    def rank_state_dict(self) -> dict[str, Any]:
        """This rank's error buffers and, inside a local interval, its own parameters, momentum
        and displacement (they differ between ranks until the next sync)."""
        errors = self._exchange.state_dict()
        state: dict[str, object] = {} if errors is None else {"exchange": errors}
        if self._accumulator is not None and any(self._lr_sums):
            params = self._params_with_state()
            state["local"] = {
                "params": torch.cat([p.detach().reshape(-1) for p in params]).clone(),
                "exp_avg": torch.cat([self.state[p]["exp_avg"].reshape(-1) for p in params]).clone(),
                "accumulator": self._accumulator.clone(),
                "lr_sums": list(self._lr_sums),
            }
        return state

    def load_rank_state_dict(self, state: dict[str, Any] | None) -> bool:
        """Restore :meth:`rank_state_dict`; True when it rewrote parameter values (to re-publish)."""
        state = state or {}
        self._exchange.load_state_dict(state.get("exchange"))
        local = state.get("local")
        self._accumulator, self._lr_sums = None, []
        if local is None:
            return False
        params = self._params_with_state()
        offset = 0
        for p in params:
            n = p.numel()
            p.detach().view(-1).copy_(local["params"][offset : offset + n])
            self.state[p]["exp_avg"].view(-1).copy_(local["exp_avg"][offset : offset + n])
            offset += n
        self._accumulator = local["accumulator"].clone()
        self._lr_sums = [float(x) for x in local["lr_sums"]]
        return True

    def _params_with_state(self) -> list[Tensor]:
        return [
            p for group in self.param_groups for p in group["params"] if "exp_avg" in self.state.get(p, {})
        ]

    # ------------------------------------------------------------------ the step
    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> float | None:  # type: ignore[override]
        """One step of 0/1 Adam (collective unless it is a local step: every rank calls it)."""
        loss = run_closure(closure)
        t = self.steps_taken() + 1
        frozen = t > self.var_freeze_step
        if frozen and t == self.var_freeze_step + 1:
            self._exchange.reset_errors()  # DeepSpeed restarts error feedback at the freeze
        buckets = []
        for group in self.param_groups:
            for tensors in collect_group(
                self.state, group, ("exp_avg", "exp_avg_sq"), "ZeroOneAdam"
            ).values():
                buckets.append((group, tensors))
        if not buckets:
            return loss
        if frozen:
            self._local_step(t, buckets)
        else:
            self._adam_step(t, buckets)
        for _, tensors in buckets:
            torch._foreach_add_(tensors.steps, 1.0)
        return loss

    def _adam_step(self, t: int, buckets: list[Any]) -> None:
        variance = self._variance_step(t)
        if not variance:  # local gradients: average them with one bit per element
            self._exchange.average([g for _, tensors in buckets for g in tensors.grads])
        for group, tensors in buckets:
            beta1, beta2 = group["betas"]
            torch._foreach_lerp_(tensors.moments["exp_avg"], tensors.grads, 1.0 - beta1)
            if variance:
                exp_avg_sqs = tensors.moments["exp_avg_sq"]
                torch._foreach_mul_(exp_avg_sqs, beta2)
                torch._foreach_addcmul_(exp_avg_sqs, tensors.grads, tensors.grads, value=1.0 - beta2)
            lr, weight_decay = group["lr"], group["weight_decay"]
            denom = torch._foreach_sqrt(tensors.moments["exp_avg_sq"])
            torch._foreach_add_(denom, group["eps"])
            if weight_decay != 0.0:
                torch._foreach_mul_(tensors.params, 1.0 - lr * weight_decay)
            torch._foreach_addcdiv_(tensors.params, tensors.moments["exp_avg"], denom, value=-lr)

    def _local_step(self, t: int, buckets: list[Any]) -> None:
        params = [p for _, tensors in buckets for p in tensors.params]
        if self._accumulator is None:
            numel = sum(p.numel() for p in params)
            self._accumulator = torch.zeros(numel, dtype=torch.float32, device=params[0].device)
        if len(self._lr_sums) != len(self.param_groups):
            self._lr_sums = [0.0] * len(self.param_groups)
        accumulated = _views(self._accumulator, params)
        offset = 0
        denoms: list[Tensor] = []
        for group, tensors in buckets:
            beta1 = group["betas"][0]
            lr, weight_decay = group["lr"], group["weight_decay"]
            torch._foreach_lerp_(tensors.moments["exp_avg"], tensors.grads, 1.0 - beta1)
            denom = torch._foreach_sqrt(tensors.moments["exp_avg_sq"])
            torch._foreach_add_(denom, group["eps"])
            update = torch._foreach_div(tensors.moments["exp_avg"], denom)
            if weight_decay != 0.0:
                torch._foreach_add_(update, tensors.params, alpha=weight_decay)
            torch._foreach_add_(tensors.params, update, alpha=-lr)
            torch._foreach_add_(accumulated[offset : offset + len(update)], update, alpha=-lr)
            offset += len(update)
            denoms.extend(denom)
        for index, group in enumerate(self.param_groups):
            self._lr_sums[index] += float(group["lr"])
        if not self._sync_step(t):
            return  # a local step: nothing is sent
        # sync: undo the local displacement, average it (in momentum units), apply the average
        torch._foreach_sub_(params, accumulated)
        torch._foreach_mul_(accumulated, denoms)
        self._exchange.average([self._accumulator])
        offset = 0
        for group, tensors in buckets:
            moments = tensors.moments["exp_avg"]
            lr_sum = self._lr_sums[next(i for i, g in enumerate(self.param_groups) if g is group)]
            mine = accumulated[offset : offset + len(moments)]
            if lr_sum != 0.0:  # m = -average / sum(lr): the momentum the averaged displacement implies
                torch._foreach_copy_(moments, torch._foreach_div(mine, -lr_sum))
            offset += len(moments)
        torch._foreach_addcdiv_(params, accumulated, denoms)
        self._accumulator.zero_()
        self._lr_sums = [0.0] * len(self.param_groups)


def _views(flat: Tensor, like: list[Tensor]) -> list[Tensor]:
    out, offset = [], 0
    for t in like:
        out.append(flat[offset : offset + t.numel()].view_as(t))
        offset += t.numel()
    return out
