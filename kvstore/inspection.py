"""What an operator asks about a store's contents, computed the same way for a live daemon
(kvstore/server/admin.py) and for a store directory read offline (kvstore/store/snapshot.py).

Everything here works on plain rows: namespace rows (:func:`namespace_row`) and block rows as
``KVStore.iter_blocks()`` yields them (hash, namespace, parent, depth, size, tiers, hits, ...).
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable, Iterable, Mapping
from typing import Any

from kvstore.keys import Namespace
from kvstore.retention import PinRecord

# Fields of a namespace descriptor that name a model deployment; namespaces equal in these but
# different in the rest (layout, dtype, block size, hash, schema) can never share a block.
_DEPLOYMENT = ("model_id", "model_revision", "rank", "world_size", "lora_id", "tenant_salt")


def namespace_row(ns: Namespace, ttl_s: float | None, blocks: int = 0, nbytes: int = 0,
                  tenant: str = "") -> dict[str, Any]:
    lay = ns.layout
    groups = ", ".join(
        f"{g.num_layers}x{g.kind}"
        + (f"(latent {g.latent_dim}+{g.rope_dim})" if g.kind == "mla" else f"({g.kv_heads}h x {g.head_dim})")
        + (f"[window {g.window}]" if g.kind == "sliding" else "")
        for g in lay.groups
    )
    return {
        "ns": ns.root.hex(),
        "model_id": ns.model_id,
        "revision": ns.model_revision,
        "tenant": tenant,
        "salted": bool(ns.tenant_salt),
        "rank": f"{ns.rank}/{ns.world_size}",
        "lora_id": ns.lora_id,
        "dtype": lay.dtype,
        "block_tokens": lay.block_tokens,
        "layers": groups,
        "block_bytes": ns.block_bytes,
        "ttl_s": ttl_s,
        "blocks": blocks,
        "bytes": nbytes,
        "descriptor": ns.to_dict(),
    }


def layout_warnings(rows: Iterable[Mapping[str, Any]], *, skip_empty: bool = False) -> list[dict[str, Any]]:
    """Namespaces of one model deployment that differ only in layout (dtype, block size, layer
    shapes, hash, schema): the silent-zero-hit mistake, an engine configured differently from
    the one that filled the cache. One warning per pair, listing the differing fields. With
    ``skip_empty`` (an inventory with block counts), a row with ``blocks == 0`` (registered,
    nothing cached: an engine whose start failed) is left out: nothing of it can be missed."""
    by_model: dict[tuple[Any, ...], list[Mapping[str, Any]]] = defaultdict(list)
    for r in rows:
        if skip_empty and r.get("blocks") == 0:
            continue
        d = r["descriptor"]
        by_model[tuple(d.get(k) for k in _DEPLOYMENT)].append(r)
    out: list[dict[str, Any]] = []
    for group in by_model.values():
        for i, a in enumerate(group):
            for b in group[i + 1 :]:
                diffs = [f"{k}: {x!r} vs {y!r}" for k, x, y in _diff(a["descriptor"], b["descriptor"])]
                out.append({
                    "model_id": a["model_id"], "namespaces": [a["ns"], b["ns"]], "differences": diffs,
                    "message": (
                        f"namespaces {a['ns'][:12]} and {b['ns'][:12]} of model {a['model_id']!r} differ only "
                        f"in {'; '.join(diffs)}: their blocks never hit each other. If one engine "
                        "is misconfigured, align its layout; if both are meant, ignore this."
                    ),
                })
    return out


def layout_conflicts(ns: Namespace, registered: Iterable[Namespace]) -> list[dict[str, Any]]:
    """:func:`layout_warnings` of ``ns`` against each of ``registered`` (namespaces of its model
    deployment with another layout): what a registration that conflicts reports. Each warning's
    ``namespaces`` is ``[ns, the registered one]`` and its differences read ``ns``'s value first."""
    # The caller chose ``registered`` (those that hold blocks): no row is left out as empty here.
    new = {**namespace_row(ns, None), "blocks": None}
    return [w for other in registered for w in layout_warnings([new, {**namespace_row(other, None), "blocks": None}])]


def _diff(a: Mapping[str, Any], b: Mapping[str, Any], prefix: str = "") -> Iterable[tuple[str, Any, Any]]:
    for k in sorted(set(a) | set(b)):
        va, vb = a.get(k), b.get(k)
        if isinstance(va, Mapping) and isinstance(vb, Mapping):
            yield from _diff(va, vb, f"{prefix}{k}.")
        elif isinstance(va, list) and isinstance(vb, list) and len(va) == len(vb):
            for i, (x, y) in enumerate(zip(va, vb, strict=True)):
                if isinstance(x, Mapping) and isinstance(y, Mapping):
                    yield from _diff(x, y, f"{prefix}{k}[{i}].")
                elif x != y:
                    yield f"{prefix}{k}[{i}]", x, y
        elif va != vb:
            yield f"{prefix}{k}", va, vb


