"""A small online model of a binary outcome, learned from the past only (issue 18).

An additive logistic model over binned features: each feature's value falls in one bin of its
own edges, each bin has a weight, and so do the bins of a few stated pairs of features
(``crosses``: their interaction). The probability of the outcome is the logistic of the sum of
the active bins' weights, so the model is what a boosted set of stumps (and of depth-2 trees on
the crossed pairs) would be, fitted exactly: Newton steps on the L2-penalised log-loss, one feature's (or cross's) bins at a time: the
bins of one group are disjoint, so its Hessian is diagonal (``bincount``, no design matrix).

Online use (:class:`OnlineModel`): a sample is :meth:`~OnlineModel.observe`\\ d only once its
label is final (the caller waits until the outcome it predicts is in the past), into a bounded
window of the latest labelled samples; the model refits every ``refit_every`` observations on
that window, warm-started from the last weights. A prediction costs one bin search per feature
and a sum (:meth:`~OnlineModel.encode` then :meth:`~OnlineModel.predict`, in plain Python: a
decision at a time), or one vectorised pass for a batch (:meth:`~OnlineModel.predict_many`).

This module is a leaf: numpy only. eviction/admission.py's ``learned`` rule uses it; a placement
rule may too.
"""

from __future__ import annotations

import math
from bisect import bisect_right
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

_MAX_STEP = 2.0
"""The largest change of one weight per Newton step (in log-odds): a group whose curvature is
near zero (all its samples predicted near 0 or 1) would otherwise step far past the optimum."""


@dataclass(frozen=True, slots=True)
class ModelConfig:
    window: int = 1 << 15
    """Labelled samples the model is fitted on (the latest; older ones are forgotten)."""
    refit_every: int = 2048
    """Observations between two fits."""
    min_samples: int = 512
    """Labelled samples before the first fit (until then :meth:`OnlineModel.ready` is False)."""
    l2: float = 1.0
    """Penalty on every weight but the intercept (a bin seen rarely stays near the average)."""
    newton_steps: int = 4
    """Sweeps of group-wise Newton steps per fit (warm-started: a few suffice)."""

    def __post_init__(self) -> None:
        if self.window < 1 or self.refit_every < 1 or self.min_samples < 1 or self.newton_steps < 1:
            raise ValueError("window, refit_every, min_samples and newton_steps must be positive")
        if self.l2 <= 0:
            raise ValueError(f"l2 must be positive, got {self.l2}")


