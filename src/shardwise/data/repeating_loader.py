"""``RepeatingLoader``: a loader iterated forever, one pass (and so one epoch) after another
(DeepSpeed's ``deepspeed.utils.RepeatingLoader``)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

from torch.utils.data import DataLoader

if TYPE_CHECKING:
    from shardwise.data.loader import ShardwiseDataLoader

__all__ = ["RepeatingLoader"]


class RepeatingLoader:
    """Iterates a loader forever, starting its next pass (and so its next epoch) at each end.

    The underlying iterator is created lazily, so ``load_state_dict`` on the wrapper (or on the
    loader before the first ``next``) takes effect.

    Example:
        >>> from shardwise.data.loader import build_data_loader
        >>> loader = build_data_loader(list(range(4)), batch_size=2, dp_rank=0, dp_world_size=1)
        >>> it = RepeatingLoader(loader)
        >>> [next(it).tolist() for _ in range(3)] and loader.epoch
        1
    """

    def __init__(self, loader: ShardwiseDataLoader | DataLoader[Any]) -> None:
        self.loader = loader
        self._iterator: Iterator[object] | None = None

    def __iter__(self) -> RepeatingLoader:
        return self

    def __next__(self) -> Any:
        if self._iterator is not None:
            try:
                return next(self._iterator)
            except StopIteration:
                pass
        self._iterator = iter(self.loader)
        try:
            return next(self._iterator)
        except StopIteration:
            # A fresh pass with no batch would make the loop spin forever.
            raise ValueError(
                "RepeatingLoader: the wrapped loader yields no batches (dataset smaller than "
                "one batch with drop_last=True, or empty); use a smaller batch_size or drop_last=False."
            ) from None

    def state_dict(self) -> dict[str, Any]:
        """The wrapped loader's state (``{}`` if it is not Stateful)."""
        get_state = getattr(self.loader, "state_dict", None)
        return get_state() if callable(get_state) else {}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore the wrapped loader; the next ``next()`` resumes from there."""
        self.loader.load_state_dict(state_dict)  # type: ignore[union-attr]
        self._iterator = None
