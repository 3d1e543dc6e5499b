"""Tuners, trials, early stopping, and the model-based tuner on a synthetic cost surface."""

from __future__ import annotations

import math

from shardwise.autotuning.space import Candidate
from shardwise.autotuning.tuners import make_tuner, run_search

GRID = [Candidate(stage, 2**k, 1) for stage in (0, 1, 2, 3) for k in range(8)]  # 32 candidates


def surface(c: Candidate) -> float:
    """Throughput-like: rises with log2(micro batch) to a peak at 32, stage 3 best, stage 0 worst."""
    level = {0: 100.0, 1: 130.0, 2: 150.0, 3: 170.0}[c.stage]
    x = math.log2(c.micro_batch)
    return level + 12.0 * x - 1.2 * x * x


def _trials_to_best(kind: str) -> int:
    best = max(GRID, key=surface)
    result = run_search(make_tuner(kind, GRID), surface, num_trials=len(GRID), early_stopping=0)
    assert result.best == best
    return 1 + [c for c, _ in result.trials].index(best)


def test_model_based_reaches_the_grid_best_in_fewer_trials() -> None:
    grid, model = _trials_to_best("gridsearch"), _trials_to_best("model_based")
    assert grid == 30  # stage 3, micro batch 32: late in the grid's order
    assert model <= 10, model


def test_random_covers_every_candidate_once_in_another_order() -> None:
    result = run_search(make_tuner("random", GRID), surface, num_trials=100, early_stopping=0)
    order = [c for c, _ in result.trials]
    assert sorted(order, key=GRID.index) == GRID and order != GRID


def test_num_trials_and_early_stopping() -> None:
    assert (
        len(run_search(make_tuner("gridsearch", GRID), surface, num_trials=5, early_stopping=0).trials) == 5
    )
    # stage 0 peaks at micro batch 32 (index 5); two more without improvement, then stop
    result = run_search(make_tuner("gridsearch", GRID), lambda c: surface(c) if c.stage == 0 else 0.0, 99, 2)
    assert result.stopped_early and len(result.trials) == 8 and result.best == Candidate(0, 32, 1)


def test_failures_count_as_trials_and_the_search_goes_on() -> None:
    def flaky(c: Candidate) -> float | None:
        return None if c.micro_batch == 4 else surface(c)

    result = run_search(make_tuner("gridsearch", GRID[:8]), flaky, 99, 0)
    assert len(result.trials) == 8 and (Candidate(0, 4, 1), None) in result.trials
    assert result.best == Candidate(0, 32, 1)