class OnlineModel:
    """P(outcome | features): an additive logistic model over binned features (module docstring).

    ``edges[f]`` are feature ``f``'s bin edges, ascending: a value ``x`` falls in bin
    ``bisect_right(edges[f], x)`` (so ``len(edges[f]) + 1`` bins). ``crosses`` are pairs of
    feature indices whose bins are also crossed (one weight per pair of bins)."""

    def __init__(self, edges: Sequence[Sequence[float]], crosses: Sequence[tuple[int, int]] = (),
                 config: ModelConfig | None = None) -> None:
        self.config = config or ModelConfig()
        if not edges:
            raise ValueError("the model needs at least one feature")
        self.edges = [list(map(float, e)) for e in edges]
        for f, e in enumerate(self.edges):
            if any(b <= a for a, b in zip(e, e[1:], strict=False)):
                raise ValueError(f"feature {f}: bin edges must be strictly ascending, got {e}")
        self.crosses = [(int(a), int(b)) for a, b in crosses]
        for a, b in self.crosses:
            if not (0 <= a < len(edges) and 0 <= b < len(edges)) or a == b:
                raise ValueError(f"cross {(a, b)}: two distinct feature indices below {len(edges)} expected")
        self.nbins = [len(e) + 1 for e in self.edges]
        offsets = [1]  # column 0 is the intercept
        for n in self.nbins:
            offsets.append(offsets[-1] + n)
        for a, b in self.crosses:
            offsets.append(offsets[-1] + self.nbins[a] * self.nbins[b])
        self._offsets = offsets
        self.columns = offsets[-1]
        """Weights in all: the intercept, one per bin, one per crossed pair of bins."""
        self.slots = 1 + len(self.edges) + len(self.crosses)
        """Active columns per sample (the intercept first)."""
        cfg = self.config
        self._x = np.zeros((cfg.window, self.slots), np.int32)
        self._y = np.zeros(cfg.window, np.float64)
        self.samples = 0
        """Labelled samples observed in all (the window holds the latest ``window``)."""
        self.fits = 0
        self.weights = np.zeros(self.columns)
        self._w: list[float] = self.weights.tolist()
        self._since = 0

    # ---- encoding ---------------------------------------------------------------------------------

    def encode(self, x: Sequence[float]) -> tuple[int, ...]:
        """The active columns of one sample (plain Python: cheap for one decision)."""
        off, bins = self._offsets, []
        for f, e in enumerate(self.edges):
            bins.append(bisect_right(e, x[f]))
        cols = [0, *(off[f] + b for f, b in enumerate(bins))]
        n = len(self.edges)
        for j, (a, b) in enumerate(self.crosses):
            cols.append(off[n + j] + bins[a] * self.nbins[b] + bins[b])
        return tuple(cols)

    def encode_many(self, x: np.ndarray) -> np.ndarray:
        """The active columns of a batch: ``x`` is (samples, features); (samples, slots)."""
        x = np.asarray(x, np.float64)
        if x.ndim != 2 or x.shape[1] != len(self.edges):
            raise ValueError(f"expected (samples, {len(self.edges)}) features, got shape {x.shape}")
        bins = np.stack([np.searchsorted(np.asarray(e, np.float64), x[:, f], side="right")
                         for f, e in enumerate(self.edges)], axis=1)
        off = np.asarray(self._offsets)
        n = len(self.edges)
        cols = [np.zeros(x.shape[0], np.int64), *(off[f] + bins[:, f] for f in range(n))]
        for j, (a, b) in enumerate(self.crosses):
            cols.append(off[n + j] + bins[:, a] * self.nbins[b] + bins[:, b])
        return np.stack(cols, axis=1).astype(np.int32)

    # ---- learning ---------------------------------------------------------------------------------

    @property
    def ready(self) -> bool:
        return self.fits > 0

    def observe(self, cols: Sequence[int], label: bool) -> None:
        """A labelled sample (its label final); refits when ``refit_every`` are new."""
        cfg = self.config
        j = self.samples % cfg.window
        self._x[j] = cols
        self._y[j] = float(label)
        self.samples += 1
        self._since += 1
        if self._since >= cfg.refit_every and self.samples >= cfg.min_samples:
            self.fit()

    def observe_many(self, cols: np.ndarray, labels: np.ndarray) -> None:
        """:meth:`observe` of a batch, in order (one fit at most, after the batch)."""
        cfg = self.config
        cols = np.asarray(cols, np.int32).reshape(-1, self.slots)
        labels = np.asarray(labels, np.float64).reshape(-1)
        if cols.shape[0] != labels.size:
            raise ValueError(f"{cols.shape[0]} samples but {labels.size} labels")
        if cols.shape[0] > cfg.window:
            cols, labels = cols[-cfg.window:], labels[-cfg.window:]
            self.samples += cols.shape[0] - cfg.window  # (the dropped ones count as observed)
        j = (self.samples + np.arange(labels.size)) % cfg.window
        self._x[j] = cols
        self._y[j] = labels
        self.samples += labels.size
        self._since += labels.size
        if self._since >= cfg.refit_every and self.samples >= cfg.min_samples:
            self.fit()

    def fit(self) -> None:
        """Newton's method on the window's penalised log-loss, from the current weights, one
        group of columns at a time (a feature's bins, or a cross's: disjoint within a group,
        so each group's Hessian is diagonal and its Newton step exact), ``newton_steps``
        sweeps over the groups."""
        cfg = self.config
        n = min(self.samples, cfg.window)
        self._since = 0
        if not n:
            return
        x, y = self._x[:n], self._y[:n]
        d, w = self.columns, self.weights.copy()
        penalty = np.full(d, cfg.l2)
        penalty[0] = 1e-6
        z = w[x].sum(axis=1)
        for _ in range(cfg.newton_steps):
            moved = 0.0
            for a in range(self.slots):
                col = x[:, a]
                p = 1.0 / (1.0 + np.exp(-np.clip(z, -30.0, 30.0)))
                g = np.bincount(col, weights=p - y, minlength=d) + penalty * w
                h = np.bincount(col, weights=p * (1.0 - p), minlength=d) + penalty
                lo, hi = self._group(a)
                step = np.clip(g[lo:hi] / h[lo:hi], -_MAX_STEP, _MAX_STEP)
                w[lo:hi] -= step
                z -= step[col - lo]
                moved = max(moved, float(np.abs(step).max()))
            if moved < 1e-4:
                break
        self.weights = w
        self._w = w.tolist()
        self.fits += 1

    def _group(self, slot: int) -> tuple[int, int]:
        """The columns slot ``slot`` of a sample takes its one active column from."""
        if slot == 0:
            return 0, 1
        return self._offsets[slot - 1], self._offsets[slot]

    # ---- predicting -------------------------------------------------------------------------------

    def logit(self, cols: Sequence[int]) -> float:
        w = self._w
        return sum(w[c] for c in cols)

    def predict(self, cols: Sequence[int]) -> float:
        """P(outcome) of one encoded sample (0.5 everywhere before the first fit)."""
        z = self.logit(cols)
        return 1.0 / (1.0 + math.exp(-z)) if z > -30.0 else 0.0

    def predict_many(self, cols: np.ndarray) -> np.ndarray:
        z = self.weights[np.asarray(cols, np.int64)].sum(axis=1)
        return 1.0 / (1.0 + np.exp(-np.clip(z, -30.0, 30.0)))

    def window_samples(self) -> tuple[np.ndarray, np.ndarray]:
        """The labelled samples the next fit uses (encoded columns, labels)."""
        n = min(self.samples, self.config.window)
        return self._x[:n], self._y[:n]
