"""``PipelineModule``: a sequence of layers cut into pipeline stages (DeepSpeed's ``deepspeed.pipe``).

Every rank lists all layers (modules, :class:`~shardwise.pipe.spec.LayerSpec`\\ s, or plain
callables), and builds only those of its own stage, chosen by ``partition_method``
(:mod:`shardwise.pipe.partition`). The stage's forward runs its layers in order, each one's output
the next one's input, optionally under activation checkpointing every
``activation_checkpoint_interval`` layers. ``initialize`` turns the module into a
:class:`~shardwise.pipe.engine.PipelineEngine`. Per-layer checkpoint files
(:mod:`shardwise.pipe.layer_files`) make checkpoints independent of the number of stages.

Example:
    >>> # net = PipelineModule(layers=[LayerSpec(nn.Linear, 8, 8), nn.ReLU(), LayerSpec(nn.Linear, 8, 1)],
    >>> #                      num_stages=2, loss_fn=nn.MSELoss())
    >>> # engine, *_ = shardwise.initialize(model=net, config=ds_config)
    >>> # loss = engine.train_batch(data_iter)
"""

from __future__ import annotations

import functools
import random
from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch import nn

from shardwise import checkpointing
from shardwise.comm import init
from shardwise.pipe import layer_files, partition, tied
from shardwise.pipe.grid import PipelineParallelGrid
from shardwise.pipe.spec import LayerSpec, TiedLayerSpec
from shardwise.pipe.topology import PipeDataParallelTopology, ProcessTopology


class PipelineError(Exception):
    """Errors related to the use of PipelineModule."""


def _seed_everything(seed: int) -> None:
    random.seed(seed)
    torch.manual_seed(seed)
    try:
        import numpy

        numpy.random.seed(seed % 2**32)
    except ImportError:  # numpy is optional
        pass


def layer_name(layer: object) -> str | None:
    """The class name partitioning by type matches: a spec's type, a module's class, a function's name."""
    if isinstance(layer, LayerSpec):
        return layer.typename.__name__
    if isinstance(layer, nn.Module):
        return type(layer).__name__
    return getattr(layer, "__name__", None)


def _trainable_count(layer: object) -> int:
    if isinstance(layer, LayerSpec):
        try:
            with torch.device("meta"):  # shapes only: no memory, no draw from the generators
                built = layer.build()
        except Exception:  # a layer whose constructor needs real data: built and dropped, as DeepSpeed does
            built = layer.build()
        return sum(p.numel() for p in built.parameters() if p.requires_grad)
    if isinstance(layer, nn.Module):
        return sum(p.numel() for p in layer.parameters() if p.requires_grad)
    return 0


def _device() -> torch.device:
    if init.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _accumulated_grad(tensor: torch.Tensor) -> torch.Tensor:
    """``tensor.grad``, which a held tied tensor has after a backward."""
    if tensor.grad is None:
        raise RuntimeError(
            f"allreduce_tied_weight_gradients: a tied tensor of shape {tuple(tensor.shape)} has no .grad; "
            "call it after backward (and keep tied weights trainable)"
        )
    return tensor.grad


