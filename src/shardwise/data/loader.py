"""The data-parallel data loader behind ``engine.deepspeed_io`` (spec section 6.3).

Each data-parallel rank reads its own slice of a map-style dataset through a
:class:`~torch.utils.data.DistributedSampler`, like DeepSpeed's loader, with two deliberate
differences:

* **A new order every epoch.** DeepSpeed never calls ``sampler.set_epoch``, so every epoch
  repeats the first epoch's permutation. We call ``set_epoch(epoch)`` at the start of every
  pass. All ranks still share one permutation per epoch (it depends only on ``seed + epoch``),
  so the ranks' slices never overlap.
* **Exact mid-epoch resume.** The loader is ``Stateful``: ``state_dict()`` records the epoch
  and the batches handed out, and after ``load_state_dict()`` the next pass starts at the very
  next batch. The consumed positions are skipped in the *sampler* (cheap integer work), never by
  loading and discarding samples through the dataset.

The arithmetic (batch counts, resume offsets, worker seeds) lives in small pure functions
(:mod:`shardwise.data.loader_arithmetic`) so it can be tested without a process group.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterator, Sized
from typing import Any

import torch
from torch.utils.data import DataLoader, Dataset, DistributedSampler, IterableDataset, Sampler

from shardwise.data.loader_arithmetic import num_batches, resume_skip, worker_base_seed
from shardwise.data.repeating_loader import RepeatingLoader as RepeatingLoader  # re-exported: its old home
from shardwise.utils.logging import logger

ROUTES = ("train", "eval", "predict")
"""Routes accepted by :func:`build_data_loader`; only ``"train"`` shuffles (as in DeepSpeed)."""


# --------------------------------------------------------------------------- sampler wrapper
class _SkippingSampler(Sampler[int]):
    """Wraps an index sampler and drops the first ``skip`` indices it yields in the next pass.

    Skipping happens on the indices only, so no sample is ever loaded to be thrown away.
    The DataLoader iterates its sampler in the main process, even with worker processes, so
    setting ``skip`` when a pass starts (before its first batch is requested) is enough.
    """

    def __init__(self, inner: Sampler[int]) -> None:
        self.inner = inner
        self.skip = 0

    def __iter__(self) -> Iterator[int]:
        return itertools.islice(iter(self.inner), self.skip, None)

    def __len__(self) -> int:
        return max(len(self.inner) - self.skip, 0)  # type: ignore[arg-type]


# --------------------------------------------------------------------------- the loader
class ShardwiseDataLoader:
    """One data-parallel rank's loader: a reshuffled slice of the dataset each epoch.

    Each ``iter()`` starts a pass. A pass that ran to the end advances ``epoch``; a pass that
    was abandoned part-way is finished implicitly when the next one starts (the next ``iter()``
    begins the following epoch), except right after :meth:`load_state_dict`, when the next
    pass resumes the saved epoch at its next batch. Only one pass may be live at a time.

    ``len()`` is the number of batches in a full epoch on this rank, whatever has been
    consumed: ``ceil(len(sampler) / batch_size)``, or a floor with ``drop_last``.

    A resumed pass yields exactly the batches the interrupted one would have. With worker
    processes, random transforms inside the dataset may still differ after a resume: torch seeds
    worker ``w`` from the pass's base seed and hands it every ``num_workers``-th batch counted
    from the first batch *of the pass*, so the batch-to-worker assignment shifts.

    Attributes:
        dataset: The wrapped dataset.
        batch_size: Samples per batch on this rank (the micro-batch size).
        sampler: The index sampler (a ``DistributedSampler`` unless ``data_sampler`` was given);
            ``None`` for iterable datasets.
        dataloader: The underlying ``torch.utils.data.DataLoader``.
    """

    def __init__(
        self,
        dataset: Dataset[Any] | Any,
        *,
        batch_size: int,
        dp_rank: int,
        dp_world_size: int,
        sampler: Sampler[int] | None,
        seed: int,
        drop_last: bool,
        collate_fn: Callable[[list[Any]], Any] | None,
        num_workers: int,
        pin_memory: bool,
    ) -> None:
        self.dataset = dataset
        self.batch_size = batch_size
        self.dp_rank = dp_rank
        self.dp_world_size = dp_world_size
        self.sampler = sampler
        self.seed = seed
        self.drop_last = drop_last

        self._epoch = 0
        self._resumed_batches = 0  # batches of this epoch consumed before this pass (a resume)
        self._pass_batches = 0  # batches handed out by the current pass
        self._skip = 0  # this rank's sampler positions skipped at the start of the current pass
        self._pass_started = False  # a pass of `_epoch` has begun (and not run to its end)
        self._resume_pending = False  # load_state_dict() asked the next pass to resume
        self._pass_id = 0  # tells a stale iterator from the live one
        self._handover_pass = -1  # the pass that was live when load_state_dict() moved the position

        self._generator = torch.Generator()
        self._skipper = _SkippingSampler(sampler) if sampler is not None else None
        # engine.set_data_post_process_func: fn(batch, sampler.post_process_state()) -> batch
        self.post_process_func: Callable[[Any, dict[str, Any]], Any] | None = None
        self.dataloader: DataLoader[object] = DataLoader(
            dataset,
            batch_size=batch_size,
            sampler=self._skipper,
            collate_fn=collate_fn,
            num_workers=num_workers,
            pin_memory=pin_memory,
            drop_last=drop_last,
            generator=self._generator,
        )

    # ----------------------------------------------------------------- public state
    @property
    def epoch(self) -> int:
        """The epoch of the pass in progress, or of the next pass if none is in progress."""
        return self._epoch

    def set_epoch(self, epoch: int) -> None:
        """Make the next pass start ``epoch`` from its first batch.

        For training loops that count epochs themselves, like a plain ``DistributedSampler``.
        """
        if epoch < 0:
            raise ValueError(f"set_epoch: epoch must be >= 0, got {epoch}.")
        self._epoch = epoch
        self._reset_position()
        self._pass_started = False
        self._resume_pending = False
        self._pass_id += 1  # any iterator still alive belongs to the old position

    def __len__(self) -> int:
        if self.sampler is not None:
            return num_batches(len(self.sampler), self.batch_size, self.drop_last)  # type: ignore[arg-type]
        if isinstance(self.dataset, Sized):
            return num_batches(len(self.dataset), self.batch_size, self.drop_last)
        raise TypeError(f"{type(self.dataset).__name__} has no __len__, so the number of batches is unknown.")

    # ----------------------------------------------------------------- iteration
    def __iter__(self) -> Iterator[Any]:
        if self._resume_pending:
            self._resume_pending = False
            self._pass_batches = 0
        elif self._pass_started:
            # The previous pass was abandoned part-way: treat it as finished.
            self._epoch += 1
            self._reset_position()
        self._pass_started = True
        self._pass_id += 1

        if self.sampler is not None and hasattr(self.sampler, "set_epoch"):
            self.sampler.set_epoch(self._epoch)
        elif self.sampler is None and hasattr(self.dataset, "set_epoch"):
            self.dataset.set_epoch(self._epoch)  # iterable datasets that reshuffle themselves
        self._generator.manual_seed(worker_base_seed(self.seed, self._epoch, self.dp_rank))

        if self._skipper is not None:
            self._skipper.skip = self._skip
            batches: Iterator[object] = iter(self.dataloader)
        else:
            batches = iter(self.dataloader)
            if self._resumed_batches:
                # An iterable dataset cannot be indexed, so the only way forward is through it.
                logger.warning(
                    "Resuming an IterableDataset at batch %d of epoch %d by reading and discarding "
                    "the consumed batches; a resumable dataset should restore its own position.",
                    self._resumed_batches,
                    self._epoch,
                )
                batches = itertools.islice(batches, self._resumed_batches, None)
        return self._run_pass(batches, self._pass_id)

    def _run_pass(self, batches: Iterator[object], pass_id: int) -> Iterator[object]:
        for batch in batches:
            if pass_id != self._pass_id:
                if pass_id == self._handover_pass and self._resume_pending:
                    # An iterator made before load_checkpoint (``it = iter(loader)`` at the top of a
                    # script): it goes on from the restored position instead of ending silently.
                    logger.info("Data loader: an iterator made before the checkpoint load resumes at its position")
                    yield from iter(self)
                return  # a newer pass (or a load_state_dict) superseded this iterator
            # Count before yielding: once the caller holds the batch, it is consumed.
            self._pass_batches += 1
            if self.post_process_func is not None:
                batch = self.post_process_func(batch, self.sampler.post_process_state())  # type: ignore[union-attr]
            yield batch
        if pass_id == self._pass_id:
            self._epoch += 1
            self._reset_position()
            self._pass_started = False

    def _reset_position(self) -> None:
        self._resumed_batches = 0
        self._pass_batches = 0
        self._skip = 0

    # ----------------------------------------------------------------- Stateful
    @property
    def batches_consumed(self) -> int:
        """Batches of the current epoch handed out on this rank (resumed ones included)."""
        return self._resumed_batches + self._pass_batches

    def _positions_consumed(self) -> int:
        """This rank's sampler positions consumed in the current epoch."""
        consumed = self._skip + self._pass_batches * self.batch_size
        if self.sampler is not None:
            consumed = min(consumed, len(self.sampler))  # type: ignore[arg-type]
        return consumed

    def state_dict(self) -> dict[str, int]:
        """The loader's position: enough to resume at the next batch.

        Returns:
            ``epoch``, ``batches_consumed`` (in that epoch, on this rank), ``seed``, and for
            resuming on another topology ``samples_consumed`` (positions of the epoch's shared
            permutation consumed by all ranks together), ``batch_size`` and ``dp_world_size``.
        """
        return {
            "epoch": self._epoch,
            "batches_consumed": self.batches_consumed,
            "seed": self.seed,
            "samples_consumed": self._positions_consumed() * self.dp_world_size,
            "batch_size": self.batch_size,
            "dp_world_size": self.dp_world_size,
        }

    def load_state_dict(self, state_dict: dict[str, int]) -> None:
        """Restore a position saved by :meth:`state_dict`; the next ``iter()`` resumes there.

        A checkpoint taken with another batch size or data-parallel world size resumes from
        ``samples_consumed`` (see :func:`resume_skip`). The saved seed replaces the loader's own,
        because the order being resumed was drawn from it.

        Raises:
            ValueError: If a required key is missing or a value is negative.
        """
        for key in ("epoch", "batches_consumed"):
            if key not in state_dict:
                raise ValueError(
                    f"Data loader state_dict is missing {key!r} (got keys {sorted(state_dict)}); "
                    "pass a dict produced by ShardwiseDataLoader.state_dict()."
                )
            if int(state_dict[key]) < 0:
                raise ValueError(f"Data loader state_dict[{key!r}] must be >= 0, got {state_dict[key]}.")
        epoch = int(state_dict["epoch"])
        batches = int(state_dict["batches_consumed"])
        saved_seed = state_dict.get("seed")
        if saved_seed is not None and int(saved_seed) != self.seed:
            logger.warning(
                "Data loader seed %d replaced by the checkpoint's seed %d to resume its order.",
                self.seed,
                int(saved_seed),
            )
            self.seed = int(saved_seed)
            if isinstance(self.sampler, DistributedSampler):
                self.sampler.seed = self.seed

        saved_batch = int(state_dict.get("batch_size", self.batch_size))
        saved_world = int(state_dict.get("dp_world_size", self.dp_world_size))
        samples = state_dict.get("samples_consumed")
        skip = resume_skip(
            batches_consumed=batches,
            samples_consumed=None if samples is None else int(samples),
            saved_batch_size=saved_batch,
            saved_world_size=saved_world,
            batch_size=self.batch_size,
            world_size=self.dp_world_size,
        )
        if (saved_batch, saved_world) != (self.batch_size, self.dp_world_size):
            logger.info(
                "Data loader resumes a checkpoint from batch_size=%d, dp_world_size=%d on "
                "batch_size=%d, dp_world_size=%d: skipping %d positions per rank.",
                saved_batch,
                saved_world,
                self.batch_size,
                self.dp_world_size,
                skip,
            )
            batches = skip // self.batch_size
        self._epoch = epoch
        self._resumed_batches = batches
        self._pass_batches = 0
        self._skip = skip
        self._pass_started = False
        self._resume_pending = True
        self._handover_pass = self._pass_id
        self._pass_id += 1  # any iterator still alive belongs to the old position


