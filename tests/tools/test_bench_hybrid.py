"""The hybrid benchmark: the bytes rows' layout arithmetic agrees with what a real store holds; the
TTFT rows' warm-up runs every engine over every prompt until a pass is steady."""

from __future__ import annotations

import pytest

pytest.importorskip("torch")
pytest.importorskip("transformers")

from types import SimpleNamespace  # noqa: E402

import torch  # noqa: E402

from tools.bench.hybrid import INTERVALS, PLANS, WARM_PASSES, _warm, bytes_rows  # noqa: E402


class _Clock:
    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


class _Engine:
    """A prefill that costs ``costs[pass]`` on the fake clock and records what it was given."""

    def __init__(self, clock: _Clock, costs: list[float], name: str) -> None:
        self.clock, self.costs, self.name = clock, costs, name
        self.calls: list[int] = []

    def prefill(self, prompt: torch.Tensor, store: bool = True) -> SimpleNamespace:
        assert store is False
        n = len(self.calls) // 2  # two cases per pass
        self.clock.t += self.costs[min(n, len(self.costs) - 1)]
        self.calls.append(int(prompt[0]))
        return SimpleNamespace(logits=torch.tensor([float(len(self.calls)), 0.0]), replayed_tokens=int(prompt[0]),
                               hit_tokens=0, loaded_bytes=len(self.name))


def test_bytes_per_token_matches_a_store_run() -> None:
    rows = list(bytes_rows(quick=True))
    assert len(rows) == len(INTERVALS) * len(PLANS)
    for r in rows:
        assert r["ratio"] == pytest.approx(r["store_run_ratio"], abs=1e-3), r["metric"]
        assert 0 < r["ratio"] <= 1.0  # window pieces are shared: never more than every layer
    by_name = {r["metric"]: r for r in rows}
    # Half SWA at W = 128: the full half plus one 128-token window per 4,096 tokens.
    assert by_name["bytes_per_token_gpt-oss-120b_C64"]["ratio"] == pytest.approx(0.5 + 0.5 * 2 / 64, abs=1e-3)


def test_the_warm_up_runs_every_engine_on_every_prompt_until_a_pass_is_steady() -> None:
    clock = _Clock()
    slow_then_steady = [3.0, 2.0, 1.0, 1.02, 1.0]  # a fresh machine: two slow passes, then steady
    lm, every, needed = (_Engine(clock, slow_then_steady, n) for n in ("hybrid", "every", "needed-only"))
    cases = [(21, True, lm, 0, torch.tensor([0, 9])), (21, True, lm, 5, torch.tensor([5, 9]))]
    warm = _warm(cases, every, needed, on_gpu=True, clock=clock)  # type: ignore[arg-type]
    assert warm.passes == 4  # 18, 12, 6 (not yet steady), 6.12 (within 5% of 6)
    assert warm.pass_seconds == [18.0, 12.0, 6.0, 6.12]
    for e in (lm, every, needed):
        assert e.calls == [0, 5] * 4  # each engine, each prompt, each pass: warmed alike
    assert [(a.replayed_tokens, b.loaded_bytes, n.loaded_bytes) for a, b, n in warm] == [(0, 5, 11), (5, 5, 11)]
    assert [float(a.logits[0]) for a, _, _ in warm] == [1.0, 2.0]  # the warm-up's results are kept


def test_the_warm_up_stops_at_its_limit_and_once_on_the_cpu() -> None:
    clock = _Clock()
    lm, every, needed = (_Engine(clock, [float(2 ** k) for k in range(9)], n) for n in ("a", "b", "c"))
    cases = [(16, True, lm, 0, torch.tensor([0])), (16, True, lm, 4, torch.tensor([4]))]
    assert _warm(cases, every, needed, on_gpu=True, clock=clock).passes == WARM_PASSES  # type: ignore[arg-type]
    assert _warm(cases, every, needed, on_gpu=False, clock=clock).passes == 1  # type: ignore[arg-type]
