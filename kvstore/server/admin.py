"""Admin endpoints for operators (``kvctl``): the whole store, every tenant, by stored keys.

Tenant endpoints (app.py) speak in a tenant's own namespace ids and hashes; these speak in what
the store holds: namespace digests and block keys as ``kvctl top`` and ``kvctl inspect`` show
them. Token ids are hashed the way the namespace's tenant would have hashed them (the daemon
knows every tenant's key), so ``kvctl lookup --text`` works on any tenant's namespace.
Every endpoint needs an admin tenant; every store call runs in the daemon's thread pool.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import replace
from typing import Annotated, Any

from fastapi import APIRouter, Depends, Query
from fastapi import Path as PathParam
from pydantic import BaseModel, ConfigDict, Field

from kvstore.errors import BlockNotFound, UnknownNamespaceError, UsageError
from kvstore.inspection import (
    chain_to,
    layout_warnings,
    namespace_row,
    pin_deadlines,
    pin_report,
    top_prefixes,
)
from kvstore.keys import Namespace, hash_blocks
from kvstore.retention import PinRecord
from kvstore.server.dataplane import DataContext
from kvstore.server.service import Service, Tenant

HEX16 = r"^[0-9a-fA-F]{32}$"
Hex = Annotated[str, Field(pattern=HEX16)]


class _Body(BaseModel):
    model_config = ConfigDict(extra="forbid")


class PrefixIn(_Body):
    """A prefix: the chain ending at ``block``, or ``ns`` with its ``hashes`` (stored keys) or
    ``tokens`` (hashed as the namespace's tenant hashes them)."""

    block: Hex | None = None
    ns: Hex | None = None
    hashes: list[Hex] | None = None
    tokens: list[Annotated[int, Field(ge=-(2**31), lt=2**31)]] | None = None


class PinIn(PrefixIn):
    until: float | None = Field(
        default=None, gt=0, allow_inf_nan=False,
        description="wall-clock deadline (unix seconds): a retention guarantee until then (409 when "
        "the store cannot honour it); omit it for a pin that holds until unpinned",
    )


class EvictIn(_Body):
    blocks: list[Hex] = Field(min_length=1)


class TtlIn(_Body):
    ns: Hex
    ttl_s: float = Field(gt=0)


def _tenant_names(svc: Service) -> dict[str, str]:
    """tenant salt -> tenant name ("" is the anonymous tenant's: no salt)."""
    return {t.salt: t.name for t in svc.tenants()}


def _namespace(svc: Service, ns_hex: str) -> Namespace:
    want = bytes.fromhex(ns_hex)
    for ns, _ in svc.store.namespaces():
        if ns.root == want:
            return ns
    raise UnknownNamespaceError(f"namespace {ns_hex} is not registered in this store; see kvctl namespaces")


def _owner(svc: Service, ns: Namespace) -> Tenant:
    for t in svc.tenants():
        if t.salt == ns.tenant_salt:
            return t
    raise UsageError(
        f"namespace {ns.root.hex()} belongs to no configured tenant (its salt matches none); "
        "pass stored block hashes instead of tokens"
    )


def _prefix(svc: Service, body: PrefixIn) -> tuple[Namespace, list[bytes]]:
    """The namespace and stored keys a :class:`PrefixIn` names."""
    store = svc.store
    if body.block is not None:
        if body.ns or body.hashes or body.tokens:
            raise UsageError("send either 'block' or 'ns' with 'hashes' or 'tokens', not both")
        row = next(store.iter_blocks([bytes.fromhex(body.block)]), None)
        if row is None:
            raise BlockNotFound(f"block {body.block} is not cached")

        def parent_of(h: str) -> str | None:
            r = next(store.iter_blocks([bytes.fromhex(h)]), None)
            return r["parent"] if r else None

        return _namespace(svc, row["namespace"]), [bytes.fromhex(h) for h in chain_to(body.block, parent_of)]
    if body.ns is None or (body.hashes is None) == (body.tokens is None):
        raise UsageError("send 'block', or 'ns' with exactly one of 'hashes' or 'tokens'")
    ns = _namespace(svc, body.ns)
    if body.hashes is not None:
        keys = [bytes.fromhex(h) for h in body.hashes]
    else:
        t = _owner(svc, ns)
        client_ns = replace(ns, tenant_salt="")
        keys = svc.store_keys(t, ns, hash_blocks(client_ns, body.tokens))
    if len(keys) > svc.limits.max_blocks:
        raise UsageError(f"{len(keys)} blocks exceed the limit of {svc.limits.max_blocks} per request")
    return ns, keys


def _namespaces(svc: Service) -> dict[str, Any]:
    usage = svc.store.namespace_usage()
    names = _tenant_names(svc)
    rows = [
        namespace_row(ns, ttl, *usage.get(ns.root, (0, 0)), tenant=names.get(ns.tenant_salt, "?"))
        for ns, ttl in svc.store.namespaces()
    ]
    return {"namespaces": rows, "warnings": layout_warnings(rows, skip_empty=True)}


def _lookup(svc: Service, body: PrefixIn) -> dict[str, Any]:
    ns, keys = _prefix(svc, body)
    r = svc.store.peek(ns, keys)  # an operator's question: not engine traffic
    return {"ns": ns.root.hex(), "blocks": len(keys), "num_blocks": r.num_blocks, "num_tokens": r.num_tokens,
            "block_tokens": ns.block_tokens, "tiers": list(r.tiers), "unavailable": list(r.unavailable),
            "hashes": [k.hex() for k in keys]}


def _top(svc: Service, n: int, ns: str | None, by: str) -> list[dict[str, Any]]:
    bt = {ns_.root.hex(): ns_.block_tokens for ns_, _ in svc.store.namespaces()}
    rows = (r for r in svc.store.iter_blocks() if ns is None or r["namespace"] == ns)
    return top_prefixes(rows, n, bt, by)


def _pin_records(svc: Service) -> list[PinRecord]:
    """The store's pin records in force (what ``pins.json`` holds and a restart re-applies)."""
    return svc.store.pins()


def _pins(svc: Service, ns: str | None) -> dict[str, Any]:
    return pin_report(_pin_records(svc), svc.clock(), ns)


def _block(svc: Service, h: str) -> dict[str, Any]:
    row = next(svc.store.iter_blocks([bytes.fromhex(h)]), None)
    if row is None:
        raise BlockNotFound(f"block {h} is not cached")
    row["pin_until"] = pin_deadlines(_pin_records(svc), svc.clock()).get(bytes.fromhex(h), [])
    try:
        ns = _namespace(svc, row["namespace"])
    except UnknownNamespaceError:
        return row
    return {**row, "tokens": (row["depth"] + 1) * ns.block_tokens,
            "namespace_info": namespace_row(ns, None, tenant=_tenant_names(svc).get(ns.tenant_salt, "?"))}


def _pin(svc: Service, body: PrefixIn, undo: bool) -> dict[str, Any]:
    ns, keys = _prefix(svc, body)
    if undo:
        return {"blocks": svc.store.unpin(ns, keys)}
    until = body.until if isinstance(body, PinIn) else None
    n = svc.store.pin(ns, keys, until=until)
    return {"blocks": n} if until is None else {"blocks": n, "until": until}


def _evict(svc: Service, blocks: Sequence[str]) -> dict[str, int]:
    removed = 0
    for h in blocks:
        row = next(svc.store.iter_blocks([bytes.fromhex(h)]), None)
        if row is not None:
            removed += svc.store.delete(_namespace(svc, row["namespace"]), [bytes.fromhex(h)])
    svc.refresh_usage()
    return {"blocks": removed}


def _ttl(svc: Service, body: TtlIn) -> dict[str, Any]:
    ns = _namespace(svc, body.ns)
    svc.store.register_namespace(ns, body.ttl_s)
    return {"ns": body.ns, "ttl_s": body.ttl_s}


def admin_router(ctx: DataContext, admin: Callable[..., Any]) -> APIRouter:
    """The ``/v1/admin`` endpoints; ``admin`` is the dependency that admits admin tenants."""
    svc = ctx.service
    r = APIRouter(prefix="/v1/admin", tags=["admin"], dependencies=[Depends(admin)])

    @r.get("/namespaces")
    async def namespaces() -> dict[str, Any]:
        """Every namespace in the store, its tenant, layout, TTL and usage, and warnings about
        namespaces of one model that differ only in layout (they never share a block)."""
        return await ctx.run(_namespaces, svc)

    @r.post("/lookup")
    async def lookup(body: PrefixIn) -> dict[str, Any]:
        """Which leading blocks of a prefix are cached, and the fastest tier of each."""
        return await ctx.run(_lookup, svc, body)

    @r.get("/top")
    async def top(n: Annotated[int, Query(ge=1, le=10_000)] = 20,
                  ns: Annotated[str | None, Query(pattern=HEX16)] = None,
                  by: Annotated[str, Query(pattern="^(hits|tokens)$")] = "hits") -> list[dict[str, Any]]:
        """The hottest cached prefixes (by hits, or by tokens served)."""
        return await ctx.run(_top, svc, n, ns, by)

    @r.get("/blocks/{block}")
    async def block(block: Annotated[str, PathParam(pattern=HEX16)]) -> dict[str, Any]:
        """One block's index entry: namespace, depth, tiers, hits, expiry, pins."""
        return await ctx.run(_block, svc, block)

    @r.get("/pins")
    async def pins(ns: Annotated[str | None, Query(pattern=HEX16)] = None) -> dict[str, Any]:
        """Every pin record (or one namespace's): the block its prefix ends at, its length, its
        deadline (null: until unpinned) and whether it still holds; and a summary."""
        return await ctx.run(_pins, svc, ns)

    @r.post("/pin")
    async def pin(body: PinIn) -> dict[str, Any]:
        """Pin a cached prefix: it neither expires nor is evicted until unpinned, or, with
        ``until``, guaranteed until then (409 when the store cannot honour it)."""
        return await ctx.run(_pin, svc, body, False)

    @r.post("/unpin")
    async def unpin(body: PrefixIn) -> dict[str, Any]:
        """Undo one pin of the longest pinned prefix (a pin with a deadline only whole), else
        take the blocks out of an untimed pin."""
        return await ctx.run(_pin, svc, body, True)

    @r.post("/evict")
    async def evict(body: EvictIn) -> dict[str, int]:
        """Delete blocks and every cached block that extends them (pinned ones are kept)."""
        return await ctx.run(_evict, svc, body.blocks)

    @r.post("/ttl")
    async def ttl(body: TtlIn) -> dict[str, Any]:
        """Set a namespace's TTL: new blocks, and every block on its next hit, expire that long
        after their last use."""
        return await ctx.run(_ttl, svc, body)

    return r
