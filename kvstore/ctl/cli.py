"""kvctl: see what a kvstore cache holds, and act on it.

Talks to a daemon (``--url``, default ``$KVSTORE_URL`` or http://127.0.0.1:7070, with an admin
token) or reads a store directory offline (``--dir``): read-only, without locks, so it is safe
beside a running daemon (which it then says is there). See docs/operations.md.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
import time
from collections.abc import Sequence
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from kvstore.config import load_config
from kvstore.ctl import route, term
from kvstore.ctl.backends import BadUsage, DaemonBackend, DirBackend, KvctlError, NotFound
from kvstore.ctl.tokens import load_tokenizer, parse_ids
from kvstore.errors import KVStoreError, UsageError
from kvstore.units import parse_duration
from kvstore.version import version

EXIT_CODES = """exit codes:
  0  ok
  1  error: the daemon or the store refused or failed (the message says why)
  2  usage: bad arguments, or a change asked of a read-only store directory
  3  the daemon cannot be reached (is `kvstore serve` running? or use --dir)
  4  not found: no such block or namespace
  5  busy: --write on a store directory that a live process (a daemon) holds
  6  refused: the store cannot keep the retention guarantee asked (pin --until); nothing was pinned"""

DESCRIPTION = """See what a kvstore cache holds and what it is worth, and act on it.

