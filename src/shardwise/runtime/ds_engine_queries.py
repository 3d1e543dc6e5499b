"""DeepSpeed engine methods that answer questions or hand work to a part: ranks and groups (from
the topology, which :mod:`shardwise.comm.mesh` builds), datasets, DeepCompile (which shardwise does
not run: the answers are DeepSpeed's with it off), the data post-processing function and random-LTD's
layers (``data_efficiency``'s loader and step hook), Python's garbage collector.

A base of :class:`~shardwise.runtime.ds_engine_actions.DeepSpeedEngineActions`.
"""

from __future__ import annotations

import gc
from collections.abc import Callable
from typing import Any

import torch

from shardwise.runtime.step_hooks import StepHooks
from shardwise.utils.logging import logger


class DeepSpeedEngineQueries:
    """Mixed into :class:`~shardwise.engine.ShardwiseEngine` (which provides ``_config``, ``topology``,
    ``module``, ``optimizer``, ``step_hooks`` and ``training_dataloader``)."""

    _config: Any
    topology: Any
    module: Any
    optimizer: Any
    step_hooks: StepHooks
    training_dataloader: Any

    # ------------------------------------------------------------------ ranks and groups
    def get_data_parallel_rank(self) -> int:
        """This rank's place in the data-parallel group."""
        return int(self.topology.dp_rank)

    def get_model_parallel_rank(self) -> int:
        """This rank's place in the model-parallel group (0 without model parallelism)."""
        return int(self.topology.mp_rank)

    def get_tensor_parallel_rank(self) -> int:
        """This rank's place in the tensor-parallel group (0 without tensor parallelism)."""
        return int(self.topology.rank_in("tp"))

    def get_sequence_parallel_group(self) -> Any:
        """The sequence-parallel group (None without sequence parallelism)."""
        return self.topology.sp_group

    def is_first_weights_partition_group(self) -> bool:
        """Whether the weights are partitioned (ZeRO stage 3), DeepSpeed's answer to this name."""
        return bool(self._config.config.zero_stage >= 3)

    # ------------------------------------------------------------------ datasets
    @staticmethod
    def is_map_style_dataset(obj: object) -> bool:
        """Whether ``obj`` is indexable with a length (a map-style dataset)."""
        return hasattr(obj, "__getitem__") and hasattr(obj, "__len__")

    @staticmethod
    def is_iterable_style_dataset(obj: object) -> bool:
        """Whether ``obj`` is a ``torch.utils.data.IterableDataset``."""
        return isinstance(obj, torch.utils.data.IterableDataset)

    def set_data_post_process_func(self, post_process_func: Callable[[Any, dict[str, Any]], Any]) -> None:
        """Pass every training batch through ``post_process_func(batch, sampler_state)`` (e.g. truncate
        to the curriculum's ``current_difficulties``). As in DeepSpeed, only the curriculum sampler's
        loader (``data_efficiency.data_sampling.curriculum_learning``) applies it; another loader
        refuses it, and without a training loader it is refused too."""
        loader = self.training_dataloader
        sampler = getattr(loader, "sampler", None)
        if loader is None or not hasattr(sampler, "post_process_state"):
            raise ValueError(
                "set_data_post_process_func: the function is applied by the curriculum-learning training loader "
                "(data_efficiency.data_sampling.curriculum_learning.enabled: true, with training_data passed to "
                "initialize); this engine has "
                + (
                    "no training data loader"
                    if loader is None
                    else "a training loader without a curriculum sampler"
                )
            )
        loader.post_process_func = post_process_func

    def random_ltd_initialize(self) -> None:
        """Give the model's random-LTD layers (wrapped with ``convert_to_random_ltd``) the section's
        settings and the schedule's current kept length again, e.g. after layers were wrapped or
        replaced after ``initialize``. Refused when ``data_routing.random_ltd`` is off."""
        hook = self.step_hooks.named("random_ltd")
        if hook is None:
            raise AssertionError(
                "random_ltd_initialize() needs data_efficiency.data_routing.random_ltd enabled (with "
                "data_efficiency.enabled and data_routing.enabled)"
            )
        hook.bind(self.module)  # type: ignore[attr-defined]

    # ------------------------------------------------------------------ DeepCompile (not run by shardwise)
    def is_deepcompile_enabled(self) -> bool:
        """``compile.deepcompile`` as configured (shardwise then compiles per block without DeepCompile's passes)."""
        return bool(self._config.config.compile.deepcompile)

    def is_deepcompile_active(self) -> bool:
        """False: shardwise never runs DeepCompile's graph passes (``engine.compile()`` is torch.compile per block)."""
        return False

    def uses_parallelization_pass_only(self) -> bool:
        """False: ``compile.passes`` (``autosp``/``autotp``) are refused at initialize, so no
        parallelization pass compiles the graph."""
        return False

    def get_compile_time(self) -> list[Any]:
        """DeepCompile's per-pass timings: empty, since no DeepCompile pass runs here."""
        return []

    def register_compile_pass(
        self, pass_name: str, pass_fn: Callable[..., Any], contract: Any = None
    ) -> None:
        """Refused: shardwise has no DeepCompile pass pipeline to register ``pass_name`` in."""
        raise NotImplementedError(
            f"register_compile_pass({pass_name!r}): shardwise runs no DeepCompile graph passes; engine.compile() "
            "compiles each transformer block with torch.compile (pass a backend or compile_kwargs instead)"
        )

    # ------------------------------------------------------------------ the rest
    def collect_python_gc(self) -> int:
        """Run Python's cyclic garbage collector now; returns the number of unreachable objects found."""
        return gc.collect()

    def get_type(self) -> list[Any]:
        """Each param group's ``"type"`` entry (0.0 where it has none), DeepSpeed's ``get_type``."""
        if self.optimizer is None:
            return []
        return [group.get("type", 0.0) for group in self.optimizer.param_groups]

    def super_offload(self) -> bool:
        """``zero_optimization.offload_optimizer.super_offload`` (inert in shardwise: config/inert.py)."""
        offload = self._config.config.zero_optimization.offload_optimizer
        return bool(offload is not None and offload.super_offload)

    def print_forward_breakdown(self, fwd_time: float) -> None:
        """Log the forward time (ms) on rank 0. DeepSpeed adds its MoE gate and all-to-all timings;
        shardwise's MoE layers do not time those parts, and the line says so rather than print zeros."""
        if self.topology.world_rank != 0:
            return
        from shardwise.moe.layer import MOELayer

        has_moe = any(isinstance(m, MOELayer) for m in self.module.modules())
        note = " (MoE gate/all-to-all times are not measured by shardwise's MoE layers)" if has_moe else ""
        logger.info("time (ms) | fwd: %.2f%s", fwd_time, note)
