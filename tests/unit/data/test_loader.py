"""Unit tests for shardwise.data: partitioning, per-epoch reshuffling, resume, RepeatingLoader.

No process group is needed: each rank's loader is built with explicit dp_rank/dp_world_size.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from typing import Any

import pytest
import torch
from torch.distributed.checkpoint.stateful import Stateful
from torch.utils.data import Dataset, IterableDataset, Sampler

from shardwise.data import RepeatingLoader, ShardwiseDataLoader, build_data_loader, num_batches, resume_skip
from shardwise.utils.logging import logger


class CountingDataset(Dataset[int]):
    """Items 0..n-1 that count every read, to prove resume does not read through data.

    The counts live in shared memory so reads made in DataLoader worker processes are seen too.
    """

    def __init__(self, n: int) -> None:
        self.n = n
        self.read_counts = torch.zeros(n, dtype=torch.int64).share_memory_()

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, index: int) -> int:
        self.read_counts[index] += 1
        return index

    def reads(self) -> list[int]:
        return [i for i, count in enumerate(self.read_counts.tolist()) for _ in range(count)]


def flat(batches: list[Any]) -> list[int]:
    return [int(x) for batch in batches for x in batch]


def ranks(n: int = 10, world: int = 2, **kwargs: Any) -> list[ShardwiseDataLoader]:
    return [build_data_loader(list(range(n)), dp_rank=r, dp_world_size=world, **kwargs) for r in range(world)]


def torch_permutation(n: int, seed: int, epoch: int) -> list[int]:
    """The shared permutation torch's DistributedSampler draws for (seed, epoch)."""
    g = torch.Generator()
    g.manual_seed(seed + epoch)
    return torch.randperm(n, generator=g).tolist()


