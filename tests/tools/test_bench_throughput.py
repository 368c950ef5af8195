"""The throughput bench's check of the batch against each request alone."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

torch = pytest.importorskip("torch")

from tools.bench.throughput import agreement  # noqa: E402


def _res(logits: list[float], hit: int) -> SimpleNamespace:
    return SimpleNamespace(logits=torch.tensor(logits), hit_tokens=hit)


def test_agreement_counts_greedy_tokens_and_says_how_tied_the_logits_were() -> None:
    alone = [_res([3.0, 2.9, -1.0], 64), _res([-1.0, 4.0, 2.0], 128)]
    batched = [_res([2.9, 3.0, -1.0], 64), _res([-1.0, 4.0, 2.0], 128)]  # the first near tie flips
    a = agreement(alone, batched)
    assert a["checked_requests"] == 2 and a["same_greedy_token"] == 1
    assert a["logits_rel_err"] == pytest.approx(0.1 / 3.0, abs=1e-5)
    assert a["top2_margin_alone"] == [pytest.approx(0.1 / 3.0, abs=1e-5), pytest.approx(0.5, abs=1e-5)]
    assert a["hit_tokens_alone"] == a["hit_tokens_batched"] == [64, 128]
    # the flip is within the logits' error: a tie broken by rounding, as the docstring says
    assert a["top2_margin_alone"][0] <= a["logits_rel_err"] + 1e-6
    assert a["top2_margin_abs"] == [pytest.approx(0.1, abs=1e-5), pytest.approx(2.0, abs=1e-5)]
    assert a["logits_abs_diff"] == [pytest.approx(0.1, abs=1e-5), 0.0]
    assert "flips_beyond_rounding" not in a  # no floor given: no verdict on the flip


def test_agreement_weighs_a_flip_against_the_rounding_floor() -> None:
    """A flip whose margin is within twice what a kernel change moves the logits is rounding;
    one whose margin is larger is a wrong result."""
    alone = [_res([3.0, 2.9, -1.0], 64), _res([1.0, 0.0, 0.0], 32), _res([0.0, 5.0, 1.0], 16)]
    batched = [_res([2.9, 3.0, -1.0], 64), _res([0.2, 0.3, 0.0], 32), _res([0.0, 5.0, 1.0], 16)]
    floor = [_res([2.92, 2.96, -1.0], 64), _res([1.01, 0.0, 0.0], 32), _res([0.0, 5.0, 1.0], 16)]
    a = agreement(alone, batched, floor)
    assert a["same_greedy_token"] == 1 and a["same_greedy_token_each"] == [False, False, True]
    assert a["floor_abs_diff"] == [pytest.approx(0.08, abs=1e-5), pytest.approx(0.01, abs=1e-5), 0.0]
    assert a["floor_flips"] == 1  # the first request's token is decided by rounding
    # first: margin 0.1 <= 2 x 0.08; second: margin 1.0 > 2 x 0.01, a flip rounding does not explain
    assert a["flips_beyond_rounding"] == 1
