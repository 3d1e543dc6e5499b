"""Which candidates can fit: the memory plan's bytes per rank plus activations, against a budget.

A candidate needs the model states the memory plan predicts for its config
(:func:`shardwise.zero.memory_plan.plan_from_config`) plus ``activation bytes per sample x
micro batch`` (measured once by the profile run). On a GPU the budget is the device's memory
and the model states counted are those on the device (offload moves them to the host); on
CPU ranks everything lives in host memory, so the budget is the available host memory shared
by the node's ranks, offloaded bytes count too, and offload never helps (it is not tried).

Example:
    >>> info = ModelInfo(num_params=1000, activation_mem_per_sample=100.0)
    >>> cfg = {"train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 1, "train_batch_size": 8}
    >>> predicted_bytes(cfg, info, world_size=2, on_gpu=False)  # 16 B/param at stage 0 + 4 x 100
    16400
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

__all__ = ["ModelInfo", "available_memory_per_rank", "predicted_bytes"]

GPU_HEADROOM = 0.9
"""Share of a GPU's memory the plan may fill (the allocator, kernels and fragmentation need the rest)."""


@dataclass(frozen=True)
class ModelInfo:
    """What the profile run measured (or ``model_info`` gave).

    Attributes:
        num_params: trainable parameters.
        activation_mem_per_sample: bytes a training forward saves for backward, per sample.
    """

    num_params: int
    activation_mem_per_sample: float = 0.0

    @classmethod
    def from_mapping(cls, data: Mapping[str, Any]) -> ModelInfo:
        """From the profile run's JSON (or ``model_info``); ``trainable_num_params`` wins."""
        params = data.get("trainable_num_params") or data.get("num_params")
        if not params:
            raise ValueError(
                f"model info {dict(data)} has no num_params: give autotuning.model_info.num_params"
            )
        return cls(int(params), float(data.get("activation_mem_per_sample") or 0.0))


def predicted_bytes(ds_config: Mapping[str, object], info: ModelInfo, world_size: int, *, on_gpu: bool) -> int:
    """Bytes one rank needs for this config: model states plus activations.

    Raises:
        ConfigError: the candidate's config is not valid (the caller records it as such).
    """
    from shardwise.config import load_config
    from shardwise.utils.logging import get_logger
    from shardwise.zero.memory_plan import plan_from_config

    log = get_logger()
    level = log.level
    log.setLevel("ERROR")  # the config's own warnings belong to the experiment's log, not once per candidate
    try:
        resolved = load_config(dict(ds_config), world_size=world_size)
    finally:
        log.setLevel(level)
    plan = plan_from_config(resolved.config, info.num_params, world_size)
    states = plan.device_total if on_gpu else plan.memory_total
    micro = int(resolved.config.train_micro_batch_size_per_gpu or 1)
    return int(states + info.activation_mem_per_sample * micro)


def _host_available() -> int:
    try:
        with open("/proc/meminfo", encoding="utf-8") as handle:
            for line in handle:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return int(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES"))


def available_memory_per_rank(ranks_per_node: int, *, on_gpu: bool) -> int:
    """The budget one rank may fill: the GPU's memory (x :data:`GPU_HEADROOM`), or the host's
    available memory divided among the node's ranks."""
    if on_gpu:
        import torch

        return int(torch.cuda.get_device_properties(0).total_memory * GPU_HEADROOM)
    return _host_available() // max(ranks_per_node, 1)
