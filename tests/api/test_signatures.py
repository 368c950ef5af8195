"""Static agreement: ``KVStore`` and ``Client`` declare every :class:`KVCacheAPI` method with
the protocol's parameters (names, kinds, defaults, types) and compatible return types, so a
drift (a positional ``start``, a dict where a list is due, a missing method) fails here."""

from __future__ import annotations

import inspect
import typing
from collections.abc import Sequence
from typing import Any

import pytest

from kvstore.api import KVCacheAPI, Lease, LeaseLike, PinLike
from kvstore.client import Client, ClientLease, ClientPin
from kvstore.keys import Namespace
from kvstore.retention import PinRecord
from kvstore.store import KVStore

MEMBERS = (
    "register_namespace", "lookup", "get_into", "put", "pin", "unpin", "pins", "delete",
    "acquire", "release", "stats", "close", "__enter__", "__exit__",
)
IMPLEMENTATIONS = [(KVStore, Lease, PinRecord), (Client, ClientLease, ClientPin)]


def _protocol_members() -> list[str]:
    return sorted(
        n for n, v in vars(KVCacheAPI).items() if inspect.isfunction(v) and v.__qualname__.startswith("KVCacheAPI.")
    )


def _data_members(proto: type) -> set[str]:
    return {n for n, v in vars(proto).items() if isinstance(v, property)}


def _conforms(cls: type, proto: type) -> bool:
    """``cls`` offers every attribute of the data protocol ``proto`` (a field or a property)."""
    hints = typing.get_type_hints(cls)
    return all(n in hints or isinstance(getattr(cls, n, None), property) for n in _data_members(proto))


def _resolve(hint: Any, impl: type, lease: type) -> Any:
    """The protocol's hint with its type variable and ``Self`` bound for ``impl``."""
    if hint is typing.Self:
        return impl
    if isinstance(hint, typing.TypeVar):
        return lease
    return hint


def drift(impl: type, lease: type, pin: type) -> list[str]:
    """How ``impl`` departs from :class:`KVCacheAPI` (empty: it agrees)."""
    out: list[str] = []
    for name in MEMBERS:
        if not callable(getattr(impl, name, None)):
            out.append(f"{name}: missing")
            continue
        want, have = inspect.signature(getattr(KVCacheAPI, name)), inspect.signature(getattr(impl, name))
        want_hints = typing.get_type_hints(getattr(KVCacheAPI, name))
        have_hints = typing.get_type_hints(getattr(impl, name))
        wp, hp = list(want.parameters.values()), list(have.parameters.values())
        if [(p.name, p.kind, p.default) for p in wp] != [(p.name, p.kind, p.default) for p in hp]:
            out.append(f"{name}: parameters {have} differ from the protocol's {want}")
            continue
        for p in wp[1:]:
            w, h = _resolve(want_hints.get(p.name), impl, lease), have_hints.get(p.name)
            if w != h:
                out.append(f"{name}: parameter {p.name} is {h}, the protocol's is {w}")
        w, h = _resolve(want_hints.get("return"), impl, lease), have_hints.get("return")
        if name == "pins":  # a sequence of pins: the store's records, the client's rows
            args = typing.get_args(h)
            ok = typing.get_origin(h) in (list, tuple, Sequence) and len(args) == 1 and args[0] is pin
            if not ok or not _conforms(pin, PinLike):
                out.append(f"pins returns {h}; the protocol's is a sequence of PinLike")
        elif name == "acquire":
            if h is not lease or not _conforms(lease, LeaseLike):
                out.append(f"acquire returns {h}; the protocol's is a LeaseLike ({lease.__name__})")
        elif name == "__enter__":
            if not (isinstance(h, type) and issubclass(impl, h)):
                out.append(f"__enter__ returns {h}, not the implementation ({impl.__name__})")
        elif w != h:
            out.append(f"{name}: returns {h}, the protocol's {w}")
    return out


def test_the_protocol_has_the_methods_of_the_api() -> None:
    assert sorted(MEMBERS) == _protocol_members()


@pytest.mark.parametrize(("impl", "lease", "pin"), IMPLEMENTATIONS, ids=["store", "client"])
def test_implementation_declares_the_protocol(impl: type, lease: type, pin: type) -> None:
    assert drift(impl, lease, pin) == []


def test_a_drifting_implementation_is_caught() -> None:
    class Drifted(KVStore):
        def put(self, ns: Namespace, hashes: Sequence[bytes], blocks: Any, start: int = 0, durable: bool = False) -> int:
            return 0

        def pins(self) -> dict[str, Any]:  # type: ignore[override]
            return {}

        def lookup(self, ns: Namespace, hashes: list[bytes]) -> Any:  # type: ignore[override]
            return None

    found = drift(Drifted, Lease, PinRecord)
    assert [d.split(":")[0].split(" ")[0] for d in found] == ["lookup", "lookup", "put", "pins"]
