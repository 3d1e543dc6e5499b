"""RNG state for activation checkpointing: the Megatron-style tracker and one snapshot type.

The recompute of a checkpointed block must draw exactly the random numbers its first forward
drew (dropout masks above all). ``torch.utils.checkpoint`` saves and restores the CPU
generator and the generators of the CUDA devices its inputs live on; Megatron-style models
also draw from *named* generators kept by an RNG tracker (``get_cuda_rng_tracker().fork()``,
the ``'model-parallel-rng'`` stream seeded per tensor-parallel rank). torch knows nothing of
those, so the checkpoint also restores the tracker's states (:func:`tracker_restored`) for
the recompute, while torch restores the CPU and CUDA generators.

The tracker keeps its states for the default accelerator generator: CUDA when it is
available, the CPU generator otherwise, so Megatron-style code runs unchanged on CPU.

Example:
    >>> import torch
    >>> model_parallel_cuda_manual_seed(1234)
    >>> with get_cuda_rng_tracker().fork():
    ...     a = torch.rand(2)
    >>> get_cuda_rng_tracker().get_states().keys() == {MODEL_PARALLEL_RNG}
    True
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch

__all__ = [
    "MODEL_PARALLEL_RNG",
    "RngStatesTracker",
    "get_cuda_rng_tracker",
    "model_parallel_cuda_manual_seed",
    "model_parallel_reconfigure_tp_seed",
    "tracker_restored",
]

MODEL_PARALLEL_RNG = "model-parallel-rng"
"""DeepSpeed's and Megatron's name of the tensor-parallel RNG stream."""

_MODEL_PARALLEL_SEED_OFFSET = 2718  # spec 6.6: seed + 2718 + tensor-parallel rank


def _uses_cuda() -> bool:
    return torch.cuda.is_available()


def _get_state() -> torch.Tensor:
    return torch.cuda.get_rng_state() if _uses_cuda() else torch.get_rng_state()


def _set_state(state: torch.Tensor) -> None:
    if _uses_cuda():
        torch.cuda.set_rng_state(state)
    else:
        torch.set_rng_state(state)


def _manual_seed(seed: int) -> None:
    if _uses_cuda():
        torch.cuda.manual_seed(seed)
    else:
        torch.manual_seed(seed)


class RngStatesTracker:
    """Named generator states (Megatron's ``CudaRNGStatesTracker``), on CUDA or on CPU.

    ``add(name, seed)`` creates a stream; ``fork(name)`` runs a block with that stream's
    state swapped into the default generator and keeps what the block advanced it to.
    """

    def __init__(self) -> None:
        self.states_: dict[str, torch.Tensor] = {}
        self.seeds_: set[int] = set()

    def reset(self) -> None:
        """Forget every stream."""
        self.states_ = {}
        self.seeds_ = set()

    def get_states(self) -> dict[str, torch.Tensor]:
        """A copy of every stream's state (name -> state)."""
        return {name: state.clone() for name, state in self.states_.items()}

    def set_states(self, states: dict[str, torch.Tensor]) -> None:
        """Replace the streams with ``states`` (from :meth:`get_states`)."""
        self.states_ = {name: state.clone() for name, state in states.items()}

    def add(self, name: str, seed: int) -> None:
        """Create stream ``name`` seeded with ``seed``; the default generator is left as it was.

        Raises:
            ValueError: the seed or the name is already in use.
        """
        if seed in self.seeds_:
            raise ValueError(f"seed {seed} already exists in the RNG tracker")
        if name in self.states_:
            raise ValueError(f"RNG state {name!r} already exists in the tracker")
        self.seeds_.add(seed)
        original = _get_state()
        _manual_seed(seed)
        self.states_[name] = _get_state()
        _set_state(original)

    @contextlib.contextmanager
    def fork(self, name: str = MODEL_PARALLEL_RNG) -> Iterator[None]:
        """Draw from stream ``name`` inside the block, then restore the default generator.

        Raises:
            KeyError: no stream of that name (call :func:`model_parallel_cuda_manual_seed`).
        """
        if name not in self.states_:
            raise KeyError(
                f"RNG state {name!r} is not in the tracker; call "
                "shardwise.checkpointing.model_parallel_cuda_manual_seed(seed) first"
            )
        original = _get_state()
        _set_state(self.states_[name])
        try:
            yield
        finally:
            self.states_[name] = _get_state()
            _set_state(original)


_TRACKER = RngStatesTracker()


def get_cuda_rng_tracker() -> RngStatesTracker:
    """The process's RNG tracker (DeepSpeed's and Megatron's name; works on CPU too)."""
    return _TRACKER


def model_parallel_cuda_manual_seed(seed: int, tp_rank: int | None = None) -> None:
    """Seed the default generator with ``seed`` and the tracked ``'model-parallel-rng'`` stream
    with ``seed + 2718 + tp_rank`` (spec 6.6), the tracker being reset first.

    Args:
        seed: the data-parallel seed (the same on every rank of a model replica).
        tp_rank: the tensor-parallel rank; by default the model-parallel rank of the ``mpu``
            given to :func:`shardwise.checkpointing.configure` (0 without one).
    """
    if tp_rank is None:
        from shardwise.checkpointing.settings import current_settings

        tp_rank = current_settings().mp_rank
    _TRACKER.reset()
    _manual_seed(seed)
    _TRACKER.add(MODEL_PARALLEL_RNG, seed + _MODEL_PARALLEL_SEED_OFFSET + tp_rank)


def model_parallel_reconfigure_tp_seed(seed: int, tp_rank: int | None = None) -> None:
    """Reseed only the tracked ``'model-parallel-rng'`` stream with ``seed + 2718 + tp_rank``;
    the default generator and the other streams are left as they are (DeepSpeed's
    ``model_parallel_reconfigure_tp_seed``, which Megatron calls when the TP seed changes).

    Args:
        seed: the new base seed.
        tp_rank: the tensor-parallel rank; by default the model-parallel rank of the ``mpu``
            given to :func:`shardwise.checkpointing.configure` (0 without one).

    Raises:
        KeyError: the stream does not exist yet (call :func:`model_parallel_cuda_manual_seed` first).
    """
    if tp_rank is None:
        from shardwise.checkpointing.settings import current_settings

        tp_rank = current_settings().mp_rank
    with _TRACKER.fork(MODEL_PARALLEL_RNG):
        _manual_seed(seed + _MODEL_PARALLEL_SEED_OFFSET + tp_rank)


@contextlib.contextmanager
def tracker_restored(states: dict[str, torch.Tensor]) -> Iterator[None]:
    """Run a block with the tracker's streams set to ``states``; put the current ones back after."""
    now = _TRACKER.get_states()
    _TRACKER.set_states(states)
    try:
        yield
    finally:
        _TRACKER.set_states(now)