@pytest.fixture
def captured_logs() -> Iterator[list[logging.LogRecord]]:
    records: list[logging.LogRecord] = []

    class Collect(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            records.append(record)

    handler = Collect(level=logging.DEBUG)
    old_level = logger.level
    logger.addHandler(handler)
    logger.setLevel(logging.DEBUG)
    try:
        yield records
    finally:
        logger.removeHandler(handler)
        logger.setLevel(old_level)


# ------------------------------------------------------------------ arithmetic
def test_num_batches_ceil_and_floor() -> None:
    assert num_batches(5, 2, drop_last=False) == 3
    assert num_batches(5, 2, drop_last=True) == 2
    assert num_batches(4, 2, drop_last=False) == num_batches(4, 2, drop_last=True) == 2
    assert num_batches(1, 4, drop_last=True) == 0


def test_resume_skip_same_and_changed_topology() -> None:
    same = {"saved_batch_size": 3, "saved_world_size": 2, "batch_size": 3, "world_size": 2}
    assert resume_skip(batches_consumed=2, samples_consumed=12, **same) == 6
    # 12 global positions consumed, now 4 ranks: each skips the first 3 of its slice.
    assert (
        resume_skip(
            batches_consumed=2,
            samples_consumed=12,
            saved_batch_size=3,
            saved_world_size=2,
            batch_size=1,
            world_size=4,
        )
        == 3
    )
    # Without samples_consumed it is rebuilt from the saved batch shape.
    assert (
        resume_skip(
            batches_consumed=2,
            samples_consumed=None,
            saved_batch_size=3,
            saved_world_size=2,
            batch_size=2,
            world_size=1,
        )
        == 12
    )


# ------------------------------------------------------------------ partitioning
@pytest.mark.parametrize(
    ("n", "drop_last", "per_rank_samples", "expected_len"),
    [
        (10, False, 5, 3),  # ceil(5 / 2)
        (10, True, 5, 2),  # floor(5 / 2): the partial batch is dropped
        (11, False, 6, 3),  # the sampler pads with a repeat so both ranks get 6
        (11, True, 5, 2),  # the sampler drops the tail instead of padding
    ],
)
def test_two_ranks_partition_the_dataset(
    n: int, drop_last: bool, per_rank_samples: int, expected_len: int
) -> None:
    loaders = ranks(n, batch_size=2, drop_last=drop_last)
    seen = [flat(list(loader)) for loader in loaders]
    for loader, items in zip(loaders, seen):
        assert len(loader) == expected_len
        expected_items = expected_len * 2 if drop_last else per_rank_samples
        assert len(items) == expected_items
        assert len(set(items)) == len(items)
    if n == 10:
        # Even split: no overlap, and without drop_last every item is seen exactly once.
        assert not set(seen[0]) & set(seen[1])
        if not drop_last:
            assert sorted(seen[0] + seen[1]) == list(range(10))
    if n == 11 and not drop_last:
        assert set(seen[0]) | set(seen[1]) == set(range(11))  # padding repeats, never omits
    if n == 11 and drop_last:
        assert not set(seen[0]) & set(seen[1])


def test_epoch_order_changes_and_ranks_share_one_permutation() -> None:
    seed = 7
    loaders = ranks(10, batch_size=2, seed=seed)
    orders = []
    for epoch in range(3):
        assert all(loader.epoch == epoch for loader in loaders)
        per_rank = [flat(list(loader)) for loader in loaders]
        # DistributedSampler deals the shared permutation round-robin: rank r gets perm[r::2].
        merged = [x for pair in zip(*per_rank) for x in pair]
        assert merged == torch_permutation(10, seed, epoch)
        orders.append(merged)
    assert orders[0] != orders[1] != orders[2]
    assert all(loader.epoch == 3 for loader in loaders)


def test_abandoned_pass_moves_to_next_epoch_and_set_epoch_rewinds() -> None:
    loader = build_data_loader(list(range(10)), batch_size=2, dp_rank=0, dp_world_size=1, seed=3)
    first = next(iter(loader))
    assert loader.epoch == 0
    assert flat([first]) == torch_permutation(10, 3, 0)[:2]
    assert flat(list(loader)) == torch_permutation(10, 3, 1)
    loader.set_epoch(0)
    assert flat(list(loader)) == torch_permutation(10, 3, 0)


@pytest.mark.parametrize("route", ["eval", "predict"])
def test_eval_and_predict_routes_do_not_shuffle(route: str) -> None:
    loaders = ranks(10, batch_size=2, route=route, shuffle=True)
    for _ in range(2):  # and the order stays the same across epochs
        assert flat(list(loaders[0])) == [0, 2, 4, 6, 8]
        assert flat(list(loaders[1])) == [1, 3, 5, 7, 9]


def test_train_route_shuffles_by_default() -> None:
    loader = build_data_loader(list(range(10)), batch_size=10, dp_rank=0, dp_world_size=1)
    assert flat(list(loader)) == torch_permutation(10, 0, 0) != list(range(10))


def test_collate_fn_is_used() -> None:
    calls: list[list[int]] = []

    def collate(samples: list[int]) -> dict[str, Any]:
        calls.append(list(samples))
        return {"ids": samples, "total": sum(samples)}

    loader = build_data_loader(
        list(range(10)), batch_size=2, dp_rank=0, dp_world_size=1, route="eval", collate_fn=collate
    )
    batches = list(loader)
    assert batches[0] == {"ids": [0, 1], "total": 1}
    assert [b["total"] for b in batches] == [1, 5, 9, 13, 17]
    assert len(calls) == 5


# ------------------------------------------------------------------ state and resume
def test_loader_is_stateful() -> None:
    loader = build_data_loader(list(range(4)), batch_size=2, dp_rank=0, dp_world_size=1)
    assert isinstance(loader, Stateful)
    assert isinstance(RepeatingLoader(loader), Stateful)


def test_state_dict_counts_batches_and_rolls_over_at_epoch_end() -> None:
    loader = build_data_loader(list(range(10)), batch_size=4, dp_rank=0, dp_world_size=1, seed=5)
    it = iter(loader)
    next(it)
    state = loader.state_dict()
    assert (state["epoch"], state["batches_consumed"], state["seed"]) == (0, 1, 5)
    assert state["samples_consumed"] == 4
    list(it)
    state = loader.state_dict()
    assert (state["epoch"], state["batches_consumed"], state["samples_consumed"]) == (1, 0, 0)


@pytest.mark.parametrize("num_workers", [0, 2])
def test_resume_mid_epoch_matches_uninterrupted_run(num_workers: int) -> None:
    kwargs: dict[str, Any] = {"batch_size": 2, "seed": 11, "num_workers": num_workers}
    # The reference runs without workers: the order must not depend on them.
    reference = [
        build_data_loader(CountingDataset(10), dp_rank=r, dp_world_size=2, batch_size=2, seed=11)
        for r in range(2)
    ]
    expected = [[flat(list(loader)) for _ in range(2)] for loader in reference]  # [rank][epoch]

    for rank in range(2):
        first = build_data_loader(CountingDataset(10), dp_rank=rank, dp_world_size=2, **kwargs)
        list(first)  # epoch 0
        it = iter(first)
        consumed = [next(it), next(it)]  # two batches into epoch 1
        state = first.state_dict()
        assert (state["epoch"], state["batches_consumed"]) == (1, 2)

        dataset = CountingDataset(10)
        resumed = build_data_loader(dataset, dp_rank=rank, dp_world_size=2, **kwargs)
        resumed.load_state_dict(state)
        assert resumed.epoch == 1
        rest = list(resumed)
        assert flat(consumed) + flat(rest) == expected[rank][1]
        # The consumed batches were skipped in the sampler, not read through the dataset.
        assert dataset.reads() == sorted(flat(rest))
        assert resumed.epoch == 2 and resumed.state_dict()["batches_consumed"] == 0


def test_resume_on_another_world_size_continues_the_shared_permutation() -> None:
    seed = 2
    saved = ranks(10, batch_size=2, seed=seed)
    for loader in saved:
        next(iter(loader))  # one batch each: global positions 0..3 consumed
    state = saved[0].state_dict()
    assert state["samples_consumed"] == 4

    single = build_data_loader(list(range(10)), batch_size=3, dp_rank=0, dp_world_size=1, seed=seed)
    single.load_state_dict(state)
    assert flat(list(single)) == torch_permutation(10, seed, 0)[4:]


def test_load_state_dict_adopts_saved_seed_and_validates(captured_logs: list[logging.LogRecord]) -> None:
    loader = build_data_loader(list(range(10)), batch_size=10, dp_rank=0, dp_world_size=1, seed=0)
    loader.load_state_dict({"epoch": 2, "batches_consumed": 0, "seed": 9})
    assert flat(list(loader)) == torch_permutation(10, 9, 2)
    assert any("seed" in r.getMessage() for r in captured_logs)
    with pytest.raises(ValueError, match="missing 'epoch'"):
        loader.load_state_dict({"batches_consumed": 0})
    with pytest.raises(ValueError, match="must be >= 0"):
        loader.load_state_dict({"epoch": 0, "batches_consumed": -1})


def test_load_state_dict_supersedes_a_live_iterator() -> None:
    loader = build_data_loader(list(range(8)), batch_size=2, dp_rank=0, dp_world_size=1, route="eval")
    stale = iter(loader)
    next(stale)
    loader.load_state_dict({"epoch": 0, "batches_consumed": 3})
    live = iter(loader)  # the resumed pass started by a fresh iter(): the stale iterator just ends
    assert list(stale) == []
    assert flat(list(live)) == [6, 7]


@pytest.mark.parametrize("advanced", [0, 1])
def test_an_iterator_made_before_a_load_goes_on_from_the_restored_position(advanced: int) -> None:
    """``it = iter(loader)`` before ``load_checkpoint`` (advanced or not): ``next(it)`` continues from
    the checkpoint's position, it does not end the epoch silently."""
    loader = build_data_loader(list(range(8)), batch_size=2, dp_rank=0, dp_world_size=1, route="eval")
    early = iter(loader)
    for _ in range(advanced):
        next(early)
    loader.load_state_dict({"epoch": 0, "batches_consumed": 2})
    assert flat(list(early)) == [4, 5, 6, 7]
    assert loader.state_dict()["epoch"] == 1  # the resumed pass ran to its end


# ------------------------------------------------------------------ RepeatingLoader
def test_repeating_loader_crosses_epochs() -> None:
    loader = build_data_loader(list(range(10)), batch_size=4, dp_rank=0, dp_world_size=1, seed=1)
    repeating = RepeatingLoader(loader)
    batches = [next(repeating) for _ in range(7)]  # 3 batches per epoch (4 + 4 + 2)
    assert flat(batches[:3]) == torch_permutation(10, 1, 0)
    assert flat(batches[3:6]) == torch_permutation(10, 1, 1)
    assert flat(batches[6:]) == torch_permutation(10, 1, 2)[:4]
    assert loader.epoch == 2
    assert repeating.state_dict()["batches_consumed"] == 1


def test_repeating_loader_resumes_through_its_state_dict() -> None:
    def make() -> RepeatingLoader:
        return RepeatingLoader(
            build_data_loader(list(range(6)), batch_size=2, dp_rank=0, dp_world_size=1, seed=4)
        )

    reference = make()
    expected = flat([next(reference) for _ in range(8)])
    first = make()
    head = flat([next(first) for _ in range(4)])  # one batch into epoch 1
    second = make()
    second.load_state_dict(first.state_dict())
    assert head + flat([next(second) for _ in range(4)]) == expected


def test_repeating_loader_rejects_a_loader_without_batches() -> None:
    loader = build_data_loader(list(range(3)), batch_size=4, dp_rank=0, dp_world_size=1, drop_last=True)
    with pytest.raises(ValueError, match="yields no batches"):
        next(RepeatingLoader(loader))


# ------------------------------------------------------------------ other inputs
class Stream(IterableDataset[int]):
    def __init__(self, n: int) -> None:
        self.n = n
        self.epochs: list[int] = []

    def set_epoch(self, epoch: int) -> None:
        self.epochs.append(epoch)

    def __iter__(self) -> Iterator[int]:
        return iter(range(self.n))

    def __len__(self) -> int:
        return self.n


def test_iterable_dataset_passes_through_with_a_note(captured_logs: list[logging.LogRecord]) -> None:
    stream = Stream(5)
    loader = build_data_loader(stream, batch_size=2, dp_rank=1, dp_world_size=2)
    assert loader.sampler is None
    assert any("IterableDataset" in r.getMessage() and r.levelno == logging.WARNING for r in captured_logs)
    assert len(loader) == 3
    assert flat(list(loader)) == [0, 1, 2, 3, 4]  # the dataset's own order, unsharded
    assert flat(list(loader)) == [0, 1, 2, 3, 4]
    assert stream.epochs == [0, 1]


def test_custom_data_sampler_is_used_and_gets_set_epoch() -> None:
    class Reversed(Sampler[int]):
        def __init__(self) -> None:
            self.epochs: list[int] = []

        def set_epoch(self, epoch: int) -> None:
            self.epochs.append(epoch)

        def __iter__(self) -> Iterator[int]:
            return iter(range(9, -1, -1))

        def __len__(self) -> int:
            return 10

    sampler = Reversed()
    loader = build_data_loader(
        list(range(10)), batch_size=4, dp_rank=0, dp_world_size=2, data_sampler=sampler
    )
    assert len(loader) == 3
    assert flat(list(loader)) == list(range(9, -1, -1))
    loader.load_state_dict({"epoch": 1, "batches_consumed": 2})
    assert flat(list(loader)) == [1, 0]
    assert sampler.epochs == [0, 1]


def test_iterating_does_not_touch_the_global_rng() -> None:
    loader = build_data_loader(list(range(10)), batch_size=2, dp_rank=0, dp_world_size=1)
    torch.manual_seed(123)
    expected = torch.rand(3)
    torch.manual_seed(123)
    list(loader)
    assert torch.equal(torch.rand(3), expected)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"route": "training"}, "route='training'"),
        ({"batch_size": 0}, "batch_size must be a positive integer"),
        ({"dp_rank": 2}, r"dp_rank=2 is outside \[0, 2\)"),
        ({"dp_world_size": 0, "dp_rank": 0}, "dp_world_size must be >= 1"),
        ({"num_workers": -1}, "num_workers must be >= 0"),
    ],
)
def test_invalid_arguments_raise_value_error(kwargs: dict[str, Any], match: str) -> None:
    args: dict[str, Any] = {"batch_size": 2, "dp_rank": 0, "dp_world_size": 2, **kwargs}
    with pytest.raises(ValueError, match=match):
        build_data_loader(list(range(10)), **args)


def test_data_sampler_with_iterable_dataset_is_rejected() -> None:
    with pytest.raises(ValueError, match="data_sampler cannot be used with an IterableDataset"):
        build_data_loader(
            Stream(4),
            batch_size=2,
            dp_rank=0,
            dp_world_size=1,
            data_sampler=iter([0, 1]),  # type: ignore[arg-type]
        )