Sources: a running daemon (--url; its anonymous tenant, or an admin tenant's --token), or a
store directory read offline (--dir, with the daemon's --config if it has one). Offline, nothing
under the directory is written or locked; volatile tiers (DRAM) look empty and hit counts come
from the event log (<dir>/events). Changes (pin, unpin, evict, ttl) go through the daemon;
evict and ttl may change an offline directory with --write, when no daemon holds it (pin and
unpin only through the daemon; `pins` reads them from either source).

Namespaces (NS) are named by their digest, a unique prefix of it, or a unique model id.
Blocks are 32-hex-digit hashes as `top` and `inspect` show them."""


def _common(p: argparse.ArgumentParser, default: Any) -> None:
    g = p.add_argument_group("where to look")
    g.add_argument("--url", default=default, help="daemon URL (default $KVSTORE_URL or http://127.0.0.1:7070)")
    g.add_argument("--token", default=default, help="admin bearer token (default $KVSTORE_TOKEN)")
    g.add_argument("--dir", type=Path, default=default, help="read this store directory offline instead")
    g.add_argument("--config", type=Path, default=default, help="the store's TOML config (its tiers), with --dir")
    g.add_argument("--events", type=Path, default=default, help="event log directory, with --dir (default <dir>/events)")
    g.add_argument("--write", action="store_true", default=default, help="allow evict/ttl to change the --dir directory")
    g.add_argument("--json", action="store_true", default=default, help="print JSON for scripts")


def _prefix_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("the prompt (one of)")
    g.add_argument("--tokens", help="token ids: '1,2,3' or a JSON list")
    g.add_argument("--tokens-file", type=Path, help="a file of token ids (whitespace, commas or a JSON list)")
    g.add_argument("--text", help="prompt text (needs --tokenizer)")
    g.add_argument("--text-file", type=Path, help="a file holding the prompt text (needs --tokenizer)")
    g.add_argument("--hashes", help="stored block hashes, comma separated (as top/inspect show them)")
    p.add_argument("--tokenizer", help="for --text: 'bytes', a tokenizer.json, or a local Hugging Face tokenizer directory or model id (never downloaded)")
    p.add_argument("--no-special-tokens", action="store_true", help="do not add the tokenizer's special tokens (BOS)")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="kvctl", description=DESCRIPTION, epilog=EXIT_CODES,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--version", action="version", version=f"%(prog)s {version()}")
    _common(p, None)
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND")
    parent = argparse.ArgumentParser(add_help=False)
    _common(parent, argparse.SUPPRESS)  # the same options after the command, too

    def cmd(name: str, help: str, desc: str) -> argparse.ArgumentParser:
        return sub.add_parser(name, help=help, description=desc, parents=[parent], epilog=EXIT_CODES,
                              formatter_class=argparse.RawDescriptionHelpFormatter)

    cmd("stats", "the store's counters: blocks, hit rate, moves, evictions",
        "The store's counters: blocks, lookups and hit rate, hits by tier, puts, promotions, "
        "demotions, evictions, expirations, corrupt blocks, the event log's state.")
    cmd("tiers", "capacity, use and bytes in/out of each tier",
        "Each tier, fastest first: kind, capacity, bytes used, blocks, bytes written into it and "
        "served from it since the store opened.")
    cmd("namespaces", "namespaces side by side, with layout-mismatch warnings",
        "Every namespace: model, revision, tenant, dtype, block size, layers, TTL, blocks and bytes. "
        "Warns about namespaces of one model that differ only in layout, dtype or block size: "
        "their blocks never hit each other (an engine configured unlike the rest).")
    lk = cmd("lookup", "which blocks of a prompt are cached, and in which tier",
             "Which leading blocks of a prompt are cached and the fastest tier of each, as the "
             "store would serve them now. The prompt is token ids, a file of them, or text with a "
             "tokenizer.")
    lk.add_argument("ns", metavar="NS", help="namespace: digest, unique digest prefix, or model id")
    _prefix_args(lk)
    tp = cmd("top", "the hottest cached prefixes",
             "The most-hit cached prefixes, each shown by the block where its shared part ends.")
    tp.add_argument("-n", type=int, default=20, help="how many (default 20)")
    tp.add_argument("--ns", help="only this namespace")
    tp.add_argument("--by", choices=["hits", "tokens"], default="hits", help="rank by hits or by tokens served")
    ins = cmd("inspect", "one block: namespace, depth, tiers, hits, expiry, pins",
              "One block's entry: its namespace and layout, depth and tokens covered, tiers, hits, "
              "last access, expiry, pins, children.")
    ins.add_argument("block", metavar="BLOCK")
    for name, verb in (("pin", "Pin"), ("unpin", "Unpin")):
        pp = cmd(name, f"{verb.lower()} a cached prefix (daemon only)",
                 f"{verb} the cached prefix that ends at BLOCK, or that of a prompt (--ns with "
                 "--tokens/--text/...). A pinned prefix neither expires nor is evicted; pins count "
                 "and survive restarts (<dir>/pins.json). "
                 + ("With --until the pin is a guarantee until then (past the TTL, under any "
                    "pressure) that ends by itself; one the store cannot keep is refused (exit 6) "
                    "and pins nothing." if name == "pin" else
                    "Undoes one pin of the longest pinned prefix (a pin with --until only whole: "
                    "unpin the BLOCK it ends at), else takes the blocks out of an untimed pin."))
        pp.add_argument("block", metavar="BLOCK", nargs="?")
        pp.add_argument("--ns", help="namespace of the prompt")
        if name == "pin":
            pp.add_argument("--until", metavar="WHEN",
                            help="keep it until WHEN: a duration from now (24h, 90m, 7d), unix seconds, "
                                 "or an ISO-8601 time (UTC unless it has an offset: 2030-01-01T00:00Z)")
        _prefix_args(pp)
    ps = cmd("pins", "the pins a store holds, with their deadlines",
             "Every pin: the block its prefix ends at (what pin/unpin take), its length, its "
             "deadline (or none: until unpinned), and whether it still holds. Offline it is read "
             "from <dir>/pins.json, which a restart re-applies.")
    ps.add_argument("--ns", help="only this namespace")
    ev = cmd("evict", "delete blocks and every block that extends them",
             "Delete blocks and every cached block that extends them. Pinned or in-use blocks "
             "stay; each asked block that stayed is named with the reason, and the exit code is "
             "1 (4 when none of the blocks was cached).")
    ev.add_argument("blocks", metavar="BLOCK", nargs="+")
    tt = cmd("ttl", "show or set a namespace's TTL",
             "Show a namespace's TTL, or set it (e.g. 72h, 7d): new blocks, and every block on its "
             "next hit, then expire that long after their last use.")
    tt.add_argument("ns", metavar="NS")
    tt.add_argument("duration", metavar="DURATION", nargs="?")
    route.register(cmd)  # kvctl route: several daemons, from their KV events (route.py)
    return p


# ---- helpers --------------------------------------------------------------------------------------


def _backend(args: argparse.Namespace, progress: term.Progress) -> DaemonBackend | DirBackend:
    if args.dir is not None:
        if args.url is not None:
            raise BadUsage("pass --url or --dir, not both")
        if not args.dir.is_dir():
            what = "is a file, not a directory" if args.dir.exists() else "does not exist"
            raise BadUsage(f"--dir {args.dir} {what}: pass the daemon's data directory (kvstore serve --data-dir)")
        try:
            cfg = load_config(args.config, root=args.dir)
        except UsageError as e:
            raise BadUsage(f"--config {args.config}: {e}" if args.config else str(e)) from e
        return DirBackend(cfg, write=bool(args.write), events=args.events, progress=progress)
    if args.write:
        raise BadUsage("--write applies to --dir only; a daemon takes changes as they are")
    url = args.url or os.environ.get("KVSTORE_URL", "http://127.0.0.1:7070")
    token = args.token if args.token is not None else os.environ.get("KVSTORE_TOKEN")
    return DaemonBackend(url, token)


def resolve_ns(backend: DaemonBackend | DirBackend, spec: str) -> str:
    rows = backend.namespaces()["namespaces"]
    s = spec.lower()
    exact = [r for r in rows if r["ns"] == s]
    if exact:
        return str(exact[0]["ns"])
    matches = [r for r in rows if r["ns"].startswith(s)] if len(s) >= 4 else []
    if not matches:
        matches = [r for r in rows if r["model_id"] == spec]
    if len(matches) == 1:
        return str(matches[0]["ns"])
    if not matches:
        raise NotFound(f"no namespace matches {spec!r}; `kvctl namespaces` lists them")
    raise BadUsage(f"{spec!r} matches {len(matches)} namespaces ({', '.join(r['ns'][:12] for r in matches)}); give more of the digest")


def _prompt(args: argparse.Namespace) -> tuple[list[str] | None, list[int] | None]:
    """(hashes, tokens) from the prompt options; exactly one source."""
    given = [k for k in ("tokens", "tokens_file", "text", "text_file", "hashes") if getattr(args, k, None) is not None]
    if len(given) != 1:
        raise BadUsage("give the prompt once: --tokens, --tokens-file, --text, --text-file or --hashes")
    if args.hashes is not None:
        hashes = [h.strip().lower() for h in args.hashes.split(",") if h.strip()]
        if any(len(h) != 32 for h in hashes):
            raise BadUsage("--hashes takes 32-hex-digit block hashes, comma separated")
        return hashes, None
    try:
        if args.tokens is not None:
            return None, parse_ids(args.tokens, "--tokens")
        if args.tokens_file is not None:
            return None, parse_ids(_read(args.tokens_file), str(args.tokens_file))
        text = args.text if args.text is not None else _read(args.text_file)
        if not args.tokenizer:
            raise BadUsage("--text needs --tokenizer (a tokenizer.json, a local tokenizer directory, or 'bytes')")
        return None, load_tokenizer(args.tokenizer, not args.no_special_tokens)(text)
    except UsageError as e:
        raise BadUsage(str(e)) from e


def _read(path: Path) -> str:
    try:
        return path.read_text()
    except OSError as e:
        raise BadUsage(f"cannot read {path}: {e.strerror}") from e


def parse_until(spec: str, now: float) -> float:
    """A wall-clock deadline from ``--until``: a duration from ``now`` (``24h``, ``90m``: a
    number with a unit), unix seconds (a bare number), or an ISO-8601 time (UTC when it carries
    no offset, as kvctl prints times)."""
    s = spec.strip()
    if re.fullmatch(r"[0-9]*\.?[0-9]+", s):
        t = float(s)
        if t < 1e9:  # before 2001: surely a duration without its unit
            raise BadUsage(f"--until {spec}: unix seconds that far back are no deadline; for a duration write a unit ({s}s, 24h)")
        return t
    if re.fullmatch(r"[0-9]*\.?[0-9]+\s*[a-zA-Z]+", s):
        try:
            return now + parse_duration(s, "--until")
        except UsageError as e:
            raise BadUsage(str(e)) from e
    try:
        when = datetime.fromisoformat(s)
    except ValueError:
        raise BadUsage(
            f"--until {spec!r}: write a duration (24h, 90m, 7d), unix seconds, or an ISO-8601 time (2030-01-01T00:00Z)"
        ) from None
    return (when if when.tzinfo else when.replace(tzinfo=UTC)).timestamp()


def _block_arg(h: str) -> str:
    h = h.strip().lower()
    if len(h) != 32 or any(c not in "0123456789abcdef" for c in h):
        raise BadUsage(f"{h!r} is not a block hash (32 hex digits, as `kvctl top` shows)")
    return h


def _print(args: argparse.Namespace, obj: Any, human: Any) -> None:
    if args.json:
        print(json.dumps(obj, indent=2, default=str))
    else:
        human(obj)


# ---- commands -------------------------------------------------------------------------------------


def _show_stats(s: dict[str, Any]) -> None:
    print(f"source: {s['source']}")
    if s.get("offline"):
        print(f"  offline view: {s['blocks']:,} blocks ({term.size(s['bytes'])}) on persistent tiers, "
              f"{s['expired_blocks']:,} already expired, {s['namespaces']} namespaces")
        _show_pin_summary(s)
        return
    print(f"  blocks {s['blocks']:,}  index {term.size(s.get('index_bytes'))}  namespaces {s['namespaces']}")
    # Lookups (what is cached?) and loads (serve it) apart: their hit rates differ by design.
    lb, lh, ld, hb, lt, lht, rt, ht = (s.get(k, 0) for k in (  # an older daemon lacks some
        "lookup_blocks", "lookup_hit_blocks", "load_blocks", "hit_blocks",
        "lookup_tokens", "lookup_hit_tokens", "requested_tokens", "hit_tokens"))
    print(f"  lookups {s['lookups']:,}: blocks asked {lb:,}, found {lh:,} ({term.pct(lh, lb)}); "
          f"tokens asked {lt:,}, found {lht:,} ({term.pct(lht, lt)})")
    print(f"  loads {s['loads']:,}: blocks asked {ld:,}, served {hb:,} ({term.pct(hb, ld)}); "
          f"tokens requested {rt:,}, hit {ht:,} ({term.pct(ht, rt)})")
    if s.get("hit_tokens_by_tier"):
        print("  hit tokens by tier: " + ", ".join(f"{k} {v:,}" for k, v in s["hit_tokens_by_tier"].items()))
    if s.get("layout_conflicts"):
        print(f"  layout conflicts {s['layout_conflicts']:,} (registrations that met another layout of their "
              "model deployment; `kvctl namespaces` lists them):")
        for w in s.get("layout_conflict_warnings", [])[-3:]:
            print(f"    {w['message']}")
    print(f"  puts {s['put_blocks']:,} (+{s['dedup_blocks']:,} deduplicated)  promotions {s['promotions']:,}  "
          f"demotions {s['demotions']:,}")
    print(f"  evictions {s['evictions']:,}  expirations {s['expirations']:,}  corrupt {s['corrupt_blocks']:,}  "
          f"tier errors {s['tier_errors']:,}")
    ev = s.get("events") or {}
    if ev.get("enabled"):
        print(f"  event log {ev['dir']}: {ev['written']:,} records, {ev['dropped']:,} dropped, {term.size(ev['bytes'])}")
    else:
        print("  event log: off ([events] enabled = true turns it on)")
    _show_pin_summary(s)


def _show_pin_summary(s: dict[str, Any]) -> None:
    if s.get("pins_error"):
        print(f"  pins: {s['pins_error']}")
    p = s.get("pins")
    if not p:
        return
    if not p["pins"] and not p.get("ended"):
        print("  pins: none")
        return
    line = f"  pins {p['pins']:,} ({p['timed']:,} until a deadline, {p['untimed']:,} until unpinned) holding {p['pinned_blocks']:,} blocks"
    if p.get("next_until") is not None:
        line += f"; next ends {term.when(p['next_until'])}"
    if p.get("ended"):
        line += f"; {p['ended']:,} ended, released at the next expiry pass"
    print(line)


def _show_pins(d: dict[str, Any]) -> None:
    now = time.time()
    term.table([[r["ns"][:12], r["block"], f"{r['blocks']:,}",
                 term.when(r["until"]) if r["until"] is not None else "until unpinned",
                 term.duration(r["until"] - now) if r["until"] is not None else "",
                 "" if r["active"] else "ended"] for r in d["pins"]],
               ["ns", "prefix ends at block", "blocks", "until", "in", ""], right=(2,))
    _show_pin_summary({"pins": d["summary"]})


def _show_tiers(tiers: list[dict[str, Any]]) -> None:
    rows = [[t["name"], t["kind"], "yes" if t.get("persistent") else "no", term.size(t.get("capacity_bytes")),
             term.size(t.get("used_bytes")), term.pct(t.get("used_bytes") or 0, t.get("capacity_bytes") or 0),
             f"{t.get('blocks', 0):,}", term.size(t.get("bytes_in")), term.size(t.get("bytes_out")), t.get("note", "")]
            for t in tiers]
    term.table(rows, ["tier", "kind", "persistent", "capacity", "used", "use", "blocks", "in", "out", ""],
               right=(3, 4, 5, 6, 7, 8))


def _show_namespaces(d: dict[str, Any]) -> None:
    rows = [[r["ns"][:12], r["model_id"], r["revision"], r.get("tenant") or "", r["dtype"], r["block_tokens"],
             r["layers"], term.size(r["block_bytes"]), term.duration(r["ttl_s"]), f"{r['blocks']:,}", term.size(r["bytes"])]
            for r in d["namespaces"]]
    term.table(rows, ["ns", "model", "rev", "tenant", "dtype", "blk tok", "layers", "block", "ttl", "blocks", "bytes"],
               right=(5, 7, 8, 9, 10))
    for w in d["warnings"]:
        print(f"warning: {w['message']}")


def _show_lookup(r: dict[str, Any]) -> None:
    bt, n, total = r["block_tokens"], r["num_blocks"], r["blocks"]
    print(f"{n} of {total} blocks cached: {n * bt:,} of {total * bt:,} tokens ({term.pct(n, total)}) in namespace {r['ns'][:12]}")
    runs: list[list[Any]] = []
    labels = list(r["tiers"]) + ["miss"] * (total - n)
    for i, label in enumerate(labels):
        if runs and runs[-1][3] == label:
            runs[-1][1] = i
        else:
            runs.append([i, i, r["hashes"][i], label])
    rows = [[f"{a}-{b}" if a != b else str(a), f"{a * bt:,}-{(b + 1) * bt - 1:,}", h, label] for a, b, h, label in runs]
    if rows:
        term.table(rows, ["blocks", "tokens", "first block", "tier"])
    if r.get("unavailable"):
        print(f"unreachable now (not counted): {', '.join(r['unavailable'])}")


def _show_top(rows: list[dict[str, Any]]) -> None:
    now = time.time()
    term.table([[i + 1, r["hash"], r["namespace"][:12], f"{r['tokens']:,}", f"{r['hits']:,}", f"{r['tokens_served']:,}",
                 ",".join(r["tiers"]), term.duration(r["expiry"] - now), "pinned" if r.get("pins") else ""]
                for i, r in enumerate(rows)],
               ["#", "prefix ends at block", "ns", "tokens", "hits", "tokens served", "tiers", "expires in", ""],
               right=(0, 3, 4, 5))


def _show_block(r: dict[str, Any]) -> None:
    now = time.time()
    info = r.get("namespace_info") or {}
    print(f"block {r['hash']}")
    print(f"  namespace    {r['namespace']}" + (f"  ({info['model_id']} {info['dtype']} x{info['block_tokens']} tokens)" if info else ""))
    print(f"  depth        {r['depth']} (block {r['depth'] + 1} of its prefix" + (f", {r['tokens']:,} tokens" if "tokens" in r else "") + ")")
    print(f"  parent       {r.get('parent') or '- (first block)'}")
    print(f"  size         {term.size(r['size'])}")
    print(f"  tiers        {', '.join(r['tiers']) or '- (hollow)'}")
    print(f"  hits         {r.get('hits', '-')}")
    if r.get("created") is not None:
        print(f"  created      {term.when(r['created'])} ({term.duration(now - r['created'])} ago)")
    if r.get("last_access") is not None:
        print(f"  last access  {term.when(r['last_access'])} ({term.duration(now - r['last_access'])} ago)")
    print(f"  expires      {term.when(r['expiry'])} (in {term.duration(r['expiry'] - now)})")
    print(f"  pins {r.get('pins', 0)}  in use {r.get('in_use', 0)}  children {r.get('children', '-')}")
    if r.get("pin_until"):
        print("  pinned       " + "; ".join(
            f"until {term.when(u)} (in {term.duration(u - now)})" if u is not None else "until unpinned"
            for u in r["pin_until"]))


def _block_or_none(backend: DaemonBackend | DirBackend, h: str) -> dict[str, Any] | None:
    try:
        return backend.block(h)
    except NotFound:
        return None


def _kept_reason(row: dict[str, Any]) -> str:
    h = row["hash"]
    if row.get("pins"):
        return (f"block {h} is pinned ({row['pins']} pin(s)): pinned blocks are never evicted; "
                f"`kvctl unpin {h}` first (`kvctl pins` lists them)")
    if row.get("in_use"):
        return f"block {h} is being read ({row['in_use']} load(s) in flight); try again once they finish"
    return f"block {h} is still cached (a pinned or in-use block extends it, or the store refused)"


def _evict(args: argparse.Namespace, backend: DaemonBackend | DirBackend) -> int:
    """Evict, then say why each asked block that is still there stayed: exit 0 only when every
    asked block is gone, 4 when none of them was cached, 1 when some stayed."""
    blocks = [_block_arg(b) for b in args.blocks]
    before = {h: _block_or_none(backend, h) for h in blocks}
    out = backend.evict(blocks)
    kept = [r for h in blocks if before[h] is not None and (r := _block_or_none(backend, h)) is not None]
    missing = [h for h in blocks if before[h] is None]
    out = {**out, "kept": [{"block": r["hash"], "reason": _kept_reason(r)} for r in kept], "not_found": missing}
    _print(args, out, lambda o: print(f"evicted {o['blocks']} blocks"))
    for k in out["kept"]:
        print(f"kvctl: not evicted: {k['reason']}", file=sys.stderr)
    for h in missing:
        print(f"kvctl: not evicted: block {h} is not cached (`kvctl top` shows the cached ones)", file=sys.stderr)
    if kept:
        return 1
    return 4 if missing and len(missing) == len(blocks) else 0


def run(args: argparse.Namespace, progress: term.Progress) -> int:
    if getattr(args, "handler", None) is not None:  # a command with its own module (route)
        return args.handler(args)
    backend = _backend(args, progress)
    try:
        if isinstance(backend, DirBackend) and args.command not in ("evict", "ttl"):
            warning = backend.warning()
            if warning:
                print(f"kvctl: warning: {warning}", file=sys.stderr)
        c = args.command
        if c == "stats":
            _print(args, backend.stats(), _show_stats)
        elif c == "tiers":
            _print(args, backend.tiers(), _show_tiers)
        elif c == "namespaces":
            _print(args, backend.namespaces(), _show_namespaces)
        elif c == "lookup":
            hashes, tokens = _prompt(args)
            _print(args, backend.lookup(resolve_ns(backend, args.ns), hashes, tokens), _show_lookup)
        elif c == "top":
            ns = resolve_ns(backend, args.ns) if args.ns else None
            _print(args, backend.top(args.n, ns, args.by), _show_top)
        elif c == "inspect":
            _print(args, backend.block(_block_arg(args.block)), _show_block)
        elif c in ("pin", "unpin"):
            if args.block is not None:
                prefix: dict[str, Any] = {"block": _block_arg(args.block)}
            elif args.ns is not None:
                hashes, tokens = _prompt(args)
                prefix = {"ns": resolve_ns(backend, args.ns), **({"tokens": tokens} if tokens is not None else {"hashes": hashes})}
            else:
                raise BadUsage(f"{c} needs a BLOCK, or --ns with the prompt (--tokens, --text, ...)")
            until = parse_until(args.until, time.time()) if getattr(args, "until", None) else None
            out = backend.pin(prefix, undo=c == "unpin", until=until)
            _print(args, out, lambda o: print(f"{c}ned {o['blocks']} blocks" + (
                f" until {term.when(o['until'])}" if o.get("until") is not None and o["blocks"] else "")))
        elif c == "pins":
            ns = resolve_ns(backend, args.ns) if args.ns else None
            _print(args, backend.pins(ns), _show_pins)
        elif c == "evict":
            return _evict(args, backend)
        elif c == "ttl":
            ttl = None
            if args.duration is not None:
                try:
                    ttl = parse_duration(args.duration, "DURATION")
                except UsageError as e:
                    raise BadUsage(str(e)) from e
                if ttl <= 0:
                    raise BadUsage("a TTL must be positive")
            out = backend.ttl(resolve_ns(backend, args.ns), ttl)
            _print(args, out, lambda o: print(f"namespace {o['ns'][:12]}: ttl {term.duration(o['ttl_s'])}"))
    finally:
        progress.done()
        backend.close()
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    progress = term.Progress()
    try:
        return run(args, progress)
    except KvctlError as e:
        print(f"kvctl: {e}", file=sys.stderr)
        return e.exit_code
    except KVStoreError as e:
        print(f"kvctl: {e}", file=sys.stderr)
        return 2 if isinstance(e, UsageError) else 1
    except BrokenPipeError:  # `kvctl top | head`
        return 0


if __name__ == "__main__":
    sys.exit(main())
