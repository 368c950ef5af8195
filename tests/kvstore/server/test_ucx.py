"""The UCX data plane (runs where ucxx is installed: `pip install 'kvstore[ucx]'`)."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import pytest

from kvstore.errors import ConfigError
from kvstore.server.config import ServerConfig
from kvstore.server.daemon import ThreadedDaemon
from tests.conftest import BB, SMALL_NS, chain_for, payload
from tests.kvstore.conftest import TENANTS, TOKEN_A, TOKEN_B


def test_ucx_needs_tenants_because_its_listener_binds_every_interface() -> None:
    with pytest.raises(ConfigError, match="binds every"):
        ServerConfig(ucx=True)


def test_round_trip_over_ucx(start_daemon: Callable[..., ThreadedDaemon]) -> None:
    pytest.importorskip("ucxx", reason="ucxx not installed (pip install 'kvstore[ucx]')")
    from kvstore.client import connect

    d = start_daemon(TENANTS, ucx=True)
    assert d.info["ucx_port"]
    chain = chain_for(1, 6)
    blocks = np.frombuffer(b"".join(payload(x) for x in chain), np.uint8)
    with connect(d.url, token=TOKEN_A, plane="ucx") as a:
        assert a.plane == "ucx"
        assert a.put(SMALL_NS, chain, blocks) == 6
        out = np.zeros(6 * BB, np.uint8)
        assert a.get_into(SMALL_NS, chain, out) == 6
        assert np.array_equal(out, blocks)
    with connect(d.url, token=TOKEN_B, plane="ucx") as b:  # isolation holds on UCX too
        assert b.get_into(SMALL_NS, chain, np.zeros(6 * BB, np.uint8)) == 0
