"""The probes of tools/lab/probes/ on the CPU: their rows and arguments."""

from __future__ import annotations

import pytest


def test_copy_scale_rows_name_each_thread_count_against_one_thread() -> None:
    from tools.lab.probes.copyscale import run, thread_counts

    assert thread_counts(16) == [1, 2, 4, 8, 16]
    assert thread_counts(6) == [1, 2, 4, 6]
    assert thread_counts(2) == [1, 2]
    rows = list(run(mib=4, reps=1, threads=[2]))
    assert [r["metric"] for r in rows] == ["copy_threads_1", "copy_threads_2"]
    assert rows[0]["ratio"] == 1.0 and all(r["value"] > 0 and r["default_copy_threads"] >= 1 for r in rows)
    into = list(run(mib=4, reps=1, threads=[2], into_arena=True))
    assert [r["metric"] for r in into] == ["copy_threads_into_1", "copy_threads_into_2"]
    assert {r["direction"] for r in into} == {"into the arena"}



def test_lease_rows_time_a_whole_lease_against_a_lookup() -> None:
    from tools.lab.probes.lease import main, run

    rows = list(run(blocks=[3, 40], reps=2)) + list(run(blocks=[5], reps=1, policy="lru"))
    assert [r["metric"] for r in rows] == ["lease_3", "lease_40", "lease_5"]
    assert rows[-1]["policy"] == "lru"
    assert all(r["value"] > 0 and r["baseline"] > 0 and r["unit"] == "ms" for r in rows)
    with pytest.raises(SystemExit):
        main(["--blocks", "0"])


def test_hybrid_kernels_parts_skip_without_cuda(capsys: pytest.CaptureFixture[str]) -> None:
    torch = pytest.importorskip("torch")
    if torch.cuda.is_available():
        pytest.skip("runs the CUDA probe for real on a GPU")
    from tools.lab.probes.hybrid_kernels import main

    assert main(["attention", "profile", "--quick"]) == 0
    out = capsys.readouterr().out
    assert "hybrid attention: skipped" in out and "hybrid profile: skipped" in out
    with pytest.raises(SystemExit):
        main(["syncs"])  # the bench's part, not the probe's
