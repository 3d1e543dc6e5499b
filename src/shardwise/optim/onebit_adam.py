"""1-bit Adam (DeepSpeed's ``OneBitAdam``): Adam whose momentum travels as one bit per element.

DeepSpeed's algorithm (Tang et al., 2021, "1-bit Adam"), with every documented key:

- **warm-up** (the first ``freeze_step`` steps): gradients are all-reduced as usual (by the
  ZeRO stage) and both moments are updated: ``m = b1 m + (1-b1) g``, ``v = b2 v + (1-b2) g^2``.
- **compression** (from step ``freeze_step + 1``): ``v`` is frozen; each rank updates ``m``
  with its *local* gradient and the momentum is averaged by the error-compensated 1-bit
  all-reduce (:class:`shardwise.comm.compressed_allreduce.CompressedAllReduce`). The gradient
  all-reduce is skipped (:attr:`exchanges_gradients`, see :mod:`shardwise.optim.exchanging`).

Both phases update ``p -= lr * (m / (sqrt(v) + eps) + weight_decay * p)``, without bias
correction, as DeepSpeed's 1-bit Adam does (it accepts ``bias_correction`` and ignores it);
during warm-up this is exactly :class:`~shardwise.optim.adam.AdamNoBiasCorrection` in AdamW
mode (the same kernels in the same order). Differences from DeepSpeed, each a choice:
DeepSpeed's first ``step()`` only sets up its buffers and leaves the parameters unchanged
(here every step updates); DeepSpeed resets the error buffers when a checkpoint is loaded
(here they are saved per rank and restored, so a resume is bit-exact at the same world size).
``cuda_aware`` and ``comm_backend_name`` choose DeepSpeed's MPI/NCCL backends; here the
collectives run on the process group's own backend (gloo or NCCL), so they change nothing.

Example:
    >>> import torch
    >>> model = torch.nn.Linear(4, 2)
    >>> opt = OneBitAdam(model.parameters(), lr=1e-3, freeze_step=100)
    >>> model(torch.randn(3, 4)).sum().backward()
    >>> opt.step(); opt.exchanges_gradients  # one process: nothing to compress
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

__all__ = ["OneBitAdam"]


class OneBitAdam(torch.optim.Optimizer):
    """Adam with frozen variance and 1-bit compressed momentum exchange after ``freeze_step`` steps.

    Args:
        params: parameters or parameter groups.
        lr: learning rate.
        freeze_step: uncompressed warm-up steps (DeepSpeed's default: 100000).
        bias_correction: accepted for DeepSpeed configs; its 1-bit Adam never bias-corrects.
        betas: coefficients of the running averages of the gradient and its square.
        eps: added to ``sqrt(v)``.
        eps_inside_sqrt: must be False (DeepSpeed's Adam form).
        weight_decay: added to the update as ``weight_decay * p``.
        amsgrad: must be False (DeepSpeed raises for it too).
        cuda_aware: DeepSpeed's MPI switch; no effect here (see the module docstring).
        comm_backend_name: DeepSpeed's backend choice; no effect here.
    """

    def __init__(
        self,
        params: Iterable[Tensor] | Iterable[dict[str, Any]],
        lr: float = 1e-3,
        freeze_step: int = 100000,
        bias_correction: bool = True,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        eps_inside_sqrt: bool = False,
        weight_decay: float = 0.0,
        amsgrad: bool = False,
        cuda_aware: bool = False,
        comm_backend_name: str = "nccl",
    ) -> None:
        if amsgrad:
            raise ValueError("OneBitAdam: amsgrad=True is not supported (DeepSpeed raises for it too).")
        if eps_inside_sqrt:
            raise ValueError(
                "OneBitAdam: eps_inside_sqrt=True is not supported; eps is added after the sqrt."
            )
        if freeze_step < 0:
            raise ValueError(f"OneBitAdam: freeze_step must be >= 0, got {freeze_step}.")
        beta1, beta2 = betas
        if not (0.0 <= beta1 < 1.0 and 0.0 <= beta2 < 1.0):
            raise ValueError(f"OneBitAdam: betas must lie in [0, 1), got {tuple(betas)}.")
        defaults = {"lr": lr, "betas": (float(beta1), float(beta2)), "eps": eps, "weight_decay": weight_decay}
        super().__init__(params, defaults)
        self.freeze_step = int(freeze_step)
        self.bias_correction = bias_correction
        self.cuda_aware = cuda_aware
        self.comm_backend_name = comm_backend_name
        self._exchange = OneBitExchange("OneBitAdam")

    # ------------------------------------------------------------------ GradientExchangingOptimizer
    def attach_process_group(self, group: Group) -> None:
        """Exchange over ``group`` (None: the world) once the warm-up is over."""
        self._exchange.attach(group)

    def steps_taken(self) -> int:
        """Steps this optimizer has applied (restored with its state from a checkpoint)."""
        counts = [int(s["step"].item()) for s in self.state.values() if "step" in s]
        return max(counts, default=0)

    @property
    def exchanges_gradients(self) -> bool:
        """True in the compression phase with more than one rank: gradients must stay local."""
        return self._exchange.world_size > 1 and self.steps_taken() >= self.freeze_step

    def rank_state_dict(self) -> dict[str, Any]:
        """This rank's compression error buffers (empty before the first compressed step)."""
        state = self._exchange.state_dict()
        return {} if state is None else {"exchange": state}

    def load_rank_state_dict(self, state: dict[str, Any] | None) -> None:
        """Restore the error buffers saved by :meth:`rank_state_dict` (applied when the exchange is built)."""
        self._exchange.load_state_dict((state or {}).get("exchange"))

    # ------------------------------------------------------------------ the step
    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> float | None:  # type: ignore[override]
        """One step: uncompressed during warm-up, then frozen variance and compressed momentum.

        Collective in the compression phase: every rank of the attached group calls it.
        """
        loss = run_closure(closure)
        compressed = self.exchanges_gradients
        buckets = []
        for group in self.param_groups:
            beta1, beta2 = group["betas"]
            for tensors in collect_group(self.state, group, ("exp_avg", "exp_avg_sq"), "OneBitAdam").values():
                exp_avgs, exp_avg_sqs = tensors.moments["exp_avg"], tensors.moments["exp_avg_sq"]
                torch._foreach_lerp_(exp_avgs, tensors.grads, 1.0 - beta1)
                if not compressed:
                    torch._foreach_mul_(exp_avg_sqs, beta2)
                    torch._foreach_addcmul_(exp_avg_sqs, tensors.grads, tensors.grads, value=1.0 - beta2)
                buckets.append((group, tensors))
        if compressed:  # one exchange for all momenta
            self._exchange.average([m for _, t in buckets for m in t.moments["exp_avg"]])
        for group, tensors in buckets:
            lr, weight_decay = group["lr"], group["weight_decay"]
            params = tensors.params
            denom = torch._foreach_sqrt(tensors.moments["exp_avg_sq"])
            torch._foreach_add_(denom, group["eps"])
            if weight_decay != 0.0:
                torch._foreach_mul_(params, 1.0 - lr * weight_decay)
            torch._foreach_addcdiv_(params, tensors.moments["exp_avg"], denom, value=-lr)
            torch._foreach_add_(tensors.steps, 1.0)
        return loss