def top_prefixes(rows: Iterable[Mapping[str, Any]], n: int, block_tokens: Mapping[str, int],
                 by: str = "hits") -> list[dict[str, Any]]:
    """The hottest cached prefixes. A prefix is reported by its *last* block: one whose hits
    exceed every child's (where a shared part ends, e.g. a system prompt before the users'
    turns diverge), so a chain of equally hit blocks shows once, at its full length.

    ``by``: "hits" (how often it was served) or "tokens" (hits x prefix tokens: the prefill it
    saved). ``block_tokens``: tokens per block of each namespace (hex digest).
    """
    if by not in ("hits", "tokens"):
        raise ValueError(f"by must be 'hits' or 'tokens', got {by!r}")
    rows = [r for r in rows if r.get("hits")]
    best_child: dict[str, int] = defaultdict(int)
    for r in rows:
        if r.get("parent"):
            best_child[r["parent"]] = max(best_child[r["parent"]], int(r["hits"]))
    out = []
    for r in rows:
        if int(r["hits"]) <= best_child.get(r["hash"], 0):
            continue
        bt = block_tokens.get(r["namespace"], 0)
        tokens = (int(r["depth"]) + 1) * bt
        out.append({**r, "blocks": int(r["depth"]) + 1, "tokens": tokens, "tokens_served": int(r["hits"]) * tokens})
    key = (lambda r: (r["hits"], r["tokens"])) if by == "hits" else (lambda r: (r["tokens_served"], r["hits"]))
    out.sort(key=key, reverse=True)
    return out[:n]


def chain_to(block: str, parent_of: Callable[[str], str | None], limit: int = 1 << 20) -> list[str]:
    """The hashes from the first block of ``block``'s prefix down to ``block`` (hex), following
    ``parent_of`` (None at the first block)."""
    chain = [block]
    while (p := parent_of(chain[-1])) is not None:
        chain.append(p)
        if len(chain) > limit:
            raise RuntimeError(f"the prefix of {block} is longer than {limit} blocks: a cycle?")
    chain.reverse()
    return chain


def pin_rows(records: Iterable[PinRecord], now: float) -> list[dict[str, Any]]:
    """Pin records (``pins.json``) as rows: the namespace, the block the pinned prefix ends at
    (what ``kvctl pin BLOCK`` / ``unpin BLOCK`` take), its length, its deadline (None: until
    unpinned) and whether it still holds (``active`` false: the deadline passed and the store
    lets go of it at its next expiry pass, or drops it at its next open)."""
    return [
        {"ns": r.ns.hex(), "block": r.hashes[-1].hex(), "first": r.hashes[0].hex(), "blocks": len(r.hashes),
         "until": r.until, "active": r.until is None or r.until > now}
        for r in records if r.hashes
    ]


def pin_deadlines(records: Iterable[PinRecord], now: float) -> dict[bytes, list[float | None]]:
    """``{block key: [deadline of each pin holding it (None: until unpinned)]}`` over the pins
    that still hold."""
    out: dict[bytes, list[float | None]] = defaultdict(list)
    for r in records:
        if r.until is None or r.until > now:
            for h in r.hashes:
                out[h].append(r.until)
    return dict(out)


def pin_summary(records: Iterable[PinRecord], now: float) -> dict[str, Any]:
    """How many pins hold (timed, untimed), how many blocks they hold, the next deadline, and
    how many have ended but are still on record."""
    records = list(records)
    rows = pin_rows(records, now)
    active = [r for r in rows if r["active"]]
    deadlines = [r["until"] for r in active if r["until"] is not None]
    return {"pins": len(active), "timed": len(deadlines), "untimed": len(active) - len(deadlines),
            "pinned_blocks": len(pin_deadlines(records, now)), "next_until": min(deadlines, default=None),
            "ended": len(rows) - len(active)}


def pin_report(records: Iterable[PinRecord], now: float, ns: str | None = None) -> dict[str, Any]:
    """``{"pins": pin_rows, "summary": pin_summary}`` of every pin, or of namespace ``ns`` (hex);
    what ``kvctl pins`` shows, the same for a daemon and a store directory."""
    records = [r for r in records if ns is None or r.ns.hex() == ns]
    return {"pins": pin_rows(records, now), "summary": pin_summary(records, now)}
