"""Inside an autotuning experiment: measure, write the numbers, end the run (spec 3.11).

The autotuner writes each experiment's config with an ``autotuning`` block; the engine then
carries one :class:`AutotuningHook` (a :class:`~shardwise.runtime.step_hooks.StepHook`, built
by :func:`build_autotuning_hook`):

- **metric mode** (``enabled`` and ``metric_path``): the wall time from the end of optimizer
  step ``start_profile_step`` to the end of step ``end_profile_step`` gives ``latency`` (ms per
  step), ``throughput`` (samples per second, all ranks) and, with ``metric: "flops"``,
  ``FLOPS_per_gpu`` (the flops profiler's forward count x 3 for forward and backward over the
  window). Rank 0 writes them as JSON to ``metric_path``; every rank then exits with status 0.
- **profile mode** (``model_info.profile`` and ``model_info_path``): after the first
  optimizer step rank 0 writes ``num_params``, ``trainable_num_params`` and the activation
  bytes the first training forward saved for backward (``activation_mem_per_gpu`` for the
  micro batch, ``activation_mem_per_sample``); every rank then exits.

Example:
    >>> from shardwise.config import load_config
    >>> cfg = load_config({"train_batch_size": 2}).config
    >>> build_autotuning_hook(cfg.autotuning, None, rank=0, micro_batch=1) is None  # no autotuning block: no hook
    True
"""

from __future__ import annotations

import json
import os
import sys
import time
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from torch import nn

    from shardwise.config.sections.features import AutotuningConfig
    from shardwise.runtime.step_hooks import ForwardContext, StepOutcome

__all__ = ["AutotuningHook", "build_autotuning_hook", "write_json_atomically"]

FWD_BWD_FLOPS_FACTOR = 3.0
"""Backward costs about twice the forward: fwd+bwd FLOPs = 3 x the profiler's forward count."""


def write_json_atomically(path: str, data: Mapping[str, object]) -> None:
    """Write ``data`` as JSON to ``path`` through a temporary file and a rename."""
    folder = os.path.dirname(os.path.abspath(path))
    os.makedirs(folder, exist_ok=True)
    tmp = f"{path}.tmp{os.getpid()}"
    with open(tmp, "w", encoding="utf-8") as handle:
        json.dump(dict(data), handle, indent=2)
    os.replace(tmp, path)


def _synchronize(model: Any) -> None:
    import torch

    if torch.cuda.is_available() and any(p.is_cuda for p in model.parameters()):
        torch.cuda.synchronize()


class _SavedActivations:
    """Counts the bytes autograd saves for backward during one forward (parameters excluded)."""

    def __init__(self, model: nn.Module) -> None:
        import torch

        self.model = model
        self.bytes = 0
        self.done = False
        self._seen: set[int] = set()
        self._params: set[int] = set()
        self._context: Any = None
        self._torch = torch
        self._handles = [
            model.register_forward_pre_hook(self._enter),
            model.register_forward_hook(self._exit),
        ]

    def _pack(self, tensor: Any) -> object:
        storage = tensor.untyped_storage()
        key = storage.data_ptr()
        if key not in self._params and key not in self._seen:
            self._seen.add(key)
            self.bytes += storage.nbytes()
        return tensor

    def _enter(self, module: Any, args: Any) -> None:
        if self.done or not module.training or self._context is not None:
            return
        self._params = {p.untyped_storage().data_ptr() for p in self.model.parameters()}
        self._context = self._torch.autograd.graph.saved_tensors_hooks(self._pack, lambda t: t)
        self._context.__enter__()

    def _exit(self, module: object, args: object, output: object) -> None:
        if self._context is None:
            return
        self._context.__exit__(None, None, None)
        self._context = None
        self.done = True
        for handle in self._handles:
            handle.remove()


