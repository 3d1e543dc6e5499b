"""DeepSpeed engine methods that act: a mixin of thin methods over the parts that own each concern.

- ``offload_states`` / ``reload_states``: the ZeRO strategy moves its states to the host and back
  (:mod:`shardwise.zero.offload_states`).
- ``allreduce_gradients``, ``coalesce_grad_reduction``: the strategy reduces the window's gradients
  now (stages 0-1 after backwards under ``no_sync``); ``allreduce_bucket`` / ``allreduce_and_copy`` /
  ``allreduce_no_retain`` / ``buffered_allreduce_fallback`` (with explicit tensors), ``all_gather_scalar``,
  ``sparse_all_gather``: collectives over tensors the caller hands in (:mod:`shardwise.comm.bucket_allreduce`),
  averaged as the config says. ``sparse_allreduce*`` are refused: shardwise reduces gradients densely.

The queries (ranks, groups, DeepCompile, data) are in :mod:`shardwise.runtime.ds_engine_queries`.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Iterator, Sequence
from typing import TYPE_CHECKING, Any

import torch

from shardwise.comm import bucket_allreduce
from shardwise.comm.bucket_allreduce import Averaging
from shardwise.precision.policy import DTYPES
from shardwise.runtime.ds_engine_queries import DeepSpeedEngineQueries

DEFAULT_ALLREDUCE_NUMEL = 500_000_000
"""DeepSpeed's default ``bucket_size`` / ``elements_per_buffer`` / ``numel_per_bucket``."""

_DENSE_ONLY = (
    "shardwise reduces gradients densely (flat buffers at stages 0-2, FSDP2 shards at stage 3; the "
    "sparse_gradients key is inert by design, see config/inert.py), so there are no SparseTensor "
    "gradients to reduce; reduce dense tensors with allreduce_bucket/allreduce_no_retain"
)


