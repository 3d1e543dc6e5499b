"""The training engine: orchestration only.

``initialize`` builds the parts (precision policy, ZeRO strategy, scheduler, telemetry,
step hooks, checkpointer, data loader) and hands them to ``ShardwiseEngine``; the engine
runs the loop with DeepSpeed's names. It holds no ZeRO, loss-scaling or checkpoint-file
logic: it asks the part that owns each concern. The ZeRO stage is reached only through
:class:`~shardwise.zero.strategy.ZeroStrategy` (no stage checks here), features acting on
the step through :class:`~shardwise.runtime.step_hooks.StepHooks`, and the counters live
in one :class:`~shardwise.runtime.counters.EngineCounters`.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Mapping
from typing import Any

import torch
from torch import nn

from shardwise.checkpoint import deepspeed_moe, engine_io, folding_metadata, snapshot_io
from shardwise.checkpoint.checkpointer import Checkpointer
from shardwise.comm.topology import Topology
from shardwise.compilation.compiler import ModelCompiler
from shardwise.config.resolve import ResolvedConfig
from shardwise.monitor.master import MonitorMaster
from shardwise.precision.policy import PrecisionPolicy
from shardwise.profiling.telemetry import Telemetry
from shardwise.profiling.timers import BACKWARD, BACKWARD_INNER, BACKWARD_REDUCE, STEP
from shardwise.runtime.accumulation_window import AccumulationWindow
from shardwise.runtime.counters import CounterAttribute, EngineCounters
from shardwise.runtime.direct_backward import DirectBackward
from shardwise.runtime.ds_accessors import DeepSpeedAccessors
from shardwise.runtime.ds_config_accessors import DeepSpeedConfigAccessors
from shardwise.runtime.ds_engine_actions import DeepSpeedEngineActions
from shardwise.runtime.nonfinite import NonFiniteSteps, scaler_adapts
from shardwise.runtime.step_hooks import ForwardContext, StepHooks, StepOutcome
from shardwise.utils.logging import logger
from shardwise.zero.strategy import GradientSyncRefused, StepResult, ZeroStrategy


class ShardwiseEngine(DeepSpeedEngineActions, DeepSpeedAccessors, DeepSpeedConfigAccessors, nn.Module):
    """Runs forward, backward and optimizer steps the way DeepSpeed's engine does.

    Example:
        >>> # engine, optimizer, loader, scheduler = shardwise.initialize(model=m, config="ds.json")
        >>> # for x, y in loader:
        >>> #     loss = engine(x, y); engine.backward(loss); engine.step()
    """

    global_steps = CounterAttribute()  # DeepSpeed's counter names, kept in ``self.counters``
    global_samples = CounterAttribute()
    micro_steps = CounterAttribute()
    skipped_steps = CounterAttribute()

    def __init__(
        self,
        module: nn.Module,
        config: ResolvedConfig,
        topology: Topology,
        precision: PrecisionPolicy,
        optimizer: ZeroStrategy | None,
        lr_scheduler: Any,
        device: torch.device,
        collate_fn: Any = None,
        *,
        telemetry: Telemetry,
        step_hooks: StepHooks,
        checkpointer: Checkpointer,
        snapshots: snapshot_io.Snapshots | None = None,
        compiler: ModelCompiler,
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
        self.counters = EngineCounters()
        self._nonfinite = NonFiniteSteps(config.config.max_consecutive_nonfinite_steps)
        self.step_hooks = step_hooks  # every part is built by initialize and injected
        self.checkpointer = checkpointer
        self.snapshots = snapshots  # periodic snapshots (checkpoint.snapshot_interval), or None
        self.compiler = compiler  # engine.compile(): torch.compile per block (shardwise.compilation)
        self.window = AccumulationWindow(managed=config.config.managed_gradient_accumulation)
        self._in_no_sync = False
        self._backward_pending = False  # a backward ran since the last step()
        self._window_micro_batches = 0  # micro batches stepped since the last optimizer step
        self._last_step: StepResult | None = None
        self._step_applied = False
        self.training_dataloader: Any = None
        self.telemetry = telemetry  # timers, progress lines, monitors, flops profiler
        self.telemetry.on_start(module, optimizer)
        # loss.backward() on engine(x)'s outputs: the same micro step as engine.backward(loss)
        self.direct_backward = DirectBackward(
            begin=self._begin_direct_backward,
            end=self._end_direct_backward,
            accumulation_steps=self.gradient_accumulation_steps,
            loss_must_be_scaled=precision.loss_scaler.multiplies,
        )

    # ------------------------------------------------------------------ forward / backward
    def forward(self, *args: object, **kwargs: object) -> Any:
        """Call the wrapped module: step hooks adjust the arguments, then inputs are cast under
        ``fp16.auto_cast`` and autocast applies if configured."""
        self.compiler.before_forward()
        training = self.module.training
        context = ForwardContext(global_step=self.global_steps, training=training)
        args, kwargs = self.step_hooks.adjust_forward(args, kwargs, context)
        args, kwargs = self.precision.cast_forward_inputs(args, kwargs)
        with self.telemetry.forward(training), self.precision.forward_context(self.device.type):
            outputs = self.module(*args, **kwargs)
        if self.optimizer is not None:
            self.direct_backward.watch(outputs)
        return outputs

    def _require_optimizer(self, what: str) -> ZeroStrategy:
        if self.optimizer is None:
            raise RuntimeError(
                f'engine.{what}() needs an optimizer: add an "optimizer" section to the config or pass '
                "optimizer=... to shardwise.initialize"
            )
        return self.optimizer

    def is_gradient_accumulation_boundary(self) -> bool:
        """True when the next ``step()`` applies the optimizer (unmanaged accumulation: only while
        ``step()`` runs; see :mod:`shardwise.runtime.accumulation_window`)."""
        return self.window.is_boundary(self.micro_steps, self.gradient_accumulation_steps())

    def set_gradient_accumulation_boundary(self, is_boundary: bool | None) -> None:
        """Force (or, with None, stop forcing) the boundary; sticky like DeepSpeed's. Refused with
        ``managed_gradient_accumulation: false``."""
        self.window.force(is_boundary)

    def scale(self, loss: torch.Tensor) -> torch.Tensor:
        """``loss * loss_scale`` for a manual ``engine.scale(loss).backward()`` on the engine's output,
        which then runs as ``engine.backward(loss)`` would (:mod:`shardwise.runtime.direct_backward`)."""
        self.direct_backward.expect_scaled_loss()
        return self.precision.loss_scaler.scale_loss(loss)

    def _count_backward(self) -> None:
        self._backward_pending = True
        self.window.count_backward()

    def _begin_direct_backward(self) -> None:
        self._require_optimizer("backward").prepare_backward(self.is_gradient_accumulation_boundary())

    def _end_direct_backward(self) -> None:
        self._require_optimizer("backward").after_backward()
        self._count_backward()

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
        self._count_backward()
        with telemetry.phase(BACKWARD):
            with telemetry.phase(BACKWARD_INNER), self.direct_backward.engine_backward():
                self.precision.loss_scaler.scale_loss(loss.float()).backward(retain_graph=retain_graph)
            with telemetry.phase(BACKWARD_REDUCE):
                optimizer.after_backward()
        telemetry.record_loss(loss)
        return loss.detach()

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Accumulate gradients locally without reducing them, where the ZeRO strategy declares it can."""
        optimizer = self._require_optimizer("no_sync")
        if not optimizer.gradient_sync_toggle:
            raise GradientSyncRefused(optimizer.gradient_sync_refusal)
        if self._in_no_sync:
            raise GradientSyncRefused("no_sync() contexts cannot be nested")
        self._in_no_sync = True
        optimizer.set_gradient_sync(False)
        try:
            yield
        finally:
            optimizer.set_gradient_sync(True)
            self._in_no_sync = False

    # ------------------------------------------------------------------ the step
    def step(self, lr_kwargs: Mapping[str, object] | None = None) -> None:
        """Call after every micro batch's backward; at the accumulation boundary it updates the model
        (a non-finite gradient norm skips the update, counted in ``skipped_steps``), then calls the
        step hooks. With ``managed_gradient_accumulation: false`` every call is the boundary, after
        any number of backwards (:mod:`shardwise.runtime.accumulation_window`).

        A ``step()`` with no ``backward()`` since the previous ``step()`` (e.g. a second call after
        one backward) is ignored with a warning: no counter moves and the optimizer does not step.
        DeepSpeed counts such calls; ignoring them keeps ``global_steps`` and the accumulation
        window true to the batches trained, and, unlike an error, cannot stop a long run.
        """
        optimizer = self._require_optimizer("step")
        if self._in_no_sync:
            raise RuntimeError(
                "engine.step() inside no_sync(): leave the context and run a final backward first"
            )
        if not self._backward_pending:
            logger.warning(
                "engine.step() with no engine.backward() since the previous step() was ignored (global step "
                "%d): call engine.backward(loss) once before each engine.step()",
                self.global_steps,
            )
            return
        self._backward_pending = False
        self._step_applied = False
        result = None
        with self.window.stepping():
            boundary = self.is_gradient_accumulation_boundary()
            with self.telemetry.phase(STEP):
                if boundary and not self.window.managed:
                    optimizer.end_window()
                if boundary:
                    result = self._optimizer_step(optimizer, lr_kwargs)
        self.telemetry.after_step(boundary)
        if boundary:
            self._report_progress()
        self.counters.micro_steps += 1
        self._window_micro_batches = 0 if boundary else self._window_micro_batches + 1
        if result is not None:
            self._after_optimizer_step(result)

    def _after_optimizer_step(self, result: StepResult) -> None:
        """The end of an optimizer step, once the counters moved: the step hooks, then a snapshot
        when one is due (``train_batch`` of the pipeline engine ends its steps here too)."""
        outcome = StepOutcome(self.global_steps, self.global_samples, result.applied, result.grad_norm)
        self.step_hooks.after_optimizer_step(outcome)
        if self.snapshots is not None:
            snapshot_io.after_optimizer_step(self)

    def _optimizer_step(self, optimizer: ZeroStrategy, lr_kwargs: Mapping[str, object] | None) -> StepResult:
        result = optimizer.step(loss_scale=self.loss_scale)
        scaler = self.precision.loss_scaler
        adapts = result.overflow and scaler_adapts(scaler)  # before the scaler moves
        scaler.update_scale(result.overflow)
        self._last_step = result
        counters = self.counters
        if result.applied:
            self._step_applied = True
            if self.lr_scheduler is not None:
                self._step_scheduler(lr_kwargs)
        else:
            counters.skipped_steps += 1
        counters.global_steps += 1
        counters.global_samples += self.window.samples(self.train_batch_size(), self.gradient_accumulation_steps())
        self._nonfinite.record(step=counters.global_steps, applied=result.applied, scaler_adapts=adapts)
        return result

    def _step_scheduler(self, lr_kwargs: Mapping[str, object] | None) -> None:
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
        self.checkpointer.wait()
        if self.optimizer is not None:
            self.optimizer.close()
        self.telemetry.monitor.close()

    @property
    def monitor(self) -> MonitorMaster:
        """The monitors (``engine.monitor.write_events([(name, value, engine.global_samples)])``)."""
        return self.telemetry.monitor

    def get_wall_clock_timers(self) -> dict[str, float]:
        """Last micro step's and window's phase times in ms (empty without ``wall_clock_breakdown``)."""
        return self.telemetry.wall_clock_timers()

    @property
    def pending_micro_batches(self) -> int:
        """Micro batches whose gradients are accumulated but not yet applied by an optimizer step."""
        return self._window_micro_batches + int(self._backward_pending)

    def was_step_applied(self) -> bool:
        """Whether the last ``step()`` updated the parameters."""
        return self._step_applied

    def get_global_grad_norm(self) -> float | None:
        """Gradient norm of the last step, unscaled and before clipping (inf after a skipped step)."""
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
        """Betas (Adam-like groups) or momentum (SGD, RMSprop, Muon's matrices) per param group.

        Read from each group, not from the optimizer's class name, which an offload wrapper hides."""
        if self.optimizer is None:
            return []
        return [g["betas"] if "betas" in g else g.get("momentum") for g in self.optimizer.param_groups]

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
        """A distributed data loader over ``dataset`` with the micro batch size.

        With ``data_efficiency.data_sampling.curriculum_learning`` enabled, the training route
        draws through the curriculum sampler (and takes ``num_workers``/``pin_memory`` from
        ``data_sampling`` unless given here).
        """
        from shardwise.data import build_data_loader
        from shardwise.data_efficiency.sampler_factory import train_loader_options

        if route == "train":
            data_sampler, num_local_io_workers, pin_memory = train_loader_options(
                self._config.config,
                num_samples=len(dataset),
                micro_batch_size=batch_size or self.train_micro_batch_size_per_gpu(),
                dp_rank=self.topology.dp_rank,
                dp_size=self.dp_world_size,
                gradient_accumulation_steps=self.gradient_accumulation_steps(),
                data_sampler=data_sampler,
                num_workers=num_local_io_workers,
                pin_memory=pin_memory,
            )
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

    def set_custom_curriculum_learning_schedule(self, schedule: Any) -> None:
        """Give ``schedule_type: "custom"`` curricula their functions: ``fn(step) -> difficulty``
        for the legacy ``curriculum_learning`` section, or ``{metric: fn}`` for the data-sampling
        metrics (the training loader's sampler)."""
        from shardwise.data_efficiency.custom_schedule import set_custom_schedule

        set_custom_schedule(self.step_hooks, self.training_dataloader, schedule)

    def get_pld_theta(self) -> float | None:
        """The progressive-layer-drop keep probability the next training forward receives
        (None when ``progressive_layer_drop`` is off)."""
        hook = self.step_hooks.named("progressive_layer_drop")
        return None if hook is None else float(hook.theta)  # type: ignore[attr-defined]

    # ------------------------------------------------------------------ module access
    def module_state_dict(self, exclude_frozen_parameters: bool = False) -> dict[str, Any]:
        """The wrapped module's state dict."""
        state = self.module.state_dict()
        if exclude_frozen_parameters:
            frozen = {n for n, p in self.module.named_parameters() if not p.requires_grad}
            state = {k: v for k, v in state.items() if k not in frozen}
        return state

    # ------------------------------------------------------------------ compile: shardwise.compilation
    def compile(
        self,
        backend: Any = "inductor",
        compile_kwargs: Mapping[str, Any] | None = None,
        schedule: object = None,
        compiled_autograd_enabled: bool = False,
    ) -> None:
        """``torch.compile`` each transformer block of the module (the unit stage 3 shards), or the
        whole module's forward when it has no repeated block (DeepSpeed's ``engine.compile``)."""
        self.compiler.compile(self.module, backend, compile_kwargs, schedule, compiled_autograd_enabled)

    @property
    def is_compiled(self) -> bool:
        """Whether :meth:`compile` ran."""
        return self.compiler.is_compiled

    # ------------------------------------------------------------------ checkpoints: checkpoint/engine_io's functions
    save_checkpoint = engine_io.save_checkpoint
    load_checkpoint = snapshot_io.load_checkpoint  # engine_io's, choosing among the snapshots too
    save_16bit_model = engine_io.save_16bit_model
    save_fp16_model = engine_io.save_16bit_model
    wait_for_checkpoint = engine_io.wait_for_checkpoint
    zero_gather_16bit_weights_on_model_save = engine_io.gather_16bit_weights_on_model_save
    _zero3_consolidated_16bit_state_dict = engine_io.consolidated_16bit_state_dict
    _consolidated_16bit_state_dict = engine_io.consolidated_16bit_state_dict  # accelerate's name under AutoTP
    load_module_state_dict = engine_io.load_module_state_dict
    # DeepSpeed's MoE file layout, static as on DeepSpeedEngine (scripts call them on the class)
    _get_expert_ckpt_name = staticmethod(deepspeed_moe.expert_ckpt_name)
    load_moe_state_dict = staticmethod(deepspeed_moe.load_moe_state_dict)
    _validate_autoep_folding_checkpoint_metadata = staticmethod(folding_metadata.validate_runtime_folding)

    def __getattr__(self, name: str) -> Any:
        try:
            return super().__getattr__(name)
        except AttributeError:
            module = self._modules.get("module")
            if module is not None and hasattr(module, name):
                return getattr(module, name)
            raise


def _as_checkpointed(engine: ShardwiseEngine) -> engine_io.CheckpointedEngine:
    """Static check (mypy): the engine provides everything ``checkpoint/engine_io`` reads."""
    return engine


def _as_snapshotting(engine: ShardwiseEngine) -> snapshot_io.SnapshottingEngine:
    """Static check (mypy): and everything ``checkpoint/snapshot_io`` reads."""
    return engine
