"""Where kvctl's answers come from: a daemon (``--url``, its ``/v1/admin`` endpoints) or a store
directory read offline (``--dir``, :class:`kvstore.store.snapshot.StoreSnapshot`). Both return the
same JSON-able shapes, so every command renders one way whatever the source."""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from kvstore.client.control import ControlClient
from kvstore.config import StoreConfig
from kvstore.errors import (
    AuthError,
    BlockNotFound,
    DaemonUnavailableError,
    ForbiddenError,
    KVStoreError,
    LayoutMismatchError,
    MissingPrefixError,
    RetentionError,
    UnknownNamespaceError,
    UsageError,
)
from kvstore.eventread import read_events
from kvstore.events import decode_hashes, key_int
from kvstore.inspection import layout_warnings, namespace_row, top_prefixes
from kvstore.keys import BlockHash, Namespace, hash_blocks
from kvstore.store.snapshot import Progress, StoreSnapshot


class KvctlError(Exception):
    """A failure to report; ``exit_code`` says which kind (see ``kvctl --help``)."""

    exit_code = 1


class BadUsage(KvctlError):
    exit_code = 2


class Unreachable(KvctlError):
    exit_code = 3


class NotFound(KvctlError):
    exit_code = 4


class Busy(KvctlError):
    exit_code = 5


class Refused(KvctlError):
    """The store cannot give what was asked: a retention guarantee (``pin --until``) it could
    not keep (HTTP 409)."""

    exit_code = 6


class DaemonBackend:
    """A running daemon's control plane (:class:`kvstore.client.control.ControlClient`); every
    call needs an admin tenant's token (or the daemon's anonymous tenant, which is admin)."""

    def __init__(self, url: str, token: str | None = None, timeout: float = 60.0) -> None:
        self.url = url.rstrip("/")
        self._daemon = ControlClient(self.url, token=token, timeout=timeout)

    def close(self) -> None:
        self._daemon.close()

    def _call(self, fn: Callable[[], Any]) -> Any:
        """``fn()``, a call of the control client, with the daemon's refusals as kvctl's errors."""
        try:
            return fn()
        except DaemonUnavailableError as e:
            raise Unreachable(
                f"cannot reach the kvstore daemon at {self.url} ({e}); is it running (`kvstore serve`)? "
                "To read a store directory without a daemon: kvctl --dir DIR ..."
            ) from e
        except (AuthError, ForbiddenError) as e:
            raise KvctlError(f"the daemon refused: {e}; kvctl needs an admin tenant's token (--token or $KVSTORE_TOKEN)") from None
        except (UnknownNamespaceError, BlockNotFound) as e:
            raise NotFound(str(e)) from None
        except (RetentionError, LayoutMismatchError, MissingPrefixError) as e:
            raise Refused(f"the daemon refused: {e}") from None
        except UsageError as e:
            raise BadUsage(str(e)) from None
        except KVStoreError as e:
            raise KvctlError(str(e)) from None

    def stats(self) -> dict[str, Any]:
        s = self._call(self._daemon.stats)
        if "store" not in s:
            raise KvctlError("the daemon shows store-wide stats only to an admin tenant; pass an admin --token")
        return {"source": self.url, **s["store"], "tenants": s.get("tenants", []), "pins": self.pins(None)["summary"]}

    def tiers(self) -> list[dict[str, Any]]:
        return list(self.stats()["tiers"])

    def namespaces(self) -> dict[str, Any]:
        return dict(self._call(self._daemon.admin_namespaces))

    def lookup(self, ns: str, hashes: Sequence[str] | None, tokens: Sequence[int] | None) -> dict[str, Any]:
        return dict(self._call(lambda: self._daemon.admin_lookup(ns, hashes, tokens)))

    def top(self, n: int, ns: str | None, by: str) -> list[dict[str, Any]]:
        return list(self._call(lambda: self._daemon.admin_top(n, ns, by)))

    def block(self, h: str) -> dict[str, Any]:
        return dict(self._call(lambda: self._daemon.admin_block(h)))

    def pin(self, prefix: dict[str, Any], undo: bool, until: float | None = None) -> dict[str, Any]:
        if undo:
            return dict(self._call(lambda: self._daemon.admin_unpin(prefix)))
        return dict(self._call(lambda: self._daemon.admin_pin(prefix, until)))

    def pins(self, ns: str | None) -> dict[str, Any]:
        return dict(self._call(lambda: self._daemon.admin_pins(ns)))

    def evict(self, blocks: Sequence[str]) -> dict[str, Any]:
        return dict(self._call(lambda: self._daemon.admin_evict(blocks)))

    def ttl(self, ns: str, ttl_s: float | None) -> dict[str, Any]:
        if ttl_s is None:
            row = next((r for r in self.namespaces()["namespaces"] if r["ns"] == ns), None)
            if row is None:
                raise NotFound(f"namespace {ns} is not registered")
            return {"ns": ns, "ttl_s": row["ttl_s"]}
        return dict(self._call(lambda: self._daemon.admin_ttl(ns, ttl_s)))


