"""``profile`` and ``synchronize_checkpoint_boundary``: what happens at a checkpoint's boundaries.

:class:`Boundaries` wraps the checkpointed function. Its first call is the forward, every
later call a recompute (in backward); it synchronizes the device before and after each when
``synchronize_checkpoint_boundary`` is on, and with ``profile`` adds each call's wall time to
:data:`TIMES`, which the engine's wall-clock breakdown reports (``act_ckpt_forward`` and
``act_ckpt_recompute`` in ``engine.get_wall_clock_timers()``, and a line at each print).

Example:
    >>> TIMES.reset()
    >>> run = Boundaries(lambda x: x + 1, profile=True, synchronize=False, tracked={})
    >>> run(1), run(1), (TIMES.forward_calls, TIMES.recompute_calls)
    (2, 2, (1, 1))
"""

from __future__ import annotations

import time
from collections.abc import Callable

import torch

__all__ = ["TIMES", "Boundaries", "CheckpointTimes", "synchronize_device"]


def synchronize_device() -> None:
    """Wait for the accelerator's queued work (nothing to wait for on CPU)."""
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.synchronize()


class CheckpointTimes:
    """Forward and recompute wall time of checkpointed blocks, per accumulation window (ms)."""

    def __init__(self) -> None:
        self.reset()

    def reset(self) -> None:
        """Zero everything."""
        self.forward_ms = 0.0
        self.recompute_ms = 0.0
        self.forward_calls = 0
        self.recompute_calls = 0
        self.last_window: dict[str, float] = {}

    def add(self, recompute: bool, elapsed_ms: float) -> None:
        """One call's time."""
        if recompute:
            self.recompute_ms += elapsed_ms
            self.recompute_calls += 1
        else:
            self.forward_ms += elapsed_ms
            self.forward_calls += 1

    def end_window(self) -> dict[str, float]:
        """Close a window: its totals (ms), kept as ``last_window``; the counters start again."""
        self.last_window = {"act_ckpt_forward": self.forward_ms, "act_ckpt_recompute": self.recompute_ms}
        self.forward_ms = self.recompute_ms = 0.0
        return dict(self.last_window)


TIMES = CheckpointTimes()
"""The process's checkpoint times (filled only while ``profile`` is on)."""


class Boundaries:
    """The checkpointed function with RNG-tracker replay, device syncs and timing around each call.

    Args:
        function: the user's block.
        profile: time each call into :data:`TIMES`.
        synchronize: synchronize the device before and after each call.
        tracked: the RNG tracker's streams at the forward (restored for every recompute);
            torch.utils.checkpoint restores the CPU and CUDA generators but not these.
        drop_last: calls receive one extra trailing argument to drop (the reentrant path's
            grad-requiring dummy, see ``recompute.py``).
    """

    def __init__(
        self,
        function: Callable[..., object],
        *,
        profile: bool,
        synchronize: bool,
        tracked: dict[str, torch.Tensor],
        drop_last: bool = False,
    ) -> None:
        self.function = function
        self.profile = profile
        self.synchronize = synchronize
        self.tracked = tracked
        self.drop_last = drop_last
        self.calls = 0

    def __call__(self, *args: object) -> object:
        from shardwise.checkpointing.rng import tracker_restored

        recompute = self.calls > 0
        self.calls += 1
        if self.drop_last:
            args = args[:-1]
        if self.synchronize:
            synchronize_device()
        start = time.perf_counter() if self.profile else 0.0
        # try/finally: torch's non-reentrant recompute stops early by raising once it has every
        # tensor backward needs; that recompute is still timed and synchronized.
        try:
            if recompute and self.tracked:
                with tracker_restored(self.tracked):
                    return self.function(*args)
            return self.function(*args)
        finally:
            if self.synchronize or (self.profile and torch.cuda.is_available()):
                synchronize_device()
            if self.profile:
                TIMES.add(recompute, (time.perf_counter() - start) * 1000.0)
