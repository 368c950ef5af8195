"""The lab's request-granular simulator (tools/lab/evict): its LRU is the store's, the
request-level oracle is never below it, and the analysis command runs."""

from __future__ import annotations

from pathlib import Path

import pytest

from tools.lab.evict import orders
from tools.lab.evict.groupsim import lru, oracle, simulate, structure
from tools.replay.sim import parse_capacity, replay_store
from tools.replay.synth import generate, write_trace
from tools.replay.trace import load_trace


@pytest.fixture(scope="module")
def agentic(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("evict") / "coding-agent.jsonl"
    write_trace(path, generate("coding-agent", requests=120, seed=0, block_tokens=64))
    return path


@pytest.mark.parametrize("share", [0.05, 0.10])
def test_lru_matches_the_store(agentic: Path, share: float) -> None:
    t = load_trace(agentic)
    cap = int(share * t.unique_blocks)
    run = replay_store(t, parse_capacity(str(cap), t.unique_blocks, 1), "lru", block_tokens=64)
    st = structure(t)
    assert simulate(st, cap, lru) == pytest.approx(run.hits.sum() / t.num_blocks, abs=2e-3)
    assert simulate(st, cap, oracle) >= simulate(st, cap, lru)


def test_orders_command(agentic: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert orders.main([str(agentic), "--capacity", "10%", "--order", "lru", "--order", "ratio", "--features"]) == 0
    out = capsys.readouterr().out
    assert "10%\tlru\t" in out and "10%\tratio\t" in out and "dead" in out


def _rates(out: str) -> dict[str, float]:
    return {name: float(rate) for _, name, rate in (line.split("\t") for line in out.splitlines() if "\t" in line)}


def test_knowing_finished_sessions_at_once_is_worth_at_least_knowing_it_late(
        agentic: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """``--dead-after`` delays the oracle of death: at once it is not below LRU here (it moves
    only dead lineages ahead), and with a delay no lineage outlives it is LRU exactly;
    ``ratio_dead`` runs."""
    common = [str(agentic), "--capacity", "5%", "--horizon", "1"]
    assert orders.main([*common, "--order", "lru", "--order", "oracle_dead", "--order", "ratio_dead"]) == 0
    now = _rates(capsys.readouterr().out)
    assert orders.main([*common, "--order", "oracle_dead", "--dead-after", "1e9"]) == 0
    never = _rates(capsys.readouterr().out)
    assert now["oracle_dead"] >= now["lru"]
    assert never["oracle_dead"] == now["lru"]
    assert 0 < now["ratio_dead"] <= 1


def test_bad_input_exits_2(agentic: Path, tmp_path: Path) -> None:
    from tools.lab.evict import groupsim

    assert orders.main([str(tmp_path / "missing.jsonl")]) == 2
    assert orders.main([str(agentic), "--capacity", "0"]) == 2
    assert groupsim.main([str(agentic), "--capacity", "x%"]) == 2
    with pytest.raises(SystemExit) as e:
        groupsim.main(["--version"])
    assert e.value.code == 0
