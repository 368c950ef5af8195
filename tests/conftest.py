"""Shared fixtures: small namespaces, small stores on real tiers, a fake clock."""

from __future__ import annotations

import contextlib
import itertools
import os
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from kvstore.clock import FakeClock
from kvstore.config import StoreConfig, TierSpec
from kvstore.keys import KVLayout, LayerGroup, Namespace, hash_blocks
from kvstore.store import KVStore
from tools.s3server import LocalS3

# 16 tokens x 1 layer x (K,V) x 1 head x 64 dims x 2 bytes = 4096 bytes per block.
SMALL_NS = Namespace("test/tiny", KVLayout("bfloat16", 16, (LayerGroup("full", 1, 1, 64),)))
BB = SMALL_NS.block_bytes


def small_tiers(dram_blocks: int = 16, nvme_blocks: int = 32, object_blocks: int = 256) -> tuple[TierSpec, ...]:
    return (
        TierSpec("dram", "dram", {"capacity_bytes": dram_blocks * BB, "slab_bytes": 4 * BB}),
        TierSpec("nvme", "nvme", {"capacity_bytes": nvme_blocks * BB, "slab_bytes": 4 * BB}),
        TierSpec("object", "object", {"capacity_bytes": object_blocks * BB}),
    )


def payload(key: bytes, size: int = BB) -> bytes:
    """Deterministic payload derived from the block hash, so any reader can verify it."""
    return (key * (size // len(key) + 1))[:size]


def tokens_for(seed: int, n_blocks: int, shared_prefix_blocks: int = 0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    toks = rng.integers(0, 50_000, size=n_blocks * SMALL_NS.block_tokens, dtype=np.int64)
    toks[: shared_prefix_blocks * SMALL_NS.block_tokens] = np.arange(shared_prefix_blocks * SMALL_NS.block_tokens)
    return toks


def chain_for(seed: int, n_blocks: int, shared_prefix_blocks: int = 0) -> list[bytes]:
    return hash_blocks(SMALL_NS, tokens_for(seed, n_blocks, shared_prefix_blocks))


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock()


@pytest.fixture
def make_store(tmp_path: Path, clock: FakeClock) -> Iterator[Callable[..., KVStore]]:
    """Build (or reopen) a store on ``tmp_path``; every store built is closed at teardown."""
    built: list[KVStore] = []

    def make(tiers: tuple[TierSpec, ...] | None = None, register: bool = True, **kw: object) -> KVStore:
        cfg = StoreConfig(root=tmp_path / "store", tiers=tiers or small_tiers(), **kw)  # type: ignore[arg-type]
        s = KVStore(cfg, clock=clock)
        if register:
            s.register_namespace(SMALL_NS)
        built.append(s)
        return s

    yield make
    for s in built:
        s.close()


# ---- hypothesis: the CI count, or thousands in a long run --------------------------------------

HYPOTHESIS_RUN = os.environ.get("KVSTORE_HYPOTHESIS", "ci")
"""``ci`` (the default: the counts the tests name, so that CI stays short) or ``long``
(``KVSTORE_HYPOTHESIS=long``: thousands of examples, ``KVSTORE_HYPOTHESIS_EXAMPLES`` of them,
5,000 by default, for a run by hand or a nightly job)."""
if HYPOTHESIS_RUN not in ("ci", "long"):
    raise pytest.UsageError(f"KVSTORE_HYPOTHESIS={HYPOTHESIS_RUN!r}: use 'ci' (the default) or 'long'")


def hypothesis_examples(ci: int) -> int:
    """Examples per property: ``ci`` in CI, thousands with ``KVSTORE_HYPOTHESIS=long``."""
    if HYPOTHESIS_RUN != "long":
        return ci
    raw = os.environ.get("KVSTORE_HYPOTHESIS_EXAMPLES", "5000")
    if not raw.isdigit() or int(raw) < 1:
        raise pytest.UsageError(f"KVSTORE_HYPOTHESIS_EXAMPLES={raw!r}: give a whole number of examples (e.g. 5000)")
    return int(raw)


# ---- a real S3 server (moto_server in its own process) --------------------------------------


def _s3_or_skip() -> None:
    import importlib.util

    for module, extra in (("s3fs", "kvstore-llm[s3]"), ("moto", "moto[server]")):
        if importlib.util.find_spec(module) is None:
            pytest.skip(f"{module} is not installed: pip install '{extra}' (make test does)")


def rgw_wanted() -> bool:
    """``KVSTORE_TEST_S3=rgw`` (``make test-rgw``): the S3 tests run against a one-node Ceph RADOS
    Gateway (tools/rgw.py) instead of moto."""
    return os.environ.get("KVSTORE_TEST_S3", "moto") == "rgw"


@pytest.fixture(scope="session")
def rgw_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    """One one-node Ceph (monitor, memstore OSD) for the whole run; gateways come and go."""
    from tools.rgw import INSTALL, RgwCluster, missing_binaries

    if missing := missing_binaries():
        pytest.fail(f"KVSTORE_TEST_S3=rgw needs {', '.join(missing)}: {INSTALL}")
    with RgwCluster(tmp_path_factory.mktemp("ceph")) as cluster:
        yield cluster


@pytest.fixture(scope="session")
def s3_server(request: pytest.FixtureRequest) -> Iterator[Any]:
    """One S3 server for the whole run, on a free loopback port: moto_server, or with
    ``KVSTORE_TEST_S3=rgw`` a RADOS Gateway. Tests that kill or pause a server start their own
    (:func:`own_s3_server`) and leave this one alone."""
    _s3_or_skip()
    if rgw_wanted():
        from tools.rgw import LocalRGW

        with LocalRGW(request.getfixturevalue("rgw_cluster")) as gateway:
            yield gateway
        return
    with LocalS3() as server:
        yield server


@contextlib.contextmanager
def own_s3_server(request: pytest.FixtureRequest) -> Iterator[Any]:
    """A server of a test's own, to kill, pause and restart: a moto_server, or a gateway of the
    session's Ceph (its bucket ``outage`` emptied first: a Ceph keeps objects across tests)."""
    if not rgw_wanted():
        with LocalS3() as server:
            yield server
        return
    from tools.rgw import LocalRGW

    with LocalRGW(request.getfixturevalue("rgw_cluster")) as gateway:
        fs = gateway.fs
        if fs.exists("outage") and (left := fs.find("outage")):
            fs.rm(left)  # the objects only: the bucket stays, as a restarted moto's does not
        yield gateway


_buckets = itertools.count()


def s3_options(server: LocalS3, **overrides: object) -> dict[str, object]:
    """Object tier options on a fresh bucket of ``server``: small timeouts, one attempt, no
    background thread (tests call ``tick()``), so nothing in a test waits on real time."""
    bucket = f"kvs-{os.getpid()}-{next(_buckets)}"
    server.make_bucket(bucket)
    return {
        "url": f"s3://{bucket}/kv",
        **server.tier_options(),
        "connect_timeout_s": 1.0,
        "read_timeout_s": 5.0,
        "max_attempts": 1,
        "worker_interval_s": 0,
        **overrides,
    }


@pytest.fixture
def s3_tier_options(s3_server: LocalS3) -> dict[str, object]:
    """Options of an object tier on a fresh bucket of the session's S3 server."""
    return s3_options(s3_server)
