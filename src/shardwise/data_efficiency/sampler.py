"""The curriculum sampler behind ``data_efficiency.data_sampling.curriculum_learning``.

Like DeepSpeed's ``DeepSpeedDataSampler`` it draws whole global batches
(``micro_batch x data-parallel size x accumulation steps`` samples): before each one the
curriculum step advances by one and every metric's difficulty is updated; when one changes, the
samples that every metric now admits and that no earlier cluster holds become a new *cluster*
(shuffled). A batch takes from each cluster a share drawn in proportion to cluster sizes,
reading each cluster in its shuffled order and reshuffling it when it runs out. So no sample is
ever drawn before every metric admits it, and once the difficulties reach their maxima every
sample belongs to a cluster and is read once per pass over its cluster. Each rank yields its own
slice of every micro batch.

Differences from DeepSpeed: every rank computes the same batches from ``data_efficiency.seed``
instead of rank 0 computing and broadcasting them (no collective, and the sampler runs inside
the data loader); clusters are kept in memory (``data_cluster_path``, when set, receives a copy
of each for inspection) and a resumed run replays the draws instead of reading them back, which
is why the position saved in the checkpoint is the loader's (epoch, batches consumed). A resume on
another topology with the same global batch size replays the same global batches; with another
global batch size the order after the resume differs. The whole run (``num_epochs`` passes over
the data) is one pass of the loader: a loader iterated past it starts the curriculum again.

Example:
    >>> import numpy as np
    >>> from shardwise.data_efficiency.metric_index import MetricIndex
    >>> from shardwise.data_efficiency.schedule import CurriculumSchedule
    >>> m = MetricIndex("len", CurriculumSchedule(2, 8, "fixed_discrete",
    ...     {"difficulty": [2, 8], "max_step": [3]}), "value", True, np.arange(10.0))
    >>> s = CurriculumSampler([m], num_samples=10, micro_batch_size=2, dp_rank=0, dp_size=1)
    >>> first = list(s)[:6]
    >>> max(first) <= 2
    True
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import numpy as np
from torch.utils.data import Sampler

from shardwise.data_efficiency.metric_index import MetricIndex

__all__ = ["CurriculumSampler"]


class CurriculumSampler(Sampler[int]):
    """Sample ids for one data-parallel rank, in curriculum order (see the module docstring).

    Args:
        metrics: the curriculum metrics (several narrow the admitted set together).
        num_samples: samples in one epoch of the dataset.
        micro_batch_size: samples per rank per micro batch.
        dp_rank: this rank.
        dp_size: data-parallel ranks.
        gradient_accumulation_steps: micro batches per global batch.
        num_epochs: the run draws ``num_epochs * num_samples`` samples in all.
        seed: the draws' seed (the same on every rank).
        cluster_path: a folder receiving each cluster as ``cluster_<metric><difficulty>....npy``.

    Raises:
        ValueError: the difficulties admit no sample when a batch must be drawn.
    """

    def __init__(
        self,
        metrics: Sequence[MetricIndex],
        *,
        num_samples: int,
        micro_batch_size: int,
        dp_rank: int,
        dp_size: int,
        gradient_accumulation_steps: int = 1,
        num_epochs: int = 1,
        seed: int = 1234,
        cluster_path: str | None = None,
        write_clusters: bool = True,
    ) -> None:
        self.metrics = list(metrics)
        self.num_samples = num_samples
        self.micro_batch_size = micro_batch_size
        self.dp_rank = dp_rank
        self.dp_size = dp_size
        self.gas = gradient_accumulation_steps
        self.global_batch_size = micro_batch_size * dp_size * gradient_accumulation_steps
        self.num_global_batches = num_epochs * num_samples // self.global_batch_size
        self.seed = seed
        self.cluster_path = Path(cluster_path) if cluster_path else None
        self.write_clusters = write_clusters and dp_rank == 0
        self.curriculum_step = 0
        self.current_difficulties: dict[str, Any] = {}

    def __len__(self) -> int:
        return self.num_global_batches * self.gas * self.micro_batch_size

    def set_custom_curriculum_learning_schedule(self, schedules: dict[str, Callable[[int], Any]]) -> None:
        """Give ``custom`` metrics their schedule functions (``{metric: fn(step)}``)."""
        for metric in self.metrics:
            if metric.name in schedules:
                metric.schedule.set_custom(schedules[metric.name])

    def _new_cluster(self, assigned: np.ndarray) -> np.ndarray:
        admitted = np.ones(self.num_samples, dtype=bool)
        for metric in self.metrics:
            admitted &= metric.admitted(self.current_difficulties[metric.name], self.num_samples)
        fresh = np.flatnonzero(admitted & ~assigned)
        assigned[fresh] = True
        return fresh

    def _save_cluster(self, cluster: np.ndarray) -> None:
        if self.cluster_path is None or not self.write_clusters:
            return
        name = "cluster" + "".join(f"_{m.name}{self.current_difficulties[m.name]}" for m in self.metrics)
        self.cluster_path.mkdir(parents=True, exist_ok=True)
        target = self.cluster_path / f"{name}.npy"
        if not target.exists():
            np.save(target, cluster)

    def global_batches(self) -> Iterator[np.ndarray]:
        """Every global batch of the run, in order (the same on every rank)."""
        rng = np.random.default_rng(self.seed)
        for metric in self.metrics:
            metric.schedule.current = metric.schedule.min_difficulty
        self.curriculum_step = 0
        self.current_difficulties = {}
        assigned = np.zeros(self.num_samples, dtype=bool)
        clusters: list[np.ndarray] = []
        positions: list[int] = []
        for _ in range(self.num_global_batches):
            self.curriculum_step += 1
            changed = False
            for metric in self.metrics:
                value = metric.schedule.update(self.curriculum_step)
                changed |= self.current_difficulties.get(metric.name) != value
                self.current_difficulties[metric.name] = value
            if changed or not clusters:
                cluster = self._new_cluster(assigned)
                if len(cluster):
                    rng.shuffle(cluster)
                    clusters.append(cluster)
                    positions.append(0)
                    self._save_cluster(cluster)
            if not clusters:
                raise ValueError(
                    f"data_sampling.curriculum_learning: at curriculum step {self.curriculum_step} the "
                    f"difficulties {self.current_difficulties} admit no sample; raise the metrics' "
                    "min_difficulty"
                )
            sizes = np.array([len(c) for c in clusters], dtype=np.float64)
            counts = np.bincount(
                rng.choice(len(clusters), self.global_batch_size, p=sizes / sizes.sum()),
                minlength=len(clusters),
            )
            parts = []
            for index, count in enumerate(counts):
                parts.append(self._take(rng, clusters, positions, index, int(count)))
            batch = np.concatenate(parts)
            rng.shuffle(batch)
            yield batch

    def post_process_state(self) -> dict[str, Any]:
        """What ``engine.set_data_post_process_func``'s function receives with each batch, by
        DeepSpeed's keys: ``current_difficulties`` (metric -> difficulty) and ``curriculum_step``."""
        return {
            "current_difficulties": dict(getattr(self, "current_difficulties", {})),
            "curriculum_step": self.curriculum_step,
        }

    @staticmethod
    def _take(
        rng: np.random.Generator, clusters: list[np.ndarray], positions: list[int], i: int, n: int
    ) -> np.ndarray:
        taken: list[np.ndarray] = []
        while n > 0:
            start = positions[i]
            chunk = clusters[i][start : start + n].copy()  # a copy: the cluster may be reshuffled below
            taken.append(chunk)
            positions[i] += len(chunk)
            n -= len(chunk)
            if positions[i] >= len(clusters[i]):
                rng.shuffle(clusters[i])
                positions[i] = 0
        return np.concatenate(taken) if taken else np.zeros(0, dtype=np.int64)

    def __iter__(self) -> Iterator[int]:
        per_micro = self.micro_batch_size * self.dp_size
        mine = slice(self.dp_rank * self.micro_batch_size, (self.dp_rank + 1) * self.micro_batch_size)
        for batch in self.global_batches():
            for micro in range(self.gas):
                for sample in batch[micro * per_micro : (micro + 1) * per_micro][mine]:
                    yield int(sample)
