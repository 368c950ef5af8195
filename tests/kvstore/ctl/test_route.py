"""``kvctl route``: several daemons, answered from their KV events."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from kvstore.client import connect
from kvstore.ctl.cli import main
from kvstore.keys import hash_blocks
from kvstore.server.daemon import ThreadedDaemon
from tests.conftest import SMALL_NS
from tests.kvstore.route.tap import daemons, serve


@pytest.fixture
def two(tmp_path: Path) -> Iterator[dict[str, ThreadedDaemon]]:
    with daemons(tmp_path) as start:
        yield {"a": start("a"), "b": start("b")}


def test_route_names_the_node_with_the_prefix(two: dict[str, ThreadedDaemon], tmp_path: Path,
                                              capsys: pytest.CaptureFixture[str]) -> None:
    prompt = np.arange(5 * SMALL_NS.block_tokens, dtype=np.int32)
    with connect(two["b"].url) as c:
        c.register_namespace(SMALL_NS)
        serve(c, SMALL_NS, prompt)
    nodes = [x for n, d in two.items() for x in ("--node", f"{n}={d.url}")]
    hashes = ",".join(h.hex() for h in hash_blocks(SMALL_NS, prompt))
    assert main(["route", *nodes, "--hashes", hashes, "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out == {"node": "b", "blocks": 5, "tiers": {"dram": 5}, "reason": "prefix", "matched": {"a": 0, "b": 5}}
    ns_file = tmp_path / "ns.json"
    ns_file.write_text(json.dumps(SMALL_NS.to_dict()))
    tokens = ",".join(map(str, prompt.tolist()))
    assert main(["route", *nodes, "--namespace", str(ns_file), "--tokens", tokens]) == 0
    assert capsys.readouterr().out.startswith("b: 5 blocks (5 dram); by prefix")


def test_route_says_what_is_wrong(two: dict[str, ThreadedDaemon], capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["route", "--node", "a-without-url", "--hashes", "00" * 16]) == 2
    assert "NAME=http://HOST:PORT" in capsys.readouterr().err
    assert main(["route", "--node", f"a={two['a'].url}"]) == 2
    assert "--hashes, or --tokens with --namespace" in capsys.readouterr().err