# --------------------------------------------------------------------------- the builder
def build_data_loader(
    dataset: Dataset[Any] | Any,
    *,
    batch_size: int,
    dp_rank: int,
    dp_world_size: int,
    shuffle: bool = True,
    seed: int = 0,
    drop_last: bool = False,
    collate_fn: Callable[[list[Any]], Any] | None = None,
    num_workers: int = 0,
    pin_memory: bool = False,
    data_sampler: Sampler[int] | None = None,
    route: str = "train",
) -> ShardwiseDataLoader:
    """Build one data-parallel rank's loader over ``dataset``.

    Args:
        dataset: A map-style dataset (anything with ``__len__`` and ``__getitem__``) or a
            ``torch.utils.data.IterableDataset``. Iterable datasets get no sampler: sharding
            them across ranks is the dataset's job.
        batch_size: Samples per batch on this rank (DeepSpeed's micro-batch per GPU).
        dp_rank: This rank's index in the data-parallel group.
        dp_world_size: Size of the data-parallel group.
        shuffle: Shuffle on the ``"train"`` route (``"eval"``/``"predict"`` never shuffle).
        seed: Seed of the shared permutation; the same on every rank.
        drop_last: Give every rank the same number of full batches: the sampler drops the tail
            instead of padding with repeats, and the loader drops a last partial batch.
        collate_fn: Merges a list of samples into a batch; torch's default when ``None``.
        num_workers: Loader worker processes. The default is 0, not DeepSpeed's 2 per device:
            our CPU ranks run on a 2-core machine, where worker processes would steal the cores
            that the ranks' own compute threads need.
        pin_memory: Pin host memory for faster device copies (useful only with an accelerator).
        data_sampler: An index sampler used instead of the ``DistributedSampler``; it must do
            its own sharding. ``set_epoch`` is called on it if it has one.
        route: ``"train"``, ``"eval"`` or ``"predict"``.

    Returns:
        The loader; it is ``Stateful`` and reshuffles on every epoch.

    Raises:
        ValueError: On an unknown route, a non-positive batch size, a rank outside
            ``[0, dp_world_size)``, a negative ``num_workers``, or a ``data_sampler`` given with an
            iterable dataset.

    Example:
        >>> a = build_data_loader(list(range(10)), batch_size=2, dp_rank=0, dp_world_size=2)
        >>> b = build_data_loader(list(range(10)), batch_size=2, dp_rank=1, dp_world_size=2)
        >>> len(a), len(b)
        (3, 3)
        >>> seen = [int(x) for batch in [*a, *b] for x in batch]
        >>> sorted(seen) == list(range(10))
        True
    """
    if route not in ROUTES:
        raise ValueError(f"build_data_loader: route={route!r} is not one of {list(ROUTES)}.")
    if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
        raise ValueError(
            f"build_data_loader: batch_size must be a positive integer, got {batch_size!r}; "
            "set train_micro_batch_size_per_gpu in the config or pass batch_size."
        )
    if dp_world_size < 1:
        raise ValueError(f"build_data_loader: dp_world_size must be >= 1, got {dp_world_size}.")
    if not 0 <= dp_rank < dp_world_size:
        raise ValueError(
            f"build_data_loader: dp_rank={dp_rank} is outside [0, {dp_world_size}) for "
            f"dp_world_size={dp_world_size}."
        )
    if num_workers < 0:
        raise ValueError(f"build_data_loader: num_workers must be >= 0, got {num_workers}.")

    sampler: Sampler[int] | None
    if isinstance(dataset, IterableDataset):
        if data_sampler is not None:
            raise ValueError(
                "build_data_loader: data_sampler cannot be used with an IterableDataset, which "
                "chooses its own order; drop data_sampler or use a map-style dataset."
            )
        log = logger.warning if dp_world_size > 1 else logger.info
        log(
            "build_data_loader: %s is an IterableDataset, so no DistributedSampler is used; "
            "sharding it across the %d data-parallel ranks is the dataset's job "
            "(e.g. read torch.utils.data.get_worker_info() and the rank).",
            type(dataset).__name__,
            dp_world_size,
        )
        sampler = None
    elif data_sampler is not None:
        sampler = data_sampler
    else:
        if not hasattr(dataset, "__len__"):
            raise ValueError(
                f"build_data_loader: {type(dataset).__name__} has no __len__; a map-style dataset "
                "needs __len__ and __getitem__, or subclass torch.utils.data.IterableDataset."
            )
        sampler = DistributedSampler(
            dataset,
            num_replicas=dp_world_size,
            rank=dp_rank,
            shuffle=shuffle and route == "train",
            seed=seed,
            drop_last=drop_last,
        )

    return ShardwiseDataLoader(
        dataset,
        batch_size=batch_size,
        dp_rank=dp_rank,
        dp_world_size=dp_world_size,
        sampler=sampler,
        seed=seed,
        drop_last=drop_last,
        collate_fn=collate_fn,
        num_workers=num_workers,
        pin_memory=pin_memory,
    )
