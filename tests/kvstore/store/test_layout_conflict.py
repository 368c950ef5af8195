"""A registration that conflicts with another layout of the same model deployment is loud:
a warning in the log, a counter and the warnings in ``stats()``; both layouts stay usable."""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import replace

import numpy as np
import pytest

from kvstore.keys import Namespace, hash_blocks
from kvstore.store import KVStore
from tests.conftest import SMALL_NS, payload

FP16 = replace(SMALL_NS, layout=replace(SMALL_NS.layout, dtype="float16"))
BLOCK32 = replace(SMALL_NS, layout=replace(SMALL_NS.layout, block_tokens=32))


def _chain(ns: Namespace, n: int) -> list[bytes]:
    return hash_blocks(ns, np.arange(n * ns.block_tokens, dtype=np.int64))


def _fill(store: KVStore, ns: Namespace) -> None:
    c = _chain(ns, 2)
    store.put(ns, c, [payload(h, ns.block_bytes) for h in c])
    assert store.lookup(ns, c).num_blocks == 2


@pytest.mark.parametrize(("other", "field"), [(FP16, "layout.dtype"), (BLOCK32, "layout.block_tokens")])
def test_a_second_layout_of_one_deployment_warns_counts_and_both_stay_usable(
    make_store: Callable[..., KVStore], caplog: pytest.LogCaptureFixture, other: Namespace, field: str,
) -> None:
    store = make_store(register=False)
    store.register_namespace(SMALL_NS)
    _fill(store, SMALL_NS)
    assert store.stats()["layout_conflicts"] == 0
    with caplog.at_level(logging.WARNING, logger="kvstore.store"):
        store.register_namespace(other)
    s = store.stats()
    assert s["layout_conflicts"] == 1
    [w] = s["layout_conflict_warnings"]
    assert w["namespaces"] == [other.root.hex(), SMALL_NS.root.hex()]
    assert [d.split(":")[0] for d in w["differences"]] == [field]
    assert any("layout conflict" in r.getMessage() and field in r.getMessage() for r in caplog.records)
    assert store.layout_conflicts(other) == [SMALL_NS] and store.layout_conflicts(SMALL_NS) == []
    for ns in (SMALL_NS, other):  # both layouts stay usable
        _fill(store, ns)
        assert store.lookup(ns, _chain(ns, 2)).num_blocks == 2
    assert store.layout_conflicts(SMALL_NS) == [other]  # now that it holds blocks


def test_an_empty_namespace_is_no_conflict(make_store: Callable[..., KVStore],
                                           caplog: pytest.LogCaptureFixture) -> None:
    """An engine that registered one layout and stored nothing (a start that failed on another
    block size) leaves an empty namespace: later starts of the real layout are not warned."""
    store = make_store(register=False)
    store.register_namespace(BLOCK32)  # the failed start: registered, never a block
    with caplog.at_level(logging.WARNING, logger="kvstore.store"):
        for _ in range(2):
            store.register_namespace(SMALL_NS)
    assert store.stats()["layout_conflicts"] == 0 and store.layout_conflicts(SMALL_NS) == []
    assert not [r for r in caplog.records if "layout conflict" in r.getMessage()]
    _fill(store, SMALL_NS)  # once the other side holds blocks, it is one
    store.register_namespace(BLOCK32)
    assert store.stats()["layout_conflicts"] == 1


def test_another_deployment_or_the_same_layout_again_is_no_conflict(
    make_store: Callable[..., KVStore], caplog: pytest.LogCaptureFixture,
) -> None:
    store = make_store(register=False)
    store.register_namespace(SMALL_NS)
    with caplog.at_level(logging.WARNING, logger="kvstore.store"):
        store.register_namespace(SMALL_NS, ttl_s=60.0)  # the same layout, a new TTL
        store.register_namespace(replace(FP16, model_revision="v2"))  # another revision: another deployment
        store.register_namespace(replace(BLOCK32, lora_id="adapter-1"))  # another LoRA
    assert store.stats()["layout_conflicts"] == 0
    assert store.stats()["layout_conflict_warnings"] == []
    assert not [r for r in caplog.records if "layout conflict" in r.getMessage()]


def test_every_conflicting_registration_counts(make_store: Callable[..., KVStore]) -> None:
    store = make_store(register=False)
    store.register_namespace(SMALL_NS)
    _fill(store, SMALL_NS)
    store.register_namespace(FP16)
    _fill(store, FP16)
    store.register_namespace(BLOCK32)  # conflicts with both
    s = store.stats()
    assert s["layout_conflicts"] == 2
    assert [w["namespaces"] for w in s["layout_conflict_warnings"]] == [
        [FP16.root.hex(), SMALL_NS.root.hex()],
        [BLOCK32.root.hex(), SMALL_NS.root.hex()],
        [BLOCK32.root.hex(), FP16.root.hex()],
    ]
