"""The route benchmark's data-path rows: trials interleaved, medians, publishing's own CPU."""

from __future__ import annotations

import pytest

pytest.importorskip("zmq")

from tools.bench.route import SMALL, datapath  # noqa: E402


def test_datapath_rows_come_from_interleaved_trials() -> None:
    dp = datapath(4, SMALL, 4, "32MiB", 2)
    assert dp["trials"] == 2 and len(dp["wall_ratios"]) == 2 and len(dp["cpu_ratios"]) == 2
    # value and baseline are one trial's (the median ratio's), never a mean of two
    assert round(dp["on"] / dp["off"], 4) in dp["wall_ratios"]
    # publishing's own CPU counts ZeroMQ's I/O thread and the publisher's thread (each may be 0
    # in so short a run: publication lags by up to a period), nothing was dropped
    assert dp["publisher_cpu_share"] >= dp["zmq_cpu_share"] >= 0 and dp["thread_cpu_share"] >= 0
    assert dp["dropped"] == 0 and dp["seconds"] > 0
