"""``PipelineEngine``: what ``initialize`` returns for a PipelineModule (DeepSpeed's pipeline engine).

``train_batch`` pulls ``gradient_accumulation_steps`` micro batches (inputs on the first stage,
labels on the last), runs them through the configured schedule (:mod:`shardwise.pipe.executor`),
then, in DeepSpeed's order, sums the tied weights' gradients over their stages, reduces over the
data-parallel ranks of the stage and steps. The step is the ZeRO strategy's (stages 0-1), whose
gradient norm and overflow check span the whole pipeline (the norm group is the pipeline group, see
:mod:`shardwise.pipe.setup`), so clipping equals the unpipelined model's and every stage skips an
fp16 overflow together. The loss returned is the mean over micro batches and data-parallel ranks,
broadcast from the loss stage to every stage.

How gradients reach ZeRO: the schedule's backwards accumulate into ZeRO's flat buffer through its
hooks without reducing (``prepare_backward(False)``); the tied gradients are summed there, in place;
then ZeRO reduces the window over the stage's data-parallel ranks in its usual launch order
(``reduce_gradients``), as the boundary backward of an unpipelined run would.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch

from shardwise.checkpoint import snapshot_io
from shardwise.comm import collectives
from shardwise.config.errors import ConfigError
from shardwise.engine import ShardwiseEngine
from shardwise.pipe import executor as ex
from shardwise.pipe import tied
from shardwise.pipe.module import PipelineModule
from shardwise.pipe.setup import pipe_group


def _to_device(value: Any, device: torch.device) -> Any:
    if torch.is_tensor(value):
        return value.to(device)
    if isinstance(value, (tuple, list)):
        return tuple(_to_device(v, device) for v in value)
    return value


_WHOLE_BATCHES_ONLY = (
    "a PipelineEngine runs whole batches, micro batches flowing through the stages: call "
    "engine.train_batch(data_iter) to train and engine.eval_batch(data_iter) to evaluate, not forward/backward/step"
)


class PipelineEngine(ShardwiseEngine):
    """The training engine of a :class:`~shardwise.pipe.module.PipelineModule` (see the module docstring)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        config = kwargs["config"] if "config" in kwargs else args[1]  # ShardwiseEngine(module, config, ...)
        if not config.config.managed_gradient_accumulation:
            raise ConfigError(
                "managed_gradient_accumulation",
                "false is not supported with pipeline parallelism: train_batch() runs the whole "
                "accumulation window itself (DeepSpeed refuses it too)",
                "remove the key or set it to true",
                value=False,
            )
        super().__init__(*args, **kwargs)
        module = self.module
        if not isinstance(module, PipelineModule):
            raise TypeError(f"PipelineEngine needs a PipelineModule, got {type(module).__name__}")
        self.grid = module._grid
        self.num_stages = self.grid.pipe_parallel_size
        self.stage_id = self.grid.stage_id
        self.prev_stage, self.next_stage = self.stage_id - 1, self.stage_id + 1
        self.is_pipe_parallel = self.num_stages > 1
        self.is_data_parallel = self.grid.data_parallel_size > 1
        self.is_model_parallel = self.grid.model_parallel_size > 1
        self.data_iterator: Iterator[Any] | None = None
        self.batch_fn: Any = None
        self.total_loss: torch.Tensor | None = None
        self.agg_train_loss: torch.Tensor | None = None
        self.agg_additional_losses: Any = None
        self.dp_group_loss: torch.Tensor | None = None
        self.eval_return_logits = False
        self.outputs: Any = None
        settings = self.config.config.pipeline
        self.schedule_kind = ex.check_schedule(settings.schedule, settings.virtual_stages)
        self.virtual_stages = settings.virtual_stages
        total = self.num_stages * self.virtual_stages
        indices = ex.chunk_stages(self.schedule_kind, self.stage_id, self.num_stages, self.virtual_stages)
        chunks = [ex.ChunkModule(*module.chunk(i)) for i in range(len(indices))]
        self._micro_losses: list[torch.Tensor] = []
        self.executor = ex.Executor(
            self.schedule_kind,
            chunks,
            indices,
            total,
            self.grid.pp_proc_group,
            self.device,
            self._scaled_loss,
        )
        self._loss_rank = self._holder_rank(self.executor.holds_loss)

    @property
    def micro_batch_size(self) -> int:
        """Samples per micro batch (``train_micro_batch_size_per_gpu``)."""
        return self.train_micro_batch_size_per_gpu()

    @property
    def micro_batches(self) -> int:
        """Micro batches per ``train_batch``: ``gradient_accumulation_steps`` (follows ``set_train_batch_size``)."""
        return self.gradient_accumulation_steps()

    # ------------------------------------------------------------------ stage queries
    def is_first_stage(self) -> bool:
        """This rank runs pipeline stage 0."""
        return self.stage_id == 0

    def is_last_stage(self) -> bool:
        """This rank runs the last pipeline stage."""
        return self.stage_id == self.num_stages - 1

    def _holder_rank(self, holds: bool) -> int:
        """The global rank, in this pipeline, for which ``holds`` is True (collective over the pipe)."""
        flag = torch.tensor([self.global_rank if holds else -1], dtype=torch.long, device=self.device)
        if self.num_stages > 1:
            collectives.all_reduce(flag, op="max", group=pipe_group(self.grid))
        return int(flag.item())

    def _reentrant_activation_checkpointing(self) -> bool:
        """The module checkpoints activations with the reentrant function (inputs must require grad)."""
        from shardwise import checkpointing

        if self.module.activation_checkpoint_interval <= 0:
            return False
        return self.module.activation_checkpoint_func is not checkpointing.non_reentrant_checkpoint

    # ------------------------------------------------------------------ data
    def set_dataiterator(self, iterator: Iterator[Any]) -> None:
        """The iterator micro batches are read from (first and last stages read it)."""
        if self.executor.holds_input or self.executor.holds_loss:
            self.training_dataloader = None
            self.data_iterator = iterator

    def set_dataloader(self, loader: Any) -> None:
        """Read micro batches from ``loader`` (first and last stages)."""
        if self.executor.holds_input or self.executor.holds_loss:
            self.training_dataloader = loader
            self.data_iterator = iter(loader)

    def set_batch_fn(self, fn: Any) -> None:
        """Post-process each batch with ``fn`` after it is read."""
        self.batch_fn = fn

    def _next_batch(self) -> Any:
        batch = next(self.data_iterator) if self.data_iterator is not None else None
        return self.batch_fn(batch) if self.batch_fn else batch

    def _load(self, n: int) -> tuple[list[Any] | None, list[Any] | None]:
        """``n`` micro batches: the inputs where stage 0 runs, the labels where the loss is computed."""
        if not (self.executor.holds_input or self.executor.holds_loss):
            return None, None
        if self.data_iterator is None and self.training_dataloader is not None:
            from shardwise.data import RepeatingLoader

            # initialize(training_data=...) built the loader over this stage's data-parallel ranks
            self.data_iterator = iter(RepeatingLoader(self.training_dataloader))
        if self.data_iterator is None:
            raise RuntimeError(
                "train_batch/eval_batch on the first or last pipeline stage needs data: pass data_iter=, call "
                "engine.set_dataiterator(...), or give training_data to initialize"
            )
        inputs, labels = [], []
        for _ in range(n):
            batch = self._next_batch()
            x = _to_device(batch[0], self.device)
            if self._reentrant_activation_checkpointing():
                x = tuple(
                    t.detach().requires_grad_(t.is_floating_point())
                    for t in (x if isinstance(x, tuple) else (x,))
                )
                x = x[0] if len(x) == 1 else x
            inputs.append(x)
            labels.append(_to_device(batch[1], self.device) if len(batch) > 1 else None)
        return (inputs if self.executor.holds_input else None), (labels if self.executor.holds_loss else None)

    # ------------------------------------------------------------------ losses
    def _raw_loss(self, output: Any, target: Any) -> torch.Tensor:
        loss_fn = self.module.loss_fn
        return output if loss_fn is None else loss_fn(output, target)

    def _scaled_loss(self, output: Any, target: Any) -> torch.Tensor:
        """What the schedule backpropagates: ``loss / micro_batches`` times the loss scale, as
        ``engine.backward`` does; the raw loss is kept for the batch's mean."""
        raw = self._raw_loss(output, target)
        self._micro_losses.append(raw.detach())
        loss = raw / self.micro_batches if self.micro_batches > 1 else raw
        return self.precision.loss_scaler.scale_loss(loss.float())

    def _aggregate_loss(self, losses: list[torch.Tensor]) -> torch.Tensor:
        """Mean over micro batches, then over data-parallel ranks, broadcast from the loss stage."""
        both = torch.zeros(2, dtype=torch.float32, device=self.device)
        if self.global_rank == self._loss_rank:
            mean = torch.stack([loss.float() for loss in losses]).sum() / len(losses)
            both[0] = mean
            agg = mean.clone()
            if self.is_data_parallel:
                collectives.all_reduce(agg, op="sum", group=self.grid.dp_proc_group)
                agg /= self.grid.data_parallel_size
            both[1] = agg
        if self.num_stages > 1:
            collectives.broadcast(both, src=self._loss_rank, group=pipe_group(self.grid))
        self.dp_group_loss = both[0].clone()
        return both[1].clone()

    # ------------------------------------------------------------------ training
    def train_batch(self, data_iter: Iterator[Any] | None = None) -> torch.Tensor:
        """Train on one batch (``gradient_accumulation_steps`` micro batches); returns the mean loss."""
        if not torch.is_grad_enabled():
            raise RuntimeError("train_batch() ran under torch.no_grad(): training needs gradients; call eval_batch() to evaluate")
        optimizer = self._require_optimizer("train_batch")
        if data_iter is not None:
            self.set_dataiterator(data_iter)
        self.module.train()
        inputs, labels = self._load(self.micro_batches)
        self._micro_losses = []
        optimizer.prepare_backward(False)
        with self.precision.forward_context(self.device.type):
            self.executor.run(self.micro_batches, inputs, labels, backward=True)
        # torch's first step also calls the loss once to infer gradient shapes: keep the real calls
        self._micro_losses = self._micro_losses[-self.micro_batches :] if self._micro_losses else []
        self._reduce_gradients(optimizer)
        result = self._optimizer_step(optimizer, None)
        self.telemetry.after_step(True)
        self._report_progress()
        self.counters.micro_steps += self.micro_batches
        self._after_optimizer_step(result)  # the step hooks, then a snapshot when one is due
        self.total_loss = torch.stack(self._micro_losses).sum() if self._micro_losses else None
        self.agg_train_loss = self._aggregate_loss(self._micro_losses)
        return self.agg_train_loss

    def _reduce_gradients(self, optimizer: Any) -> None:
        """DeepSpeed's ReduceTiedGrads then ReduceGrads on ZeRO's own buffers (module docstring)."""
        optimizer.after_backward()  # the schedule's backwards: accumulated, nothing reduced
        if self.module._ties and self.num_stages > 1:
            optimizer.fold_gradients()  # a zero-bubble weight pass may have left .grad outside the buffer
            tied.sum_gradients(
                self.module._ties,
                optimizer.accumulated_gradient,
                pipe_group(self.grid),
                self.num_stages,
                self.device,
                self.precision.grad_accum_dtype,
            )
        optimizer.reduce_gradients()  # over this stage's data-parallel ranks, ZeRO's usual launch order

    # ------------------------------------------------------------------ evaluation
    def eval_batch(
        self,
        data_iter: Iterator[Any] | None,
        return_logits: bool = False,
        compute_loss: bool = True,
        reduce_output: str | None = "avg",
        bcast_loss: bool = True,
        num_micro_batches: int | None = None,
    ) -> Any:
        """Forward-only over a batch; returns the mean loss (or outputs without a ``loss_fn``), and
        the last micro batch's outputs too with ``return_logits``."""
        self.eval_return_logits = return_logits
        self.module.eval()
        previous = self.data_iterator
        if data_iter is not None:
            self.set_dataiterator(data_iter)
        n = self.micro_batches if num_micro_batches is None else num_micro_batches
        try:
            inputs, labels = self._load(n)
            with torch.no_grad(), self.precision.forward_context(self.device.type):
                outputs = self.executor.run(n, inputs, None, backward=False, with_loss=False)
                result = None
                if self.executor.holds_loss:
                    assert labels is not None
                    per_micro = (
                        [self._raw_loss(o, y) for o, y in zip(outputs, labels)] if compute_loss else outputs
                    )
                    result = self._reduce_outputs(per_micro, reduce_output, n)
                if compute_loss and bcast_loss:
                    result = self._broadcast_from_loss_stage(result)
        finally:
            self.data_iterator = previous
            self.eval_return_logits = False
        if return_logits:
            self.outputs = outputs[-1] if outputs else None
            return result, self.outputs
        return result

    def _reduce_outputs(self, outputs: list[Any], reduce: str | None, n: int) -> Any:
        if reduce is None:
            return outputs
        if reduce.lower() != "avg":
            raise NotImplementedError(
                f"eval_batch(reduce_output={reduce!r}): only 'avg' or None are supported (None returns every "
                "micro batch's output)"
            )
        if torch.is_tensor(outputs[0]):
            reduced: Any = sum(outputs) / n
            if self.is_data_parallel:
                collectives.all_reduce(reduced, op="sum", group=self.grid.dp_proc_group)
                reduced /= self.grid.data_parallel_size
            return reduced
        summed = [sum(parts) / n for parts in zip(*outputs)]
        if self.is_data_parallel:
            for t in summed:
                collectives.all_reduce(t, op="sum", group=self.grid.dp_proc_group)
                t /= self.grid.data_parallel_size
        return summed

    def _broadcast_from_loss_stage(self, value: Any) -> Any:
        """The loss stage's tensor on every stage of the pipeline (its shape travels first)."""
        if self.num_stages == 1:
            return value
        group = pipe_group(self.grid)
        meta = torch.zeros(9, dtype=torch.long, device=self.device)
        if self.global_rank == self._loss_rank:
            if not torch.is_tensor(value) or value.dim() > 8:
                raise ValueError(
                    "eval_batch(bcast_loss=True) broadcasts one tensor of at most 8 dims; pass reduce_output='avg'"
                )
            meta[0] = value.dim()
            meta[1 : 1 + value.dim()] = torch.tensor(value.shape)
        collectives.broadcast(meta, src=self._loss_rank, group=group)
        shape = meta[1 : 1 + int(meta[0])].tolist()
        data = (
            value.float().contiguous()
            if self.global_rank == self._loss_rank
            else torch.zeros(shape, device=self.device)
        )
        collectives.broadcast(data, src=self._loss_rank, group=group)
        return data

    # ------------------------------------------------------------------ checkpoints
    def load_checkpoint(
        self,
        load_dir: str | Path,
        tag: object = None,
        load_module_strict: bool = True,
        load_optimizer_states: bool = True,
        load_lr_scheduler_states: bool = True,
        load_module_only: bool = False,
        custom_load_fn: Callable[..., object] | None = None,
    ) -> tuple[str | None, dict[str, Any] | None]:
        """``engine.load_checkpoint`` for any number of stages: entries are keyed by global layer
        index, so every stage reads its own layers' parameters and optimizer state from a checkpoint
        written with any stage count. Strict means every entry of this stage was saved (the other
        stages' entries are expected, not unexpected)."""
        from shardwise.checkpoint import dcp_io, keys

        path, client_state = snapshot_io.load_checkpoint(  # engine_io's; with snapshots, the newest that verifies
            self,
            load_dir,
            tag=tag,
            load_module_strict=False,
            load_optimizer_states=load_optimizer_states,
            load_lr_scheduler_states=load_lr_scheduler_states,
            load_module_only=load_module_only,
            custom_load_fn=custom_load_fn,
        )
        if path is not None and load_module_strict:
            saved = dcp_io.saved_entries(dcp_io.read_metadata(path))
            missing = [k for k in self.module.state_dict() if keys.MODEL + k not in saved]
            if missing:
                raise RuntimeError(
                    f"pipeline stage {self.stage_id}: {path} has no entries for {missing}; was it saved from a "
                    "PipelineModule with the same layers? (load_module_strict=False loads what matches)"
                )
        self.module._synchronize_tied_weights()
        return path, client_state

    # ------------------------------------------------------------------ refused here
    def forward(self, *args: object, **kwargs: object) -> Any:
        """Not for pipelines: a pipeline runs whole batches (``train_batch`` / ``eval_batch``)."""
        raise RuntimeError(_WHOLE_BATCHES_ONLY)

    def backward(self, *args: object, **kwargs: object) -> Any:
        """Not for pipelines: a pipeline runs whole batches (``train_batch`` / ``eval_batch``)."""
        raise RuntimeError(_WHOLE_BATCHES_ONLY)

    def step(self, *args: object, **kwargs: object) -> None:
        """Not for pipelines: a pipeline runs whole batches (``train_batch`` / ``eval_batch``)."""
        raise RuntimeError(_WHOLE_BATCHES_ONLY)

    def get_additional_losses(self) -> Any:
        """Extra losses of the last batch (None: the module reports none)."""
        return self.agg_additional_losses
