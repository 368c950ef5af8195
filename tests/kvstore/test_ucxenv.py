"""transfer_all: ucxx transfers posted in order, all at once; a failure raised once all ended."""

from __future__ import annotations

import asyncio
import os

import pytest

from kvstore.ucxenv import transfer_all


def test_transfers_start_in_order_run_at_once_and_all_end_before_a_failure() -> None:
    started: list[int] = []
    ended: list[int] = []

    async def op(i: int, total: int = 3, fail: bool = False) -> None:
        started.append(i)  # ucxx posts its request here, before the first await
        await asyncio.sleep(0)
        assert started == list(range(total)), "every transfer was posted before any completed"
        ended.append(i)
        if fail:
            raise ConnectionError(f"transfer {i} failed")

    async def main() -> None:
        await transfer_all([op(0), op(1, fail=True), op(2)])

    with pytest.raises(ConnectionError, match="transfer 1"):
        asyncio.run(main())
    assert started == [0, 1, 2] and sorted(ended) == [0, 1, 2]
    started.clear()
    ended.clear()
    asyncio.run(transfer_all([op(0, total=1)]))
    assert ended == [0]
    asyncio.run(transfer_all([]))


def test_ucx_defaults_fill_only_what_the_operator_left_unset(monkeypatch: pytest.MonkeyPatch) -> None:
    from kvstore.ucxenv import UCX_ENV_DEFAULTS, apply_ucx_env

    for key in UCX_ENV_DEFAULTS:
        monkeypatch.delenv(key, raising=False)
    monkeypatch.setenv("UCX_RNDV_SCHEME", "put_zcopy")  # the operator's choice wins
    apply_ucx_env()
    assert os.environ["UCX_RNDV_SCHEME"] == "put_zcopy"
    assert os.environ["UCX_TCP_SNDBUF"] == os.environ["UCX_TCP_RCVBUF"] == "4M"
    assert os.environ["UCXPY_PROGRESS_MODE"] == "blocking"
