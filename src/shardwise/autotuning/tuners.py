"""The search: which candidate to try next, how many trials, when to stop.

- ``gridsearch``: the candidates in order (stage, then micro batch, then the other keys);
- ``random``: the same candidates in a seeded random order;
- ``model_based``: one experiment per ZeRO stage first (its middle micro batch), then the
  untried candidate the :class:`~shardwise.autotuning.cost_model.CostModel`, refitted on every
  finished experiment, predicts best.

:func:`run_search` runs at most ``num_trials`` experiments and stops early once
``early_stopping`` experiments in a row have not beaten the best (0: never early). A failed
experiment (``None``) counts as a trial that did not improve.

Example:
    >>> from shardwise.autotuning.space import Candidate
    >>> grid = [Candidate(0, m, 1) for m in (1, 2, 4, 8)]
    >>> result = run_search(make_tuner("gridsearch", grid), lambda c: float(c.micro_batch), 10, 0)
    >>> result.best.micro_batch, len(result.trials)
    (8, 4)
"""

from __future__ import annotations

import random
from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from shardwise.autotuning.cost_model import CostModel
from shardwise.autotuning.space import Candidate

__all__ = ["TUNERS", "SearchResult", "Tuner", "make_tuner", "run_search"]


class Tuner(ABC):
    """Chooses the next candidate from those not tried yet, given the finished ones.

    Args:
        candidates: the search space (after pruning).
    """

    def __init__(self, candidates: Sequence[Candidate]) -> None:
        self.candidates = list(candidates)

    @abstractmethod
    def next(self, untried: Sequence[Candidate], scored: Sequence[tuple[Candidate, float]]) -> Candidate:
        """The candidate to run next (``untried`` is never empty)."""


class GridSearchTuner(Tuner):
    """In order."""

    def next(self, untried: Sequence[Candidate], scored: Sequence[tuple[Candidate, float]]) -> Candidate:
        """The first untried candidate."""
        return untried[0]


class RandomTuner(Tuner):
    """In a seeded random order.

    Args:
        candidates: the search space.
        seed: the shuffle's seed.
    """

    def __init__(self, candidates: Sequence[Candidate], seed: int = 0) -> None:
        super().__init__(candidates)
        self.order = {
            c: i for i, c in enumerate(random.Random(seed).sample(self.candidates, len(self.candidates)))
        }

    def next(self, untried: Sequence[Candidate], scored: Sequence[tuple[Candidate, float]]) -> Candidate:
        """The untried candidate that comes first in the shuffled order."""
        return min(untried, key=lambda c: self.order[c])


class ModelBasedTuner(Tuner):
    """One candidate per stage to start, then the cost model's best prediction.

    Args:
        candidates: the search space.
        model: the cost model (default :class:`CostModel`).
    """

    def __init__(self, candidates: Sequence[Candidate], model: CostModel | None = None) -> None:
        super().__init__(candidates)
        self.model = model or CostModel()
        by_stage: dict[int, list[Candidate]] = {}
        for candidate in self.candidates:
            by_stage.setdefault(candidate.stage, []).append(candidate)
        self.openers = [group[len(group) // 2] for _, group in sorted(by_stage.items())]

    def next(self, untried: Sequence[Candidate], scored: Sequence[tuple[Candidate, float]]) -> Candidate:
        """An opener not run yet, else the untried candidate with the best predicted score."""
        for opener in self.openers:
            if opener in untried:
                return opener
        if not scored:
            return untried[0]
        self.model.fit([c for c, _ in scored], [s for _, s in scored])
        predictions = self.model.predict(untried)
        return untried[int(predictions.argmax())]


TUNERS: dict[str, Callable[[Sequence[Candidate]], Tuner]] = {
    "gridsearch": GridSearchTuner,
    "random": RandomTuner,
    "model_based": ModelBasedTuner,
}


def make_tuner(kind: str, candidates: Sequence[Candidate]) -> Tuner:
    """The tuner named by ``autotuning.tuner_type``."""
    if kind not in TUNERS:
        raise ValueError(f"autotuning.tuner_type = {kind!r} is not a tuner; use one of {sorted(TUNERS)}")
    return TUNERS[kind](candidates)


@dataclass
class SearchResult:
    """What a search did.

    Attributes:
        trials: every candidate run, in order, with its score (None: it failed).
        best: the best-scoring candidate (None when every trial failed).
        best_score: its score.
        stopped_early: early stopping ended the search.
    """

    trials: list[tuple[Candidate, float | None]] = field(default_factory=list)
    best: Candidate | None = None
    best_score: float | None = None
    stopped_early: bool = False


def run_search(
    tuner: Tuner, evaluate: Callable[[Candidate], float | None], num_trials: int, early_stopping: int
) -> SearchResult:
    """Run the tuner's choices through ``evaluate`` (a score, higher is better, or None on failure)."""
    result = SearchResult()
    untried = list(tuner.candidates)
    scored: list[tuple[Candidate, float]] = []
    since_best = 0
    while untried and len(result.trials) < num_trials:
        candidate = tuner.next(untried, scored)
        untried.remove(candidate)
        score = evaluate(candidate)
        result.trials.append((candidate, score))
        if score is not None:
            scored.append((candidate, score))
        if score is not None and (result.best_score is None or score > result.best_score):
            result.best, result.best_score, since_best = candidate, score, 0
        else:
            since_best += 1
        if early_stopping and since_best >= early_stopping and result.best is not None:
            result.stopped_early = bool(untried)
            break
    return result
