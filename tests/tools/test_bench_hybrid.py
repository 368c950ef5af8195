"""The hybrid benchmark's bytes rows: the layout arithmetic agrees with what a real store holds."""

from __future__ import annotations

import pytest

pytest.importorskip("torch")
pytest.importorskip("transformers")

from tools.bench.hybrid import INTERVALS, PLANS, bytes_rows  # noqa: E402


def test_bytes_per_token_matches_a_store_run() -> None:
    rows = list(bytes_rows(quick=True))
    assert len(rows) == len(INTERVALS) * len(PLANS)
    for r in rows:
        assert r["ratio"] == pytest.approx(r["store_run_ratio"], abs=1e-3), r["metric"]
        assert 0 < r["ratio"] <= 1.0  # window pieces are shared: never more than every layer
    by_name = {r["metric"]: r for r in rows}
    # Half SWA at W = 128: the full half plus one 128-token window per 4,096 tokens.
    assert by_name["bytes_per_token_gpt-oss-120b_C64"]["ratio"] == pytest.approx(0.5 + 0.5 * 2 / 64, abs=1e-3)
