"""The in-process store benchmark runs (quick sizes) and checks every byte it reads back."""

from __future__ import annotations

import json

import pytest

from tools.bench.__main__ import main


def test_store_bench_quick(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["store", "--json", "--quick"]) == 0
    rows = {r["metric"]: r for r in map(json.loads, capsys.readouterr().out.splitlines())}
    assert set(rows) == {
        f"{kind}_512tok_{bt}tok_blocks{threads}{tail}"
        for bt, threads in ((256, ""), (256, "_1thread"), (16, ""))
        for kind, tail in (("put", "_fresh_arena"), ("put", ""), ("get_into", ""))
    }
    assert rows["put_512tok_256tok_blocks_1thread"]["copy_threads"] == 1
    assert rows["put_512tok_256tok_blocks"]["copy_threads"] >= 1
    for r in rows.values():
        assert r["bench"] == "store" and r["unit"] == "GB/s" and r["value"] > 0 and r["baseline"] > 0
        assert r["request_bytes"] == 512 * 128 * 1024  # Llama-8B: 128 KiB per token
