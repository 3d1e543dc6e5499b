"""The model-based tuner's cost model: ridge regression on a few features of a candidate.

Model: ``score ~ w . features`` fitted by ridge-regularised least squares (numpy), with
features one-hot ZeRO stage, ``log2(micro batch)``, its square, ``log2(micro batch)`` per
stage, ``log2(gradient accumulation)``, offload, and each extra zero key (log10 of a number,
0/1 of a flag). Why this model: throughput rises with the micro batch and then flattens or
drops (a concave curve in ``log2`` of it) and the ZeRO stage shifts and bends that curve
(communication and sharding costs), so a quadratic in ``log2(micro batch)`` with per-stage
terms captures the shape with about a dozen weights. A tuning has a handful to a few tens of
finished experiments: a low-capacity linear model fits that reliably and the ridge term keeps
it defined with fewer points than weights; gradient-boosted trees (DeepSpeed's XGBoost ranker)
would need more points, would add a dependency, and cannot extrapolate to an untried micro batch.

Example:
    >>> from shardwise.autotuning.space import Candidate
    >>> model = CostModel()
    >>> seen = [Candidate(1, m, 1) for m in (1, 2, 4, 8)]
    >>> model.fit(seen, [1.0, 2.0, 3.0, 4.0])
    >>> round(float(model.predict([Candidate(1, 16, 1)])[0]), 1) > 4.0
    True
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np

from shardwise.autotuning.space import ALL_STAGES, Candidate

__all__ = ["CostModel", "features"]


def features(candidate: Candidate) -> list[float]:
    """The feature row of a candidate (see the module docstring)."""
    log_mb = math.log2(candidate.micro_batch)
    row = [1.0 if candidate.stage == stage else 0.0 for stage in ALL_STAGES]
    row += [log_mb, log_mb * log_mb]
    row += [log_mb if candidate.stage == stage else 0.0 for stage in ALL_STAGES]
    row += [math.log2(candidate.grad_accum), 1.0 if candidate.offload else 0.0]
    for _, value in candidate.zero_extra:
        if isinstance(value, bool):
            row.append(1.0 if value else 0.0)
        elif isinstance(value, (int, float)) and value > 0:
            row.append(math.log10(value))
        else:
            row.append(0.0)
    return row


class CostModel:
    """Ridge regression from :func:`features` to a score (higher is better).

    Args:
        ridge: the L2 weight on the coefficients (the stage offsets included).
    """

    def __init__(self, ridge: float = 1e-3) -> None:
        self.ridge = ridge
        self._weights: np.ndarray | None = None
        self._mean = 0.0

    def _matrix(self, candidates: Sequence[Candidate]) -> np.ndarray:
        rows = [features(c) for c in candidates]
        width = max(len(r) for r in rows)
        return np.array([r + [0.0] * (width - len(r)) for r in rows], dtype=np.float64)

    def fit(self, candidates: Sequence[Candidate], scores: Sequence[float]) -> None:
        """Fit on finished experiments (scores centred; the ridge solution always exists)."""
        x = self._matrix(candidates)
        y = np.asarray(scores, dtype=np.float64)
        self._mean = float(y.mean())
        gram = x.T @ x + self.ridge * np.eye(x.shape[1])
        self._weights = np.linalg.solve(gram, x.T @ (y - self._mean))

    def predict(self, candidates: Sequence[Candidate]) -> np.ndarray:
        """Predicted scores (the mean of the fitted scores before any fit)."""
        if self._weights is None:
            return np.full(len(candidates), self._mean)
        x = self._matrix(candidates)
        width = min(x.shape[1], self._weights.shape[0])
        return x[:, :width] @ self._weights[:width] + self._mean