class DirBackend:
    """A store directory, read-only unless ``write`` (``--write``: only for ``evict`` and
    ``ttl``, and only while no live process holds the directory)."""

    def __init__(self, config: StoreConfig, *, write: bool = False, events: Path | None = None,
                 progress: Progress | None = None) -> None:
        self.config = config
        self.write = write
        self.events = events if events is not None else config.events.directory(config.root)
        self._progress = progress
        self._snap: StoreSnapshot | None = None

    def close(self) -> None:
        pass

    @property
    def snap(self) -> StoreSnapshot:
        if self._snap is None:
            try:
                self._snap = StoreSnapshot(self.config, progress=self._progress)
            except KVStoreError as e:
                raise KvctlError(str(e)) from e
        return self._snap

    def warning(self) -> str | None:
        """What a reader of an offline view must know: a live process serves this directory."""
        pid = self.snap.holder
        if pid is None:
            return None
        return (f"a live process (pid {pid}) holds {self.config.root}, probably a daemon: this view shows "
                "only what its persistent tiers and pins.json hold, not its DRAM tier nor its hit counts; "
                "ask it instead with --url URL (`kvstore serve` prints it)")

    def stats(self) -> dict[str, Any]:
        return {"source": str(self.config.root), **self.snap.stats()}

    def tiers(self) -> list[dict[str, Any]]:
        return self.snap.tiers()

    def _ns_rows(self) -> list[dict[str, Any]]:
        usage = self.snap.namespace_usage()
        return [namespace_row(ns, ttl, *usage.get(ns.root, (0, 0))) for ns, ttl in self.snap.namespaces()]

    def namespaces(self) -> dict[str, Any]:
        rows = self._ns_rows()
        return {"namespaces": rows, "warnings": layout_warnings(rows, skip_empty=True)}

    def _namespace(self, ns: str) -> Namespace:
        for n, _ in self.snap.namespaces():
            if n.root.hex() == ns:
                return n
        raise NotFound(f"namespace {ns} is not in {self.config.root}")

    def lookup(self, ns: str, hashes: Sequence[str] | None, tokens: Sequence[int] | None) -> dict[str, Any]:
        n = self._namespace(ns)
        if tokens is not None:
            if n.tenant_salt:
                raise BadUsage(
                    f"namespace {ns} belongs to a daemon's tenant: its block keys need the daemon's "
                    "secret, so token ids cannot be hashed offline; use --url, or --hashes"
                )
            keys = hash_blocks(n, tokens)
        else:
            keys = [BlockHash(bytes.fromhex(h)) for h in hashes or []]
        hit, tiers = self.snap.lookup(n.root, keys)
        return {"ns": ns, "blocks": len(keys), "num_blocks": hit, "num_tokens": hit * n.block_tokens,
                "block_tokens": n.block_tokens, "tiers": tiers, "unavailable": [], "hashes": [k.hex() for k in keys]}

    def _hits(self) -> Counter[int]:
        """Hits per block (logged key) from the event log: offline, the only record of them."""
        if not self.events.is_dir():
            raise KvctlError(
                f"hit counts live in a running store's memory; offline they come from the event log, and "
                f"{self.events} has none (enable [events], or use --url)"
            )
        hits: Counter[int] = Counter()
        for i, rec in enumerate(read_events(self.events, types=("request",))):
            if rec.get("h") and rec["hit_blocks"]:
                hits.update(decode_hashes(rec["h"])[: rec["hit_blocks"]].tolist())
            if self._progress and i % 1000 == 0:
                self._progress("reading the event log", i)
        return hits

    def top(self, n: int, ns: str | None, by: str) -> list[dict[str, Any]]:
        hits = self._hits()
        rows = []
        for r in self.snap.iter_blocks():
            if ns is None or r["namespace"] == ns:
                r["hits"] = hits.get(key_int(bytes.fromhex(r["hash"])), 0)
                rows.append(r)
        bt = {x.root.hex(): x.block_tokens for x, _ in self.snap.namespaces()}
        return top_prefixes(rows, n, bt, by)

    def block(self, h: str) -> dict[str, Any]:
        row = next(self.snap.iter_blocks([bytes.fromhex(h)]), None)
        if row is None:
            raise NotFound(f"block {h} is not in {self.config.root}")
        if self.events.is_dir():
            row["hits"] = self._hits().get(key_int(bytes.fromhex(h)), 0)
        try:
            ns = self._namespace(row["namespace"])
        except NotFound:
            return row
        return {**row, "tokens": (row["depth"] + 1) * ns.block_tokens, "namespace_info": namespace_row(ns, None)}

    def pin(self, prefix: dict[str, Any], undo: bool, until: float | None = None) -> dict[str, Any]:
        raise BadUsage(
            "a store directory is read-only here: pin and unpin through the daemon that serves it "
            "(kvctl --url URL pin ...); `kvctl --dir DIR pins` shows the pins it holds"
        )

    def pins(self, ns: str | None) -> dict[str, Any]:
        return self.snap.pins(ns)

    def _writable_store(self) -> Any:
        if not self.write:
            raise BadUsage(
                f"{self.config.root} is opened read-only; pass --write to change a store directory that no "
                "daemon serves, or use --url to ask the daemon"
            )
        if self.snap.holder is not None:
            raise Busy(
                f"a live process (pid {self.snap.holder}) holds {self.config.root}; kvctl will not take its "
                "place: use --url URL to ask it"
            )
        from kvstore.store import KVStore

        return KVStore(self.config)

    def evict(self, blocks: Sequence[str]) -> dict[str, Any]:
        rows = {r["hash"]: r for r in self.snap.iter_blocks([bytes.fromhex(h) for h in blocks])}
        with self._writable_store() as store:
            removed = sum(store.delete(self._namespace(r["namespace"]), [bytes.fromhex(h)]) for h, r in rows.items())
        self._snap = None  # the directory changed: read it again
        return {"blocks": removed}

    def ttl(self, ns: str, ttl_s: float | None) -> dict[str, Any]:
        n = self._namespace(ns)
        if ttl_s is None:
            return {"ns": ns, "ttl_s": next(t for x, t in self.snap.namespaces() if x.root == n.root)}
        with self._writable_store() as store:
            store.register_namespace(n, ttl_s)
        return {"ns": ns, "ttl_s": ttl_s}
