"""The online additive logistic model: encoding, fitting, the bounded window, refits."""

from __future__ import annotations

import numpy as np
import pytest

from eviction.online_model import ModelConfig, OnlineModel

EDGES = ([0.5, 1.5, 2.5], [1.0, 10.0, 100.0])


def _sample(rng: np.random.Generator, n: int) -> np.ndarray:
    return np.stack([rng.integers(0, 4, n).astype(float), rng.choice([0.0, 5.0, 50.0, 500.0], n)], axis=1)


def test_encode_and_encode_many_agree() -> None:
    m = OnlineModel(EDGES, crosses=[(0, 1)])
    x = _sample(np.random.default_rng(0), 50)
    many = m.encode_many(x)
    assert many.shape == (50, m.slots)
    assert all(tuple(many[i].tolist()) == m.encode(x[i].tolist()) for i in range(50))
    assert m.columns == 1 + 4 + 4 + 16
    assert len(set(many.ravel().tolist())) <= m.columns and int(many.max()) < m.columns


def test_a_fit_recovers_the_probabilities_of_each_cell() -> None:
    """Outcomes drawn from a known probability per (feature 0, feature 1) cell, including an
    interaction only the cross can express: the fitted model predicts each cell within a few
    points."""
    rng = np.random.default_rng(1)
    truth = np.array([[0.02, 0.05, 0.1, 0.3], [0.05, 0.1, 0.2, 0.5], [0.3, 0.1, 0.05, 0.01], [0.5, 0.4, 0.3, 0.2]])
    m = OnlineModel(EDGES, crosses=[(0, 1)], config=ModelConfig(window=1 << 16, refit_every=1 << 20, l2=0.1, newton_steps=20))
    x = _sample(rng, 60_000)
    cols = m.encode_many(x)
    b0 = np.searchsorted(EDGES[0], x[:, 0], side="right")
    b1 = np.searchsorted(EDGES[1], x[:, 1], side="right")
    y = rng.random(x.shape[0]) < truth[b0, b1]
    m.observe_many(cols, y)
    assert not m.ready
    m.fit()
    assert m.ready
    for i in range(4):
        for j in range(4):
            got = m.predict(m.encode([float(i), [0.0, 5.0, 50.0, 500.0][j]]))
            assert got == pytest.approx(truth[i, j], abs=0.03), (i, j)
    p = m.predict_many(cols[:100])
    assert np.allclose(p, [m.predict(tuple(c)) for c in cols[:100].tolist()])


def test_the_window_forgets_old_samples_and_refits_on_schedule() -> None:
    """The outcome's rate changes; a model over a bounded window follows it, refitting every
    ``refit_every`` observations once ``min_samples`` are in."""
    rng = np.random.default_rng(2)
    m = OnlineModel(EDGES, config=ModelConfig(window=4000, refit_every=1000, min_samples=1500))
    cols = m.encode([1.0, 5.0])
    for k in range(1000):
        m.observe(cols, k % 10 == 0)
    assert m.fits == 0  # under min_samples
    for k in range(1000):
        m.observe(cols, k % 10 == 0)
    assert m.fits == 1
    assert m.predict(cols) == pytest.approx(0.1, abs=0.02)
    for _ in range(8000):  # the rate rises to 60%: the window holds only the new samples
        m.observe(cols, bool(rng.random() < 0.6))
    assert m.fits == 9
    assert m.predict(cols) == pytest.approx(0.6, abs=0.04)
    assert m.window_samples()[0].shape == (4000, m.slots)


def test_an_unseen_bin_stays_at_the_average() -> None:
    m = OnlineModel(EDGES, config=ModelConfig(min_samples=1, refit_every=1 << 20))
    seen = m.encode([0.0, 0.0])
    m.observe_many(np.array([seen] * 1000), np.arange(1000) % 5 == 0)
    m.fit()
    assert m.predict(m.encode([3.0, 500.0])) == pytest.approx(0.2, abs=0.05)


def test_bad_models_and_configs_are_refused() -> None:
    with pytest.raises(ValueError, match="ascending"):
        OnlineModel([[1.0, 1.0]])
    with pytest.raises(ValueError, match="cross"):
        OnlineModel(EDGES, crosses=[(0, 0)])
    with pytest.raises(ValueError, match="at least one feature"):
        OnlineModel([])
    with pytest.raises(ValueError, match="positive"):
        ModelConfig(window=0)
    with pytest.raises(ValueError, match="l2"):
        ModelConfig(l2=0.0)
    with pytest.raises(ValueError, match="features"):
        OnlineModel(EDGES).encode_many(np.zeros((3, 3)))
