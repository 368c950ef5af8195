"""The demo: daemons as processes, a router process fed by their events, engine clients."""

from __future__ import annotations

from pathlib import Path

import pytest

from engine.reference import route_demo


@pytest.mark.slow
def test_second_turns_meet_their_prefix_through_a_router_process(tmp_path: Path) -> None:
    out = route_demo.run(nodes=2, users=4, turns=2, seed=3, root=tmp_path)
    assert out["requests"] == 8 and sum(out["requests_per_node"].values()) == 8
    assert out["second_turns_on_their_node"] == 4
    for s in out["second_turns"]:
        # Routed by the prefix the first turn left, and the engine there hit all of it.
        assert s["reason"] == "prefix" and s["hit_blocks"] == s["cached_blocks"] > 0
    h = out["handoff"]
    assert (h["blocks"], h["state"], h["bytes_equal"]) == (16, "released", True)
