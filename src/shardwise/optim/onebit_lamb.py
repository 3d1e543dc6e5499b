"""1-bit Lamb (DeepSpeed's ``OneBitLamb``, Li et al., 2021): Lamb whose momentum travels as one bit
per element, with frozen, factor-scaled lamb coefficients.

DeepSpeed's algorithm with every documented key; ``t`` counts the updates, from 1:

- **warm-up** (``t <= freeze_step``): gradients are all-reduced as usual (by the ZeRO stage) and
  the step is Lamb without bias correction (DeepSpeed accepts ``bias_correction`` and ignores it):
  exactly :class:`~shardwise.optim.lamb.Lamb` with ``bias_correction=False``, the same kernels, a
  trust ratio per parameter. Each parameter's lamb coefficient (the clamped trust ratio) is
  recorded as an exponential moving average: ``c = coeff_beta * c + (1 - coeff_beta) * ratio``
  (skipped when the ratio is exactly 1, as DeepSpeed does).
- **compression** (``t > freeze_step``): ``v`` is frozen. Each rank updates ``m`` with its local
  gradient; the momenta, scaled to a common magnitude (``scaling_coeff``, fixed at the first
  compressed step: the mean over parameters of ``||m||/sqrt(numel)`` divided by the parameter's
  own), are averaged by the error-compensated 1-bit all-reduce
  (:class:`~shardwise.optim.onebit_exchange.OneBitExchange`); the gradient all-reduce is skipped
  (:attr:`exchanges_gradients`). A fresh variance ``v'`` is tracked from the gradient the averaged
  momentum implies, ``g = (m - beta1 m_prev) / (1 - beta1)``, and the step uses the frozen
  coefficient times a factor: ``max(denom / denom')`` (blended towards 1 by the share of weight
  decay in the update), clamped to ``[factor_min, factor_max]`` and to within
  ``factor_threshold`` of the previous factor: ``p -= lr * c * factor * (m / denom + wd * p)``.

Differences from DeepSpeed, each a choice: DeepSpeed's first ``step()`` only sets up buffers
(here every step updates); with one process the phases follow the step count all the same (the
average of one rank is its own momentum); the error buffers are saved per rank with the
checkpoint (DeepSpeed resets them). ``cuda_aware`` and ``comm_backend_name`` choose DeepSpeed's
MPI/NCCL backends; here the process group's own backend is used, so they change nothing.

Example:
    >>> import torch
    >>> model = torch.nn.Linear(4, 2)
    >>> opt = OneBitLamb(model.parameters(), lr=1e-3, freeze_step=10)
    >>> model(torch.randn(3, 4)).sum().backward()
    >>> opt.step(); opt.exchanges_gradients  # one process: nothing to exchange
    False
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch import Tensor

from shardwise.comm.group_type import Group
from shardwise.optim.group_state import collect_group, run_closure
from shardwise.optim.lamb import Lamb
from shardwise.optim.onebit_exchange import OneBitExchange

__all__ = ["OneBitLamb"]


class OneBitLamb(torch.optim.Optimizer):
    """Lamb with frozen lamb coefficients and 1-bit compressed momentum after ``freeze_step`` steps.

    Args:
        params: parameters or parameter groups.
        lr: learning rate.
        freeze_step: uncompressed warm-up steps (DeepSpeed's default: 100000); at least 1.
        bias_correction: accepted for DeepSpeed configs; 1-bit Lamb never bias-corrects.
        betas: coefficients of the running averages of the gradient and its square.
        eps: added to ``sqrt(v)``.
        eps_inside_sqrt: must be False (DeepSpeed's update adds eps after the square root).
        weight_decay: added to the update as ``weight_decay * p`` before the trust ratio.
        max_grad_norm: must be 0 (DeepSpeed ignores it; use ``gradient_clipping``).
        max_coeff: upper clamp of the warm-up trust ratio.
        min_coeff: lower clamp of the warm-up trust ratio.
        amsgrad: must be False (DeepSpeed raises for it too).
        cuda_aware: DeepSpeed's MPI switch; no effect here.
        comm_backend_name: DeepSpeed's backend choice; no effect here.
        coeff_beta: EMA coefficient of the recorded lamb coefficients.
        factor_max: upper bound of the compression-phase factor.
        factor_min: lower bound of the compression-phase factor.
        factor_threshold: the most the factor may change from one step to the next (relative).
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
        max_grad_norm: float = 0.0,
        max_coeff: float = 10.0,
        min_coeff: float = 0.01,
        amsgrad: bool = False,
        cuda_aware: bool = False,
        comm_backend_name: str = "nccl",
        coeff_beta: float = 0.9,
        factor_max: float = 4.0,
        factor_min: float = 0.5,
        factor_threshold: float = 0.1,
    ) -> None:
        if amsgrad:
            raise ValueError("OneBitLamb: amsgrad=True is not supported (DeepSpeed raises for it too).")
        if eps_inside_sqrt:
            raise ValueError(
                "OneBitLamb: eps_inside_sqrt=True is not supported; eps is added after the sqrt."
            )
        if max_grad_norm != 0.0:
            raise ValueError(
                f"OneBitLamb: max_grad_norm={max_grad_norm} has no effect in 1-bit Lamb (DeepSpeed ignores it); "
                "use the top-level gradient_clipping instead."
            )
        if int(freeze_step) != freeze_step or freeze_step < 1:
            raise ValueError(
                f"OneBitLamb: freeze_step must be an integer >= 1 (the warm-up records the lamb "
                f"coefficients), got {freeze_step!r}."
            )
        if not 0.0 <= min_coeff <= max_coeff:
            raise ValueError(f"OneBitLamb: need 0 <= min_coeff <= max_coeff, got {min_coeff}, {max_coeff}.")
        if not 0.0 < factor_min <= factor_max:
            raise ValueError(
                f"OneBitLamb: need 0 < factor_min <= factor_max, got {factor_min}, {factor_max}."
            )
        if not 0.0 <= coeff_beta < 1.0 or not 0.0 <= factor_threshold < 1.0:
            raise ValueError(
                f"OneBitLamb: coeff_beta and factor_threshold must lie in [0, 1), got {coeff_beta}, {factor_threshold}."
            )
        beta1, beta2 = betas
        if not (0.0 <= beta1 < 1.0 and 0.0 <= beta2 < 1.0):
            raise ValueError(f"OneBitLamb: betas must lie in [0, 1), got {tuple(betas)}.")
        defaults = {
            "lr": lr,
            "betas": (float(beta1), float(beta2)),
            "eps": eps,
            "weight_decay": weight_decay,
            "max_coeff": max_coeff,
            "min_coeff": min_coeff,
        }
        super().__init__(params, defaults)
        self.freeze_step = int(freeze_step)
        self.bias_correction = bias_correction
        self.cuda_aware = cuda_aware
        self.comm_backend_name = comm_backend_name
        self.coeff_beta = float(coeff_beta)
        self.factor_max = float(factor_max)
        self.factor_min = float(factor_min)
        self.factor_threshold = float(factor_threshold)
        self._exchange = OneBitExchange("OneBitLamb")

    # ------------------------------------------------------------------ GradientExchangingOptimizer
    def steps_taken(self) -> int:
        """Steps this optimizer has applied (restored with its state from a checkpoint)."""
        counts = [int(s["step"].item()) for s in self.state.values() if "step" in s]
        return max(counts, default=0)

    def attach_process_group(self, group: Group) -> None:
        """Exchange over ``group`` (None: the world) once the warm-up is over."""
        self._exchange.attach(group)

    @property
    def exchanges_gradients(self) -> bool:
        """True in the compression phase with more than one rank: gradients must stay local."""
        return self._exchange.world_size > 1 and self.steps_taken() >= self.freeze_step

    def rank_state_dict(self) -> dict[str, Any]:
        """This rank's compression error buffers (empty before the first compressed step)."""
        errors = self._exchange.state_dict()
        return {} if errors is None else {"exchange": errors}

    def load_rank_state_dict(self, state: dict[str, Any] | None) -> bool:
        """Restore :meth:`rank_state_dict`; parameters are untouched (False)."""
        self._exchange.load_state_dict((state or {}).get("exchange"))
        return False

    # ------------------------------------------------------------------ the step
    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> float | None:  # type: ignore[override]
        """One step: Lamb during warm-up, then frozen coefficients and compressed momentum.

        Collective in the compression phase: every rank of the attached group calls it.
        """
        loss = run_closure(closure)
        buckets = []
        for group in self.param_groups:
            for tensors in collect_group(self.state, group, ("exp_avg", "exp_avg_sq"), "OneBitLamb").values():
                buckets.append((group, tensors))
        if not buckets:
            return loss
        if self.steps_taken() < self.freeze_step:
            self._warm_up_step(buckets)
        else:
            self._compressed_step(buckets)
        for _, tensors in buckets:
            torch._foreach_add_(tensors.steps, 1.0)
        return loss

    def _warm_up_step(self, buckets: list[Any]) -> None:
        for group, t in buckets:
            lamb_group = {**group, "bias_correction": False, "eps_inside_sqrt": False}
            ratios = Lamb._update(
                lamb_group, 1, t.params, t.grads, t.moments["exp_avg"], t.moments["exp_avg_sq"], None
            )
            for params, ratio in ratios:
                for p, r in zip(params, ratio.unbind()):
                    state = self.state[p]
                    coeff = state.setdefault("lamb_coeff_freeze", torch.zeros((), device=r.device))
                    recorded = self.coeff_beta * coeff + (1.0 - self.coeff_beta) * r.float()
                    coeff.copy_(torch.where(r != 1.0, recorded, coeff))  # no host sync

    def _compressed_step(self, buckets: list[Any]) -> None:
        params = [p for _, t in buckets for p in t.params]
        momenta = [m for _, t in buckets for m in t.moments["exp_avg"]]
        if "scaling_coeff" not in self.state[params[0]]:
            self._set_scaling(params, momenta)
        previous = [m.clone() for m in momenta]
        scaling = [self.state[p]["scaling_coeff"].item() for p in params]
        for group, t in buckets:
            torch._foreach_lerp_(t.moments["exp_avg"], t.grads, 1.0 - group["betas"][0])
        torch._foreach_mul_(momenta, scaling)
        self._exchange.average(momenta)
        torch._foreach_div_(momenta, scaling)
        index = 0
        for group, t in buckets:
            for p, m in zip(t.params, t.moments["exp_avg"]):
                self._apply(group, p, m, previous[index])
                index += 1

    def _set_scaling(self, params: list[Tensor], momenta: list[Tensor]) -> None:
        """Fix each parameter's momentum scaling (to the mean magnitude) and the fresh variance."""
        scales = [float(torch.linalg.vector_norm(m)) / math.sqrt(m.numel()) for m in momenta]
        united = sum(scales) / len(scales)
        for p, scale in zip(params, scales):
            state = self.state[p]
            state["scaling_coeff"] = torch.tensor(united / scale if scale > 0.0 else 1.0, dtype=torch.float32)
            state["exp_avg_sq_fresh"] = state["exp_avg_sq"].clone()
            state.setdefault("last_factor", torch.ones((), dtype=torch.float32))
            state.setdefault("lamb_coeff_freeze", torch.zeros((), device=p.device))

    def _apply(self, group: dict[str, Any], p: Tensor, m: Tensor, previous: Tensor) -> None:
        """The compression-phase update of one parameter (DeepSpeed's order of operations)."""
        state = self.state[p]
        beta1, beta2 = group["betas"]
        eps, weight_decay = group["eps"], group["weight_decay"]
        fresh = state["exp_avg_sq_fresh"]
        implied = (m - previous * beta1) / (1.0 - beta1)
        fresh.mul_(beta2).addcmul_(implied, implied, value=1.0 - beta2)
        denom = state["exp_avg_sq"].sqrt() + eps
        prelim = m / denom
        update = prelim + weight_decay * p if weight_decay > 0.0 else prelim
        factor = float((denom / (fresh.sqrt() + eps)).max())
        if weight_decay > 0.0:
            share = min(1.0, float(torch.linalg.vector_norm(prelim) / torch.linalg.vector_norm(update)))
            factor = factor * share + (1.0 - share)
        factor = min(max(factor, self.factor_min), self.factor_max)
        last = float(state["last_factor"])
        factor = min(max(factor, last * (1.0 - self.factor_threshold)), last * (1.0 + self.factor_threshold))
        state["last_factor"].fill_(factor)
        coeff = float(state["lamb_coeff_freeze"]) * factor
        p.add_(update, alpha=-group["lr"] * coeff)
