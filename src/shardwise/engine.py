"""The training engine: orchestration only.

``initialize`` builds the parts (precision policy, ZeRO optimizer, scheduler, data
loader) and hands them to ``ShardwiseEngine``; the engine runs the loop with
DeepSpeed's names. It holds no ZeRO, loss-scaling or checkpoint-file logic: it asks the
part that owns each concern.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn

from shardwise.comm.topology import Topology
from shardwise.config.resolve import ResolvedConfig
from shardwise.monitor.master import MonitorMaster
from shardwise.precision.policy import PrecisionPolicy
from shardwise.profiling.telemetry import Telemetry, build_telemetry
from shardwise.profiling.timers import BACKWARD, BACKWARD_INNER, BACKWARD_REDUCE, STEP
from shardwise.zero.sharded_optimizer import StepResult, ZeroOptimizer


class ShardwiseEngine(nn.Module):
    """Runs forward, backward and optimizer steps the way DeepSpeed's engine does.

    Example:
        >>> # engine, optimizer, loader, scheduler = shardwise.initialize(model=m, config="ds.json")
        >>> # for x, y in loader:
        >>> #     loss = engine(x, y); engine.backward(loss); engine.step()
    """

    def __init__(
        self,
        module: nn.Module,
        config: ResolvedConfig,
        topology: Topology,
        precision: PrecisionPolicy,
        optimizer: ZeroOptimizer | None,
        lr_scheduler: Any,
        device: torch.device,
        collate_fn: Any = None,
        telemetry: Telemetry | None = None,
    ) -> None:
        super().__init__()
        self.module = module
        self._config = config
        self.topology = topology
        self.precision = precision
        self.optimizer = optimizer
        self.lr_scheduler = lr_scheduler
        self.device = device
        self.collate_fn = collate_fn
        self.global_steps = 0
        self.global_samples = 0
        self.micro_steps = 0
        self.skipped_steps = 0
        self._boundary_override: bool | None = None
        self._in_no_sync = False
        self._last_step: StepResult | None = None
        self._step_applied = False
        self.training_dataloader: Any = None
        # timers, progress lines, monitors, flops profiler: built by initialize (or here from the config)
        self.telemetry = telemetry or build_telemetry(
            config,
            module,
            device,
            topology.world_rank,
            topology.world_size,
            dp_size=topology.dp_size,
            mp_size=topology.mp_size,
            precision=precision,
        )
        self.telemetry.on_start(module, optimizer)

    # ------------------------------------------------------------------ config accessors
    @property
    def config(self) -> ResolvedConfig:
        """The resolved config: sections under ``engine.config.config`` (``.zero_optimization.stage``...),
        the batch triple as ``engine.config.batch``."""
        return self._config

    def train_batch_size(self) -> int:
        """Samples per optimizer step over all data-parallel ranks."""
        return self._config.batch.train_batch_size

    def train_micro_batch_size_per_gpu(self) -> int:
        """Samples per rank per forward."""
        return self._config.batch.micro_batch_per_gpu

    def gradient_accumulation_steps(self) -> int:
        """Micro batches per optimizer step."""
        return self._config.batch.gradient_accumulation_steps

    def get_batch_info(self) -> tuple[int, int, int]:
        """``(train_batch_size, micro_batch, accumulation_steps)``."""
        return (
            self.train_batch_size(),
            self.train_micro_batch_size_per_gpu(),
            self.gradient_accumulation_steps(),
        )

    def zero_optimization_stage(self) -> int:
        """The ZeRO stage, 0-3."""
        return self._config.config.zero_stage

    @property
    def dp_world_size(self) -> int:
        """Data-parallel ranks."""
        return self.topology.dp_size

    @property
    def world_size(self) -> int:
        """All ranks."""
        return self.topology.world_size

    @property
    def global_rank(self) -> int:
        """This process's rank."""
        return self.topology.world_rank

    @property
    def loss_scale(self) -> float:
        """Current loss scale (1.0 without fp16)."""
        return self.precision.loss_scaler.loss_scale

    # ------------------------------------------------------------------ forward / backward
    def forward(self, *args: Any, **kwargs: Any) -> Any:
        """Call the wrapped module (inputs cast under ``fp16.auto_cast``, autocast if configured)."""
        args, kwargs = self.precision.cast_forward_inputs(args, kwargs)
        timed = self.telemetry.forward(self.global_steps, self.module.training)
        with timed, self.precision.forward_context(self.device.type):
            return self.module(*args, **kwargs)

    def _require_optimizer(self, what: str) -> ZeroOptimizer:
        if self.optimizer is None:
            raise RuntimeError(
                f'engine.{what}() needs an optimizer: add an "optimizer" section to the config or pass '
                "optimizer=... to shardwise.initialize"
            )
        return self.optimizer

    def is_gradient_accumulation_boundary(self) -> bool:
        """True when the next ``step()`` applies the optimizer."""
        if self._boundary_override is not None:
            return self._boundary_override
        return (self.micro_steps + 1) % self.gradient_accumulation_steps() == 0

    def set_gradient_accumulation_boundary(self, is_boundary: bool | None) -> None:
        """Force (or, with None, stop forcing) the boundary; sticky like DeepSpeed's."""
        self._boundary_override = is_boundary

    def scale(self, loss: torch.Tensor) -> torch.Tensor:
        """``loss * loss_scale`` for a manual ``.backward()``."""
        return self.precision.loss_scaler.scale_loss(loss)

    def backward(
        self, loss: torch.Tensor, retain_graph: bool = False, scale_wrt_gas: bool = True
    ) -> torch.Tensor:
        """Backward of ``loss / gradient_accumulation_steps`` (times the loss scale); returns ``loss / GAS``."""
        optimizer = self._require_optimizer("backward")
        if loss.dim() != 0:
            raise ValueError(
                f"engine.backward expects a scalar loss, got shape {tuple(loss.shape)}; reduce it first"
            )
        if scale_wrt_gas and self.gradient_accumulation_steps() > 1:
            loss = loss / self.gradient_accumulation_steps()
        optimizer.prepare_backward(self.is_gradient_accumulation_boundary())
        telemetry = self.telemetry
        with telemetry.phase(BACKWARD):
            with telemetry.phase(BACKWARD_INNER):
                self.scale(loss.float()).backward(retain_graph=retain_graph)
            with telemetry.phase(BACKWARD_REDUCE):
                optimizer.after_backward()
        telemetry.record_loss(loss)
        return loss.detach()

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Accumulate gradients locally without reducing them (stages 0 and 1)."""
        optimizer = self._require_optimizer("no_sync")
        if self.zero_optimization_stage() >= 2:
            raise RuntimeError(
                f"no_sync() is not possible at ZeRO stage {self.zero_optimization_stage()}: gradients are "
                "sharded and must be reduce-scattered every micro step; use gradient_accumulation_steps instead"
            )
        if self._in_no_sync:
            raise RuntimeError("no_sync() contexts cannot be nested")
        self._in_no_sync = True
        optimizer.reducer.sync_enabled = False
        try:
            yield
        finally:
            optimizer.reducer.sync_enabled = True
            self._in_no_sync = False

    # ------------------------------------------------------------------ the step
    def step(self, lr_kwargs: dict[str, Any] | None = None) -> None:
        """Call after every micro batch; at the accumulation boundary it updates the model."""
        optimizer = self._require_optimizer("step")
        if self._in_no_sync:
            raise RuntimeError(
                "engine.step() inside no_sync(): leave the context and run a final backward first"
            )
        self._step_applied = False
        boundary = self.is_gradient_accumulation_boundary()
        with self.telemetry.phase(STEP):
            if boundary:
                result = optimizer.step(loss_scale=self.loss_scale)
                self.precision.loss_scaler.update_scale(result.overflow)
                self._last_step = result
                if result.applied:
                    self._step_applied = True
                    if self.lr_scheduler is not None:
                        self._step_scheduler(lr_kwargs)
                else:
                    self.skipped_steps += 1
                self.global_steps += 1
                self.global_samples += self.train_batch_size()
        self.telemetry.after_step(boundary)
        if boundary:
            self._report_progress()
        self.micro_steps += 1

    def _step_scheduler(self, lr_kwargs: dict[str, Any] | None) -> None:
        try:
            self.lr_scheduler.step(**(lr_kwargs or {}))
        except TypeError:
            # Megatron-style schedulers take the batch size as the increment
            self.lr_scheduler.step(self.train_batch_size())

    def _report_progress(self) -> None:
        """Progress line, timers and monitor events of the step that just ended (every rank)."""
        self.telemetry.on_boundary(
            step=self.global_steps,
            samples=self.global_samples,
            lr=self.get_lr(),
            grad_norm=self.get_global_grad_norm(),
            applied=self._step_applied,
            loss_scale=self.loss_scale,
            skipped=self.skipped_steps,
        )

    def destroy(self) -> None:
        """Release what the engine holds outside Python objects (DeepSpeed's ``destroy``):
        waits for an asynchronous checkpoint save, deletes offload swap files, closes monitors.
        The engine is not usable for training afterwards."""
        from shardwise.checkpoint.engine_io import wait_for_checkpoint

        wait_for_checkpoint(self)
        close = getattr(self.optimizer, "close", None)
        if callable(close):
            close()
        self.telemetry.monitor.close()

    @property
    def monitor(self) -> MonitorMaster:
        """The monitors (``engine.monitor.write_events([(name, value, engine.global_samples)])``)."""
        return self.telemetry.monitor

    def get_wall_clock_timers(self) -> dict[str, float]:
        """Last micro step's and window's phase times in ms (empty without ``wall_clock_breakdown``)."""
        return self.telemetry.wall_clock_timers()

    def was_step_applied(self) -> bool:
        """Whether the last ``step()`` updated the parameters."""
        return self._step_applied

    def get_global_grad_norm(self) -> float | None:
        """Gradient norm of the last step, unscaled and before clipping (inf after an overflow)."""
        return None if self._last_step is None else self._last_step.grad_norm

    def get_global_grad_norm_post_clip(self) -> float | None:
        """Gradient norm of the last applied step after clipping (None after a skipped step)."""
        stats = self.telemetry.last_stats
        return None if stats is None else stats.grad_norm_post_clip

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Clear gradients (the engine already does after each optimizer step).

        ZeRO's gradient buffers are always zeroed in place, whatever ``set_to_none`` says.
        """
        if self.optimizer is not None:
            self.optimizer.zero_grad()

    def get_lr(self) -> list[float]:
        """Learning rate per param group."""
        return [] if self.optimizer is None else [g["lr"] for g in self.optimizer.param_groups]

    def get_mom(self) -> list[Any]:
        """Momentum (SGD/RMSprop) or betas per param group."""
        if self.optimizer is None:
            return []
        key = "momentum" if type(self.optimizer.optimizer).__name__ in ("SGD", "RMSprop") else "betas"
        return [g.get(key) for g in self.optimizer.param_groups]

    # ------------------------------------------------------------------ batch size changes
    def set_train_batch_size(self, train_batch_size: int) -> None:
        """Change the global batch by changing the accumulation steps (micro batch fixed)."""
        per_step = self.train_micro_batch_size_per_gpu() * self.dp_world_size
        if train_batch_size % per_step:
            raise ValueError(
                f"train_batch_size {train_batch_size} must be a multiple of micro batch x data-parallel size = {per_step}"
            )
        self._set_batch(train_batch_size, self.train_micro_batch_size_per_gpu(), train_batch_size // per_step)

    def set_train_micro_batch_size(self, micro_batch_size: int) -> None:
        """Change the micro batch; the accumulation steps stay."""
        gas = self.gradient_accumulation_steps()
        self._set_batch(micro_batch_size * gas * self.dp_world_size, micro_batch_size, gas)

    def _set_batch(self, tbs: int, mbs: int, gas: int) -> None:
        """The new batch triple, stored once in the config (the getters and checkpoints read it there)."""
        self._config.set_batch(tbs, mbs, gas)

    # ------------------------------------------------------------------ data
    def deepspeed_io(
        self,
        dataset: Any,
        batch_size: int | None = None,
        route: str = "train",
        pin_memory: bool = False,
        data_sampler: Any = None,
        collate_fn: Any = None,
        num_local_io_workers: int | None = None,
    ) -> Any:
        """A distributed data loader over ``dataset`` with the micro batch size."""
        from shardwise.data import build_data_loader

        return build_data_loader(
            dataset,
            batch_size=batch_size or self.train_micro_batch_size_per_gpu(),
            dp_rank=self.topology.dp_rank,
            dp_world_size=self.dp_world_size,
            drop_last=self._config.config.dataloader_drop_last,
            collate_fn=collate_fn or self.collate_fn,
            num_workers=num_local_io_workers or 0,
            pin_memory=pin_memory and self.device.type == "cuda",
            data_sampler=data_sampler,
            route=route,
        )

    # ------------------------------------------------------------------ module access
    def module_state_dict(self, exclude_frozen_parameters: bool = False) -> dict[str, Any]:
        """The wrapped module's state dict."""
        state = self.module.state_dict()
        if exclude_frozen_parameters:
            frozen = {n for n, p in self.module.named_parameters() if not p.requires_grad}
            state = {k: v for k, v in state.items() if k not in frozen}
        return state

    # ------------------------------------------------------------------ checkpoints (logic in checkpoint/)
    def save_checkpoint(
        self,
        save_dir: str,
        tag: str | None = None,
        client_state: dict[str, Any] | None = None,
        save_latest: bool = True,
        exclude_frozen_parameters: bool = False,
    ) -> bool:
        """Save a topology-free checkpoint under ``save_dir/tag`` (every rank must call it)."""
        from shardwise.checkpoint.engine_io import save_checkpoint

        return save_checkpoint(self, save_dir, tag, client_state, save_latest, exclude_frozen_parameters)

    def load_checkpoint(
        self,
        load_dir: str,
        tag: str | None = None,
        load_module_strict: bool = True,
        load_optimizer_states: bool = True,
        load_lr_scheduler_states: bool = True,
        load_module_only: bool = False,
        custom_load_fn: Any = None,
    ) -> tuple[str | None, dict[str, Any] | None]:
        """Load a checkpoint saved on any world size and stage; returns ``(path, client_state)``."""
        from shardwise.checkpoint.engine_io import load_checkpoint

        return load_checkpoint(
            self,
            load_dir,
            tag,
            load_module_strict,
            load_optimizer_states,
            load_lr_scheduler_states,
            load_module_only,
            custom_load_fn,
        )

    def save_16bit_model(
        self, save_dir: str, save_filename: str = "pytorch_model.bin", exclude_frozen_parameters: bool = False
    ) -> bool:
        """Rank 0 writes the module's 16-bit (or fp32) state dict to ``save_dir/save_filename``."""
        from shardwise.checkpoint.engine_io import save_16bit_model

        return save_16bit_model(self, save_dir, save_filename, exclude_frozen_parameters)

    save_fp16_model = save_16bit_model

    def wait_for_checkpoint(self) -> None:
        """Block until an asynchronous save has finished writing (re-raising its error)."""
        from shardwise.checkpoint.engine_io import wait_for_checkpoint

        wait_for_checkpoint(self)

    def __getattr__(self, name: str) -> Any:
        try:
            return super().__getattr__(name)
        except AttributeError:
            module = self._modules.get("module")
            if module is not None and hasattr(module, name):
                return getattr(module, name)
            raise