class PipelineModule(nn.Module):
    """Layers to be run as a pipeline (see the module docstring); DeepSpeed's arguments.

    Args:
        layers: the layers, in order (an ``nn.Sequential`` works).
        num_stages: the pipeline degree; or give ``topology``.
        topology: a ``pipe x data [x model]`` :class:`ProcessTopology`.
        loss_fn: ``loss_fn(outputs, labels)`` on the last stage.
        seed_layers: seed each layer's construction with ``base_seed + layer index`` (and its
            forward with ``base_seed * micro batch + layer index``).
        seed_fn: the seeding function (default: Python, NumPy and torch generators).
        base_seed: the starting seed.
        partition_method: ``"parameters"``, ``"uniform"`` or ``"type:<regex>"``.
        activation_checkpoint_interval: checkpoint every that many layers (0: off).
        activation_checkpoint_func: the checkpoint function (``shardwise.checkpointing.checkpoint``).
        checkpointable_layers: class names that may be checkpointed (default: any layer with parameters).
        dynamic_shape: accepted (activation shapes are always read per micro batch).
    """

    def __init__(
        self,
        layers: Iterable[Any],
        num_stages: int | None = None,
        topology: ProcessTopology | None = None,
        loss_fn: Callable[..., Any] | None = None,
        seed_layers: bool = False,
        seed_fn: Callable[[int], None] | None = None,
        base_seed: int = 1234,
        partition_method: str = "parameters",
        activation_checkpoint_interval: int = 0,
        activation_checkpoint_func: Callable[..., Any] = checkpointing.checkpoint,
        checkpointable_layers: list[str] | None = None,
        dynamic_shape: bool = False,
    ) -> None:
        super().__init__()
        if num_stages is None and topology is None:
            raise RuntimeError("PipelineModule needs num_stages= or topology= to know how many stages to cut")
        if not init.is_initialized():
            raise RuntimeError(
                "PipelineModule needs the process group to place its stages: call deepspeed.init_distributed() "
                "(shardwise.init_distributed()) before building it"
            )
        if checkpointable_layers is not None and not isinstance(checkpointable_layers, list):
            raise AssertionError(
                f"PipelineModule(checkpointable_layers={checkpointable_layers!r}): give a list of layer class names"
            )
        self.micro_offset = 0
        self.loss_fn = loss_fn
        self.checkpointable_layers = checkpointable_layers
        self.seed_layers, self.seed_fn, self.base_seed = seed_layers, seed_fn, base_seed
        self.global_rank, self.world_size = init.get_rank(), init.get_world_size()
        if topology is None:
            assert num_stages is not None
            if self.world_size % num_stages != 0:
                raise RuntimeError(
                    f"PipelineModule(num_stages={num_stages}) on {self.world_size} ranks: the world size must be a "
                    "multiple of the stage count (the rest is data parallelism)"
                )
            topology = PipeDataParallelTopology(num_pp=num_stages, num_dp=self.world_size // num_stages)
        self._topo = topology
        self.num_stages = topology.get_dim("pipe")
        self._grid = PipelineParallelGrid(topology=topology)
        self.stage_id = self._grid.stage_id
        self._layer_specs = list(layers)
        self._num_layers = len(self._layer_specs)
        self.partition_method = partition_method
        self.parts = self._partition(partition_method)
        self._local_start, self._local_stop = self.parts[self.stage_id], self.parts[self.stage_id + 1]
        self.forward_funcs: list[Callable[..., Any]] = []
        self.fwd_map: dict[str, int] = {}
        self.layer_indices: list[int] = []  # the global index of each entry of forward_funcs
        self.tied_modules = nn.ModuleDict()
        self.tied_weight_attrs: dict[str, list[str]] = {}
        self.activation_checkpoint_interval = activation_checkpoint_interval
        self.activation_checkpoint_func = activation_checkpoint_func
        self.is_checkpointable_results: list[bool] = []
        self.is_checkpointable_results_interval: int | None = None
        self.checkpoint_parallel_write_pipeline = False
        self.dynamic_shape = dynamic_shape
        self.chunk_ranges = [(self._local_start, self._local_stop)]  # global layer ranges this rank runs
        self._build(self.chunk_ranges)
        self._index_ties([self.stage_owner(i) for i in range(self._num_layers)])

    def _index_ties(self, rank_stage_of_layer: list[int]) -> None:
        """Find the tie keys, the stages holding each, this stage's copies; make the copies equal."""
        self.to(_device())
        self._ties = tied.index_ties(self._layer_specs, rank_stage_of_layer, self._grid.pp_group)
        held = dict(self.tied_modules.items())
        for tie in self._ties:
            tie.module = held.get(tie.key)
        tied.mark_replicas(self._ties, self.stage_id)
        self.tied_comms: dict[str, dict[str, Any]] = {
            t.key: {
                "ranks": t.ranks,
                "group": self._grid.pp_proc_group,
                "weight_attr": self.tied_weight_attrs.get(t.key, t.attrs),
                "module": t.module,
            }
            for t in self._ties
            if t.module is not None and len(t.stages) > 1
        }
        self._synchronize_tied_weights()

    # ------------------------------------------------------------------ building
    def _partition(self, method: str) -> list[int]:
        method_l = method.lower()
        if method_l == "uniform":
            return partition.partition_uniform(self._num_layers, self.num_stages)
        if method_l == "parameters":
            return partition.partition_balanced(
                [_trainable_count(s) for s in self._layer_specs], self.num_stages
            )
        if method_l.startswith("type:"):
            names = [layer_name(s) for s in self._layer_specs]
            weights = partition.type_weights(names, method.split(":", 1)[1])
            return partition.partition_balanced(weights, self.num_stages)
        raise NotImplementedError(
            f"PipelineModule(partition_method={method!r}) is not a method shardwise knows: use 'parameters', "
            "'uniform' or 'type:<regex>' (case-insensitive)"
        )

    def _build(self, ranges: list[tuple[int, int]], built: dict[int, nn.Module] | None = None) -> None:
        """Build the layers of the global ``ranges`` (reusing modules in ``built``, by layer index)."""
        self.forward_funcs, self.fwd_map, self.layer_indices = [], {}, []
        for layer_idx in (i for a, b in ranges for i in range(a, b)):
            self.layer_indices.append(layer_idx)
            layer = self._layer_specs[layer_idx]
            if built is not None and layer_idx in built:
                layer = built[layer_idx]
            if self.seed_layers:
                (self.seed_fn or _seed_everything)(self.base_seed + layer_idx)
            if isinstance(layer, PipelineModule):
                raise NotImplementedError(
                    f"layer {layer_idx} of the PipelineModule is itself a PipelineModule: nesting pipelines is "
                    "not supported; pass its layers (LayerSpecs) to the outer PipelineModule instead"
                )
            if isinstance(layer, TiedLayerSpec):
                if layer.key not in self.tied_modules:
                    self.tied_modules[layer.key] = layer.build()
                    self.tied_weight_attrs[layer.key] = layer.tied_weight_attr
                module = self.tied_modules[layer.key]
                self.forward_funcs.append(
                    module if layer.forward_fn is None else functools.partial(layer.forward_fn, module)
                )
                continue
            if isinstance(layer, LayerSpec):
                layer = layer.build()
            if isinstance(layer, nn.Module):
                self.forward_funcs.append(layer)
                self.fwd_map[str(layer_idx)] = len(self.forward_funcs) - 1
                self.add_module(str(layer_idx), layer)
            else:
                self.forward_funcs.append(layer)  # a plain callable, e.g. a lambda
        for p in self.parameters():
            setattr(p, "ds_pipe_replicated", False)  # noqa: B010 - DeepSpeed's dynamic parameter attribute

    def _synchronize_tied_weights(self) -> None:
        tied.synchronize(self._ties, self._grid.pp_proc_group, self._grid.pipe_parallel_size, _device())

    # ------------------------------------------------------------------ forward
    def _is_checkpointable(self, funcs: list[Callable[..., Any]]) -> bool:
        names = [type(f).__name__ for f in funcs]
        reentrant = self.activation_checkpoint_func is not checkpointing.non_reentrant_checkpoint
        if reentrant and type(self).__name__ in ("GPTModelPipe", "GPT2ModelPipe"):
            # Megatron's pipes: reentrant checkpointing would cut the embedding off autograd
            extra = self.checkpointable_layers or []
            return all("ParallelTransformerLayerPipe" in n or n in extra for n in names)
        if self.checkpointable_layers is not None:
            return all(type(f).__name__ in self.checkpointable_layers for f in funcs)
        return any(len(list(f.parameters())) > 0 for f in funcs if isinstance(f, nn.Module))

    def _precompute_checkpointable_values(self) -> None:
        interval = self.activation_checkpoint_interval
        if interval > 0 and self.is_checkpointable_results_interval != interval:
            n = len(self.forward_funcs)
            self.is_checkpointable_results = [
                self._is_checkpointable(self.forward_funcs[i : i + interval]) for i in range(0, n, interval)
            ]
            self.is_checkpointable_results_interval = interval

    def set_checkpoint_interval(self, interval: int) -> None:
        """Checkpoint every ``interval`` layers from the next forward on (0: off)."""
        assert interval >= 0
        self.activation_checkpoint_interval = interval
        self._precompute_checkpointable_values()

    def _run_layers(self, start: int, end: int, micro_offset: int) -> Callable[..., Any]:
        def run(*inputs: Any) -> Any:
            x: Any = inputs[0] if len(inputs) == 1 else inputs
            for idx, layer in enumerate(self.forward_funcs[start:end]):
                self.curr_layer = self.layer_indices[start + idx]
                if self.seed_layers:
                    (self.seed_fn or _seed_everything)(self.base_seed * micro_offset + self.curr_layer)
                x = layer(x)
            return x

        return run

    def forward(self, forward_input: Any) -> Any:
        """Run this stage's layers on ``forward_input`` (a tensor or a tuple)."""
        return self._forward_range(0, len(self.forward_funcs), forward_input)

    def _forward_range(self, start: int, end: int, forward_input: Any) -> Any:
        """Layers ``start:end`` (local indices), checkpointed every ``activation_checkpoint_interval``."""
        self.micro_offset += 1
        offset = self.micro_offset + 1
        interval = self.activation_checkpoint_interval
        if interval == 0:
            return self._run_layers(start, end, offset)(forward_input)
        whole = (start, end) == (0, len(self.forward_funcs))
        if whole:
            self._precompute_checkpointable_values()
        x = forward_input
        for block, first in enumerate(range(start, end, interval)):
            last = min(first + interval, end)
            run = self._run_layers(first, last, offset)
            args = x if isinstance(x, tuple) else (x,)
            use = (
                self.is_checkpointable_results[block]
                if whole
                else self._is_checkpointable(self.forward_funcs[first:last])
            )
            x = self.activation_checkpoint_func(run, *args) if use else run(*args)
        return x

    # ------------------------------------------------------------------ queries
    def partitions(self) -> list[int]:
        """The stage boundaries (``num_stages + 1`` layer indices)."""
        return self.parts

    def stage_owner(self, layer_idx: int) -> int:
        """The stage that holds layer ``layer_idx``."""
        assert 0 <= layer_idx < self._num_layers
        for stage in range(self.num_stages):
            if self.parts[stage] <= layer_idx < self.parts[stage + 1]:
                return stage
        raise RuntimeError(f"Layer {layer_idx} not owned? parts={self.parts}")

    def topology(self) -> ProcessTopology:
        """The process topology."""
        return self._topo

    def mpu(self) -> PipelineParallelGrid:
        """The grid, usable as an mpu."""
        return self._grid

    def num_pipeline_stages(self) -> int:
        """The number of stages."""
        return self.num_stages

    def get_additional_losses(self) -> dict[str, torch.Tensor] | None:
        """Extra losses to report (none by default; models override it)."""
        return None

    def get_tied_weights_and_groups(self) -> list[tuple[torch.Tensor, Any]]:
        """``(tensor, group)`` for every tied tensor this stage holds (group: the pipeline group)."""
        return [
            (tied.resolve_attr(c["module"], attr), c["group"])
            for c in self.tied_comms.values()
            for attr in c["weight_attr"]
        ]

    def allreduce_tied_weight_gradients(self) -> None:
        """Sum the tied gradients (``param.grad``) over the stages that hold them (collective)."""
        tied.sum_gradients(
            self._ties,
            _accumulated_grad,
            self._grid.pp_proc_group,
            self._grid.pipe_parallel_size,
            _device(),
            torch.float32,
        )

    def compile(self, *args: Any, **kwargs: Any) -> None:
        """``torch.compile`` every layer (modules in place, functions replaced)."""
        for i, layer in enumerate(self.forward_funcs):
            if isinstance(layer, nn.Module):
                layer.compile(*args, **kwargs)
            else:
                self.forward_funcs[i] = torch.compile(layer, *args, **kwargs)

    # ------------------------------------------------------------------ virtual stages
    def split_virtual_stages(
        self, stage_indices: list[int], total: int, rank_of_stage: Callable[[int], int]
    ) -> None:
        """Re-cut the layers into ``total`` stages and hold the chunks ``stage_indices`` (collective).

        Layers this rank already built and still holds are kept (with their values); the others
        are built from their specs. Called by the engine for schedules with several stages per
        rank, before the optimizer is made.
        """
        saved = self.partition_method
        num_stages, self.num_stages = self.num_stages, total
        try:
            parts = self._partition(saved)
        finally:
            self.num_stages = num_stages
        built = {int(name): module for name, module in list(self.named_children()) if name.isdigit()}
        for name in list(built):
            delattr(self, str(name))
        self.chunk_parts = parts
        self.chunk_ranges = [(parts[i], parts[i + 1]) for i in stage_indices]
        self._build(self.chunk_ranges, built)
        used = {
            s.key for s in (self._layer_specs[i] for i in self.layer_indices) if isinstance(s, TiedLayerSpec)
        }
        for key in [k for k in self.tied_modules if k not in used]:
            del self.tied_modules[key]
            self.tied_weight_attrs.pop(key, None)
        owner = [
            rank_of_stage(next(i for i in range(total) if parts[i] <= layer < parts[i + 1]))
            for layer in range(self._num_layers)
        ]
        self.is_checkpointable_results_interval = None
        self._index_ties(owner)

    def chunk(self, index: int) -> tuple[Callable[[Any], Any], list[nn.Module]]:
        """Chunk ``index`` of this rank: its forward and the modules it uses (tied ones included)."""
        sizes = [b - a for a, b in self.chunk_ranges]
        start = sum(sizes[:index])
        end = start + sizes[index]
        modules: list[nn.Module] = []
        for f in self.forward_funcs[start:end]:
            target = f.args[0] if isinstance(f, functools.partial) else f
            if isinstance(target, nn.Module) and all(target is not m for m in modules):
                modules.append(target)
        offset = self
        return (lambda x: offset._forward_range(start, end, x)), modules

    # ------------------------------------------------------------------ checkpoint files
    def ckpt_prefix(self, checkpoints_path: str, tag: str) -> str:
        """The prefix of this rank's module files (``module-pipe_00[-model_00]``)."""
        return layer_files.rank_prefix(self._topo, self.global_rank, checkpoints_path, tag)

    def ckpt_layer_path(self, ckpt_dir: str, local_layer_idx: int) -> str:
        """The file of a layer: ``layer_{global index:02d}[-model_XX]-model_states.pt``."""
        return layer_files.layer_path(
            self._topo, self.global_rank, ckpt_dir, self.layer_indices[local_layer_idx]
        )

    def ckpt_layer_path_list(self, ckpt_dir: str, local_layer_idx: int) -> list[str]:
        """Every saved file of a layer (one per tensor slice)."""
        return layer_files.layer_path_list(ckpt_dir, self.layer_indices[local_layer_idx])

    def save_state_dict(
        self, save_dir: str, checkpoint_engine: Any = None, exclude_frozen_params: bool = False
    ) -> None:
        """Write one file per layer of this stage (data-parallel rank 0 writes; see :mod:`layer_files`)."""
        layer_files.save_layers(self, save_dir, checkpoint_engine, exclude_frozen_params)

    def load_state_dir(self, load_dir: str, checkpoint_engine: Any = None, strict: bool = True) -> None:
        """Load this stage's layers from per-layer files (any number of stages may have written them)."""
        layer_files.load_layers(self, load_dir, checkpoint_engine, strict)
        self._synchronize_tied_weights()
