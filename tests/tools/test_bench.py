"""Benchmarks print one JSON object per line with the figure, its same-run baseline and ratio."""

from __future__ import annotations

import json

import pytest

from tools.bench.__main__ import main

KEYS = {"bench", "metric", "value", "unit", "baseline", "ratio"}


@pytest.mark.parametrize("name", ["hash", "index"])
def test_bench_json_lines(name: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert main([name, "--json", "--quick"]) == 0
    rows = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert rows
    for r in rows:
        assert r.keys() >= KEYS
        assert r["bench"] == name
        assert r["value"] > 0 and r["baseline"] > 0
        assert r["ratio"] == pytest.approx(r["value"] / r["baseline"], rel=1e-2, abs=1e-4)


def test_throughput_smoke(capsys: pytest.CaptureFixture[str]) -> None:
    """The batched-prefill bench end to end on a tiny CPU model: every engine runs the stream and
    the batch agrees with each request run alone."""
    pytest.importorskip("transformers")
    assert main(["throughput", "--json", "--smoke"]) == 0
    rows = {r["metric"]: r for r in map(json.loads, capsys.readouterr().out.splitlines())}
    assert set(rows) == {"dram_hit80_tokens_per_s", "hbm_hit80_tokens_per_s", "ideal_hit80_tokens_per_s", "hbm_vs_ideal_hit80"}
    for r in rows.values():
        assert r.keys() >= KEYS and r["value"] > 0 and r["baseline"] > 0
    assert rows["dram_hit80_tokens_per_s"]["measured_hit"] > 0.7
    assert rows["dram_hit80_tokens_per_s"]["hbm_share_of_hits"] == 0
    assert rows["hbm_hit80_tokens_per_s"]["hbm_share_of_hits"] == 1.0  # after the warm-up round
    check = rows["hbm_vs_ideal_hit80"]["check"]
    assert check["same_greedy_token"] == check["checked_requests"] == 2
    assert check["logits_rel_err"] <= 1e-4


def test_flop_bound_is_below_one_over_one_minus_h_and_falls_with_context() -> None:
    """Hit tokens are not free: the new tokens attend to the whole prefix, more so when it is long."""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    from tools.bench.throughput import flop_bound

    cfg = transformers.LlamaConfig(hidden_size=4096, intermediate_size=14336, num_hidden_layers=2,
                                   num_attention_heads=32, num_key_value_heads=8)

    def stream(n: int) -> list[list[torch.Tensor]]:
        return [[torch.zeros(n, dtype=torch.long), torch.zeros(n * 25 // 24, dtype=torch.long)]]  # 96% hit

    short, long = flop_bound(cfg, [], stream(1024)), flop_bound(cfg, [], stream(32768))
    assert long < 20 < short < 25  # 32K-token prompts: 18.2x at best; 1K: 24.9x


def test_bench_rejects_unknown_names(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as e:
        main(["nope"])
    assert e.value.code == 2