class DeepSpeedEngineActions(DeepSpeedEngineQueries):
    """Mixed into :class:`~shardwise.engine.ShardwiseEngine` (which provides ``optimizer``, its ZeRO
    strategy, ``_config``, ``topology``, ``no_sync``, ``_in_no_sync``, ``_require_optimizer`` and
    ``is_gradient_accumulation_boundary``)."""

    optimizer: Any
    _in_no_sync: bool

    if TYPE_CHECKING:  # the engine's own

        def _require_optimizer(self, what: str) -> Any: ...

        def is_gradient_accumulation_boundary(self) -> bool: ...

        def no_sync(self) -> contextlib.AbstractContextManager[None]: ...

    # ------------------------------------------------------------------ offload_states
    def offload_states(
        self,
        include: Iterable[Any] | None = None,
        device: Any = "cpu",
        pin_memory: bool = True,
        non_blocking: bool = False,
    ) -> None:
        """Move the ZeRO states named in ``include`` (``OffloadStateTypeEnum``; default: all) to the
        host, freeing their accelerator memory until :meth:`reload_states` (e.g. between RLHF
        generation and training). Only ``device="cpu"``; refused with ``offload_param`` (as DeepSpeed)."""
        strategy = self._require_optimizer("offload_states")
        strategy.offload_states(
            include=include, device=device, pin_memory=pin_memory, non_blocking=non_blocking
        )

    def reload_states(self, non_blocking: bool = False) -> None:
        """Bring the states :meth:`offload_states` moved back, bit for bit."""
        self._require_optimizer("reload_states").reload_states(non_blocking=non_blocking)

    # ------------------------------------------------------------------ the model's gradients
    def allreduce_gradients(self, bucket_size: int = DEFAULT_ALLREDUCE_NUMEL) -> None:
        """Reduce this accumulation window's gradients now if no backward did (stages 0-1, after
        backwards under ``no_sync()``); nothing before the boundary (DeepSpeed communicates only
        there) or where the backward reduced already. ``bucket_size``: shardwise reduces in the
        ``reduce_bucket_size`` buckets laid out at ``initialize``; another value is refused."""
        strategy = self._require_optimizer("allreduce_gradients")
        if bucket_size != DEFAULT_ALLREDUCE_NUMEL:
            raise ValueError(
                f"allreduce_gradients(bucket_size={bucket_size}): the gradient buckets are laid out at initialize "
                "from zero_optimization.reduce_bucket_size; set it there and call allreduce_gradients() without bucket_size"
            )
        if self._in_no_sync:
            raise RuntimeError("allreduce_gradients() inside no_sync(): leave the context first")
        if self.is_gradient_accumulation_boundary():
            strategy.reduce_pending_gradients()

    @contextlib.contextmanager
    def coalesce_grad_reduction(self) -> Iterator[None]:
        """Backwards inside the block leave their gradients unreduced; leaving it at the accumulation
        boundary reduces them once (one block, then one ``step()``); before the boundary they stay
        accumulated and the window's boundary reduces them all (reducing part of a window early would
        mix reduced and local sums). Where the strategy can hold gradients unreduced (stages 0-1);
        refused where gradients are sharded every micro step (stages 2-3), and with
        ``managed_gradient_accumulation: false`` (as DeepSpeed)."""
        if not self._config.config.managed_gradient_accumulation:
            raise AssertionError(
                "coalesce_grad_reduction() is not supported with managed_gradient_accumulation: false; "
                "step() already ends the accumulation window"
            )
        strategy = self._require_optimizer("coalesce_grad_reduction")
        if not strategy.gradient_sync_toggle:
            raise NotImplementedError(f"coalesce_grad_reduction(): {strategy.gradient_sync_refusal}")
        with self.no_sync():
            yield
        if self.is_gradient_accumulation_boundary():
            strategy.reduce_pending_gradients()

    def buffered_allreduce_fallback(
        self, grads: Sequence[torch.Tensor] | None = None, elements_per_buffer: int = DEFAULT_ALLREDUCE_NUMEL
    ) -> None:
        """Average ``grads`` (dense tensors) over the data-parallel ranks in place, in buckets of
        ``elements_per_buffer`` elements. The model's own gradients (``grads=None``) are refused:
        the ZeRO strategy owns their reduction (:meth:`allreduce_gradients`)."""
        if grads is None:
            raise NotImplementedError(
                "buffered_allreduce_fallback(grads=None): the ZeRO strategy reduces the model's gradients "
                "itself (in backward); call engine.allreduce_gradients(), or pass the tensors to average"
            )
        if any(g.is_sparse for g in grads):
            raise NotImplementedError(f"buffered_allreduce_fallback: {_DENSE_ONLY}")
        topology = self.topology
        self.allreduce_no_retain(
            list(grads), topology.shard_group, elements_per_buffer, topology.shard_size / topology.sp_size
        )

    # ------------------------------------------------------------------ collectives over given tensors
    def _averaging(self) -> Averaging:
        root = self._config.config
        name = root.communication_data_type
        return Averaging(
            op=root.gradient_allreduce_op,
            prescale=root.prescale_gradients,
            predivide_factor=root.gradient_predivide_factor,
            comm_dtype=DTYPES[name] if name else None,
        )

    def allreduce_bucket(
        self, bucket: Sequence[torch.Tensor], dp_group: Any, dp_world_size: float | None = None
    ) -> torch.Tensor:
        """``bucket`` flattened and averaged over ``dp_group`` (the config's averaging and
        ``communication_data_type``); returns the flat result."""
        return bucket_allreduce.allreduce_bucket(bucket, dp_group, self._averaging(), dp_world_size)

    def allreduce_and_copy(
        self, small_bucket: Sequence[torch.Tensor], dp_group: Any, dp_world_size: float | None = None
    ) -> None:
        """:meth:`allreduce_bucket`, written back into the tensors of ``small_bucket``."""
        bucket_allreduce.allreduce_and_copy(small_bucket, dp_group, self._averaging(), dp_world_size)

    def allreduce_no_retain(
        self,
        bucket: Sequence[torch.Tensor],
        dp_group: Any,
        numel_per_bucket: int = DEFAULT_ALLREDUCE_NUMEL,
        dp_world_size: float | None = None,
    ) -> None:
        """:meth:`allreduce_and_copy` over runs of ``bucket`` of just over ``numel_per_bucket`` elements."""
        run: list[torch.Tensor] = []
        numel = 0
        for tensor in bucket:
            run.append(tensor)
            numel += tensor.numel()
            if numel > numel_per_bucket:
                self.allreduce_and_copy(run, dp_group, dp_world_size)
                run, numel = [], 0
        if run:
            self.allreduce_and_copy(run, dp_group, dp_world_size)

    def all_gather_scalar(self, value: torch.Tensor, dp_group: Any) -> list[torch.Tensor]:
        """Every rank's ``value`` (same shape everywhere), one per rank of ``dp_group``."""
        return bucket_allreduce.all_gather_scalar(value, dp_group)

    def sparse_all_gather(self, value: torch.Tensor, dp_group: Any) -> list[torch.Tensor]:
        """Every rank's 1-D or 2-D ``value``, whose first dimension may differ between ranks."""
        return bucket_allreduce.all_gather_rows(value, dp_group)

    def sparse_allreduce(self, sparse: Any, dp_group: Any, dp_world_size: float | None = None) -> Any:
        """Refused: shardwise has no sparse gradients to reduce."""
        raise NotImplementedError(f"sparse_allreduce: {_DENSE_ONLY}")

    def sparse_allreduce_bucket(self, bucket: Any, dp_group: Any, dp_world_size: float | None = None) -> Any:
        """Refused: shardwise has no sparse gradients to reduce."""
        raise NotImplementedError(f"sparse_allreduce_bucket: {_DENSE_ONLY}")

    def sparse_allreduce_no_retain(
        self, bucket: Any, dp_group: Any, dp_world_size: float | None = None
    ) -> None:
        """Refused: shardwise has no sparse gradients to reduce."""
        raise NotImplementedError(f"sparse_allreduce_no_retain: {_DENSE_ONLY}")