class AutotuningHook:
    """Measures an experiment (metric mode) or the model (profile mode); see the module docstring.

    Args:
        settings: the ``autotuning`` config section.
        model: the module the engine trains.
        rank: global rank (rank 0 writes the file).
        micro_batch: ``train_micro_batch_size_per_gpu``.
        exit_run: called after the file is written (default ``sys.exit(0)``).
    """

    name = "autotuning"

    def __init__(
        self,
        settings: AutotuningConfig,
        model: nn.Module,
        rank: int,
        micro_batch: int,
        exit_run: Callable[[], None] | None = None,
    ) -> None:
        self.settings = settings
        self.model = model
        self.rank = rank
        self.micro_batch = micro_batch
        self.exit_run = exit_run or (lambda: sys.exit(0))
        self.profile_mode = bool(settings.model_info.profile and settings.model_info_path)
        self._activations = _SavedActivations(model) if self.profile_mode else None
        self._start: tuple[float, int] | None = None
        self._flops: Any = None

    def adjust_forward(
        self, args: tuple[object, ...], kwargs: dict[str, object], context: ForwardContext
    ) -> tuple[tuple[object, ...], dict[str, object]]:
        """The arguments pass unchanged."""
        return args, kwargs

    def after_optimizer_step(self, outcome: StepOutcome) -> None:
        """Start the window at ``start_profile_step``; write and exit at ``end_profile_step``."""
        if self.profile_mode:
            self._write_model_info()
            return
        start, end = self.settings.start_profile_step, self.settings.end_profile_step
        if outcome.global_step == start:
            _synchronize(self.model)
            self._start = (time.perf_counter(), outcome.global_samples)
            if self.settings.metric == "flops":
                from shardwise.profiling.flops_profiler import FlopsProfiler

                self._flops = FlopsProfiler(self.model)
                self._flops.start_profile()
        if outcome.global_step >= end and self._start is not None:
            _synchronize(self.model)
            self._write_metrics(outcome, time.perf_counter())

    def _write_metrics(self, outcome: StepOutcome, now: float) -> None:
        assert self._start is not None
        began, samples = self._start
        steps = outcome.global_step - self.settings.start_profile_step
        seconds = max(now - began, 1e-9)
        metrics: dict[str, Any] = {
            "latency": 1000.0 * seconds / steps,
            "throughput": (outcome.global_samples - samples) / seconds,
            "FLOPS_per_gpu": None,
            "steps": steps,
            "seconds": seconds,
        }
        if self._flops is not None:
            self._flops.stop_profile()
            metrics["FLOPS_per_gpu"] = FWD_BWD_FLOPS_FACTOR * float(self._flops.get_total_flops()) / seconds
            self._flops.end_profile()
        if self.rank == 0:
            assert self.settings.metric_path, "metric mode: build_autotuning_hook checked the path"
            write_json_atomically(self.settings.metric_path, metrics)
        self.exit_run()

    def _write_model_info(self) -> None:
        assert self._activations is not None
        params = list(self.model.parameters())
        per_batch = self._activations.bytes
        info = {
            "num_params": sum(p.numel() for p in params),
            "trainable_num_params": sum(p.numel() for p in params if p.requires_grad),
            "activation_mem_per_gpu": per_batch,
            "activation_mem_per_sample": per_batch / max(self.micro_batch, 1),
            "micro_batch": self.micro_batch,
        }
        if self.rank == 0:
            assert self.settings.model_info_path, "profile mode: build_autotuning_hook checked the path"
            write_json_atomically(self.settings.model_info_path, info)
        self.exit_run()

    def state_dict(self) -> dict[str, object]:
        """Nothing to keep: an experiment does not checkpoint."""
        return {}

    def load_state_dict(self, state: Mapping[str, object]) -> None:
        """Nothing to restore."""


def build_autotuning_hook(
    settings: AutotuningConfig, model: Any, *, rank: int, micro_batch: int
) -> AutotuningHook | None:
    """The hook when the config makes this run an experiment (``autotuning.enabled`` with
    ``metric_path``, or ``model_info.profile`` with ``model_info_path``), else None."""
    if not settings.enabled:
        return None
    if not settings.metric_path and not (settings.model_info.profile and settings.model_info_path):
        return None
    return AutotuningHook(settings, model, rank, micro_batch)
