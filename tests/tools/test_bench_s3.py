"""The S3 benchmark runs end to end against the server it starts, in the shared line format."""

from __future__ import annotations

import importlib.util
import json

import pytest

from tools.bench.__main__ import main

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("s3fs") is None or importlib.util.find_spec("moto") is None,
    reason="needs s3fs and moto[server] (pip install -e '.[dev,s3]')",
)


def test_s3_bench_prints_each_figure_with_its_raw_baseline(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["s3", "--json", "--quick"]) == 0
    rows = {r["metric"]: r for r in map(json.loads, capsys.readouterr().out.splitlines())}
    assert set(rows) == {
        "shuffle_zstd1_size_ratio_bf16",
        "put_many_1-8MiB",
        "get_many_1-8MiB",
        "cold_rebuild_64_objects",
        "probe_16_blocks",
    }
    for r in rows.values():
        assert r["bench"] == "s3" and r["value"] > 0 and r["baseline"] > 0
        assert r["ratio"] == pytest.approx(r["value"] / r["baseline"], rel=1e-2, abs=1e-4)
    assert rows["put_many_1-8MiB"]["unit"] == rows["get_many_1-8MiB"]["unit"] == "MB/s"
    assert rows["shuffle_zstd1_size_ratio_bf16"]["value"] < rows["shuffle_zstd1_size_ratio_bf16"]["baseline"]
