"""kvctl end to end: against a daemon (--url) and a store directory (--dir), with exit codes."""

from __future__ import annotations

import json
import socket
import time
from collections.abc import Callable
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from kvstore.client import connect
from kvstore.client.spawn import start_daemon as spawn_daemon
from kvstore.clock import FakeClock
from kvstore.config import StoreConfig
from kvstore.ctl import term
from kvstore.ctl.backends import BadUsage
from kvstore.ctl.cli import main, parse_until
from kvstore.events import EventsConfig
from kvstore.keys import KVLayout, LayerGroup, Namespace, hash_blocks
from kvstore.server.daemon import ThreadedDaemon
from kvstore.store import KVStore
from tests.conftest import BB, SMALL_NS, payload, small_tiers
from tests.kvstore.conftest import start_daemon  # noqa: F401  (the fixture)

CORPUS = ["the cache keeps the prefix", "a prefix computed once is loaded, not recomputed",
          "the store keeps it for seventy two hours"] * 20
PROMPT = "the cache keeps the prefix computed once for seventy two hours " * 6


@pytest.fixture(scope="module")
def tokenizer_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A BPE tokenizer trained here on a tiny corpus: nothing is downloaded."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE(unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.train_from_iterator(CORPUS, trainers.BpeTrainer(vocab_size=120, special_tokens=["[UNK]"]))
    path = tmp_path_factory.mktemp("tok") / "tokenizer.json"
    tok.save(str(path))
    return path


def _run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    out = capsys.readouterr()
    return code, out.out, out.err


def _tokens(tokenizer_file: Path) -> list[int]:
    from tokenizers import Tokenizer

    return Tokenizer.from_file(str(tokenizer_file)).encode(PROMPT).ids


def test_against_a_daemon(start_daemon: Callable[..., ThreadedDaemon], tokenizer_file: Path,  # noqa: F811
                          capsys: pytest.CaptureFixture[str]) -> None:
    d = start_daemon()
    toks = _tokens(tokenizer_file)
    hashes = hash_blocks(SMALL_NS, toks)
    assert len(hashes) >= 3
    with connect(d.url) as c:
        c.put(SMALL_NS, hashes[:-1], [payload(h) for h in hashes[:-1]])
        c.get_into(SMALL_NS, hashes[:2], np.empty(2 * BB, np.uint8))
    url = ["--url", d.url]
    code, out, _ = _run(capsys, *url, "stats", "--json")
    assert code == 0 and json.loads(out)["blocks"] == len(hashes) - 1
    code, out, _ = _run(capsys, "tiers", *url)
    assert code == 0 and "dram" in out and "bytes_in" not in out
    code, out, _ = _run(capsys, *url, "namespaces")
    assert code == 0 and SMALL_NS.model_id in out and "warning" not in out
    code, out, _ = _run(capsys, *url, "lookup", SMALL_NS.model_id, "--text", PROMPT, "--tokenizer", str(tokenizer_file), "--json")
    r = json.loads(out)
    assert code == 0 and r["num_blocks"] == len(hashes) - 1 and r["blocks"] == len(hashes)
    code, out, _ = _run(capsys, *url, "lookup", SMALL_NS.root.hex()[:8], "--tokens", ",".join(map(str, toks)))
    assert code == 0 and f"{len(hashes) - 1} of {len(hashes)} blocks cached" in out and "miss" in out
    code, out, _ = _run(capsys, *url, "top", "-n", "1", "--json")
    (top,) = json.loads(out)
    assert top["hash"] == hashes[1].hex() and top["hits"] == 1
    code, out, _ = _run(capsys, *url, "inspect", hashes[1].hex())
    assert code == 0 and "depth        1" in out and "hits         1" in out
    assert _run(capsys, *url, "pin", hashes[1].hex())[1].strip() == "pinned 2 blocks"
    assert _run(capsys, *url, "unpin", "--ns", SMALL_NS.model_id, "--hashes", hashes[0].hex())[1].strip() == "unpinned 1 blocks"
    assert "ttl 4d 0h" in _run(capsys, *url, "ttl", SMALL_NS.model_id, "96h")[1]
    assert _run(capsys, *url, "evict", hashes[2].hex())[1].strip() == f"evicted {len(hashes) - 3} blocks"
    # Exit codes that mean something.
    code, _, err = _run(capsys, *url, "inspect", "ab" * 16)
    assert code == 4 and "not cached" in err
    code, _, err = _run(capsys, *url, "lookup", "no-such-model", "--tokens", "1")
    assert code == 4
    code, _, err = _run(capsys, *url, "lookup", SMALL_NS.model_id, "--text", "x")
    assert code == 2 and "--tokenizer" in err
    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        dead = f"http://127.0.0.1:{s.getsockname()[1]}"
    code, _, err = _run(capsys, "--url", dead, "stats")
    assert code == 3 and "--dir" in err
    with pytest.raises(SystemExit) as e:
        main(["stats", "--bogus"])
    assert e.value.code == 2


def test_against_a_store_directory(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    root = tmp_path / "store"
    other = Namespace(SMALL_NS.model_id, KVLayout("float16", 16, (LayerGroup("full", 1, 1, 64),)))
    cfg = StoreConfig(root=root, tiers=small_tiers(), events=EventsConfig(enabled=True))
    toks = np.arange(16 * 4)
    hashes = hash_blocks(SMALL_NS, toks)
    with KVStore(cfg) as s:
        s.register_namespace(SMALL_NS)
        s.register_namespace(other)
        s.put(SMALL_NS, hashes, [payload(h) for h in hashes])
        theirs = hash_blocks(other, toks[:16])  # a block: an empty namespace is no conflict
        s.put(other, theirs, [payload(h, other.block_bytes) for h in theirs])
        for _ in range(3):
            s.get_into(SMALL_NS, hashes[:2], np.empty(2 * BB, np.uint8))
    conf = _write(tmp_path / "kv.toml", "".join(  # the store's own tiers: --write opens them as configured
        f'[[tiers]]\nname = "{t.name}"\nkind = "{t.kind}"\n' + "".join(f"{k} = {v}\n" for k, v in t.options.items())
        for t in small_tiers()))
    d = ["--dir", str(root), "--config", str(conf)]
    code, out, err = _run(capsys, *d, "stats", "--json")
    assert code == 0 and json.loads(out)["blocks"] == 5 and err == ""
    code, out, _ = _run(capsys, *d, "namespaces")
    assert code == 0 and "warning:" in out and "layout.dtype: 'bfloat16' vs 'float16'" in out
    ns = SMALL_NS.root.hex()
    code, out, _ = _run(capsys, *d, "lookup", ns, "--tokens-file", str(_write(tmp_path / "t.txt", " ".join(map(str, toks)))), "--json")
    assert code == 0 and json.loads(out)["num_blocks"] == 4
    code, out, _ = _run(capsys, *d, "top", "--json")  # hits from the event log
    assert code == 0 and json.loads(out)[0]["hash"] == hashes[1].hex() and json.loads(out)[0]["hits"] == 3
    code, out, _ = _run(capsys, *d, "inspect", hashes[0].hex(), "--json")
    assert code == 0 and json.loads(out)["hits"] == 3 and json.loads(out)["created"] is not None
    code, _, err = _run(capsys, *d, "pin", hashes[0].hex())
    assert code == 2 and "--url" in err
    code, _, err = _run(capsys, *d, "evict", hashes[2].hex())
    assert code == 2 and "--write" in err
    assert _run(capsys, *d, "ttl", ns)[1].strip() == f"namespace {ns[:12]}: ttl 3d 0h"
    assert _run(capsys, *d, "--write", "evict", hashes[2].hex())[0] == 0
    assert _run(capsys, *d, "--write", "ttl", ns, "5d")[0] == 0
    code, out, _ = _run(capsys, *d, "lookup", ns, "--hashes", ",".join(h.hex() for h in hashes), "--json")
    assert json.loads(out)["num_blocks"] == 2
    assert _run(capsys, *d, "ttl", ns, "--json")[1].count("432000") == 1


def test_a_relative_store_directory(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                    capsys: pytest.CaptureFixture[str]) -> None:
    """The README's `kvctl --dir ./kvstore-data tiers`: a relative path reads the NVMe tier's
    RocksDB as an absolute one does (its read-only view links to the files by absolute path)."""
    root = tmp_path / "kvstore-data"
    hashes = hash_blocks(SMALL_NS, np.arange(16 * 3))
    with KVStore(StoreConfig(root=root, tiers=small_tiers())) as s:
        s.register_namespace(SMALL_NS)
        s.put(SMALL_NS, hashes, [payload(h) for h in hashes], durable=True)
    monkeypatch.chdir(tmp_path)
    code, out, err = _run(capsys, "--dir", "./kvstore-data", "tiers", "--json")
    assert code == 0, err
    nvme = next(t for t in json.loads(out) if t["kind"] == "nvme")
    assert nvme["blocks"] == 3
    code, out, err = _run(capsys, "--dir", "kvstore-data", "stats", "--json")
    assert code == 0 and json.loads(out)["blocks"] == 3, err


def _write(path: Path, text: str) -> Path:
    path.write_text(text)
    return path


def test_a_directory_held_by_a_live_daemon(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    root = tmp_path / "data"
    with spawn_daemon(root) as d:
        hashes = hash_blocks(SMALL_NS, np.arange(32))
        with connect(d.url) as c:
            c.put(SMALL_NS, hashes, [payload(h) for h in hashes], durable=True)
        code, out, err = _run(capsys, "--dir", str(root), "stats", "--json")
        assert code == 0 and json.loads(out)["live_process"] == d.pid
        assert f"pid {d.pid}" in err and "--url" in err
        code, _, err = _run(capsys, "--dir", str(root), "--write", "evict", hashes[0].hex())
        assert code == 5 and "will not take its place" in err
        assert _run(capsys, "--url", d.url, "stats", "--json")[0] == 0


def _conf(path: Path, tiers: Any) -> Path:
    """A TOML config naming the store's tiers, for --dir."""
    return _write(path, "".join(
        f'[[tiers]]\nname = "{t.name}"\nkind = "{t.kind}"\n' + "".join(f"{k} = {v}\n" for k, v in t.options.items())
        for t in tiers))


def test_pin_until_through_a_daemon_then_offline(start_daemon: Callable[..., ThreadedDaemon], tmp_path: Path,  # noqa: F811
                                                 capsys: pytest.CaptureFixture[str]) -> None:
    # The store's fake clock starts at the real time: kvctl's durations ("96h") and the offline
    # view (--dir) use the real clock, and deadlines here are hours away from both.
    clock = FakeClock(time.time())
    tiers = small_tiers(dram_blocks=4, nvme_blocks=8, object_blocks=8)  # guarantees may take 4 blocks
    root = tmp_path / "data"
    d = start_daemon(root=root, tiers=tiers, clock=clock)
    a, b, c = (hash_blocks(SMALL_NS, np.arange(16 * n) + 1000 * i) for i, n in ((1, 3), (2, 2), (3, 1)))
    with connect(d.url) as cl:
        for chain in (a, b, c):
            cl.put(SMALL_NS, chain, [payload(h) for h in chain])
    url = ["--url", d.url]
    until = float(int(clock()) + 100 * 3600)  # whole seconds: an ISO time carries microseconds
    iso = datetime.fromtimestamp(until, UTC).isoformat()
    assert _run(capsys, *url, "pin", c[0].hex())[1].strip() == "pinned 1 blocks"
    code, out, _ = _run(capsys, *url, "pin", a[-1].hex(), "--until", iso)
    assert code == 0 and out.strip() == f"pinned 3 blocks until {term.when(until)}"
    code, out, _ = _run(capsys, *url, "pin", "--ns", SMALL_NS.model_id, "--hashes", a[0].hex(), "--until", "96h", "--json")
    assert code == 0 and json.loads(out)["blocks"] == 1 and json.loads(out)["until"] > clock() + 95 * 3600
    code, _, err = _run(capsys, *url, "pin", b[-1].hex(), "--until", "90m")  # 1 + 3 + 2 blocks > 4
    assert code == 6 and "cannot guarantee 2 blocks" in err and "unpin prefixes" in err
    code, _, err = _run(capsys, *url, "pin", b[-1].hex(), "--until", "3600")
    assert code == 2 and "write a unit" in err
    with pytest.raises(SystemExit) as e:  # unpin takes no deadline
        main([*url, "unpin", a[-1].hex(), "--until", "1h"])
    assert e.value.code == 2
    capsys.readouterr()
    assert _run(capsys, *url, "unpin", "--ns", SMALL_NS.model_id, "--hashes", a[1].hex())[1].strip() == "unpinned 0 blocks"

    def check(src: list[str]) -> None:
        code, out, _ = _run(capsys, *src, "pins", "--json")
        p = json.loads(out)
        assert code == 0 and [(r["block"], r["blocks"], r["active"]) for r in p["pins"]] == [
            (c[0].hex(), 1, True), (a[-1].hex(), 3, True), (a[0].hex(), 1, True)]
        assert p["pins"][0]["until"] is None and p["pins"][1]["until"] == until
        assert p["summary"]["pins"] == 3 and p["summary"]["timed"] == 2 and p["summary"]["pinned_blocks"] == 4
        code, out, _ = _run(capsys, *src, "pins", "--ns", SMALL_NS.model_id)
        assert code == 0 and "until unpinned" in out and term.when(until) in out and "pins 3 (2 until a deadline" in out
        code, out, _ = _run(capsys, *src, "inspect", a[0].hex(), "--json")
        r = json.loads(out)
        assert r["pins"] == 2 and until in r["pin_until"] and len(r["pin_until"]) == 2
        code, out, _ = _run(capsys, *src, "inspect", a[-1].hex())
        assert "pins 1" in out and f"pinned       until {term.when(until)}" in out
        code, out, _ = _run(capsys, *src, "stats", "--json")
        assert json.loads(out)["pins"]["pins"] == 3 and json.loads(out)["pins"]["next_until"] < until
        assert "pins 3 (2 until a deadline, 1 until unpinned) holding 4 blocks" in _run(capsys, *src, "stats")[1]

    check(url)
    d.stop()
    clock.advance(80 * 3600)  # past every TTL while the daemon is down; before the deadlines
    dirs = ["--dir", str(root), "--config", str(_conf(tmp_path / "kv.toml", tiers))]
    check(dirs)
    code, _, err = _run(capsys, *dirs, "pin", a[-1].hex(), "--until", "1h")
    assert code == 2 and "--url" in err
    d = start_daemon(root=root, tiers=tiers, clock=clock)
    check(["--url", d.url])
    r = json.loads(_run(capsys, "--url", d.url, "lookup", SMALL_NS.model_id, "--hashes", ",".join(h.hex() for h in a + b), "--json")[1])
    assert r["num_blocks"] == 3  # kept past the TTL; b was not pinned
    assert _run(capsys, "--url", d.url, "unpin", a[-1].hex())[1].strip() == "unpinned 3 blocks"


def test_until_accepts_durations_unix_seconds_and_iso_times() -> None:
    now = 1_700_000_000.0
    assert parse_until("24h", now) == now + 86400 and parse_until("90m", now) == now + 5400
    assert parse_until("1767225600", now) == 1767225600.0
    assert parse_until("2030-01-01T00:00:00Z", now) == parse_until("2030-01-01T01:00:00+01:00", now) == 1893456000.0
    assert parse_until("2030-01-01", now) == 1893456000.0  # no offset: UTC, as kvctl prints times
    for bad in ("3600", "tomorrow", "5 parsecs"):
        with pytest.raises(BadUsage):
            parse_until(bad, now)


def test_help_documents_the_exit_codes(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as e:
        main(["--help"])
    out: Any = capsys.readouterr().out
    assert e.value.code == 0
    for line in ("0  ok", "2  usage", "3  the daemon cannot be reached", "4  not found", "5  busy", "6  refused"):
        assert line in out


def test_evict_of_a_pinned_block_says_why_and_fails(start_daemon: Callable[..., ThreadedDaemon],  # noqa: F811
                                                    capsys: pytest.CaptureFixture[str]) -> None:
    d = start_daemon()
    hashes = hash_blocks(SMALL_NS, list(range(4 * SMALL_NS.block_tokens)))
    with connect(d.url) as c:
        c.put(SMALL_NS, hashes, [payload(h) for h in hashes])
    url = ["--url", d.url]
    assert _run(capsys, *url, "pin", hashes[1].hex())[0] == 0
    code, out, err = _run(capsys, *url, "evict", hashes[1].hex())
    assert code == 1 and out.strip() == "evicted 2 blocks"  # its unpinned children went
    assert f"not evicted: block {hashes[1].hex()} is pinned (1 pin(s))" in err and "kvctl unpin" in err
    code, out, _ = _run(capsys, *url, "evict", hashes[1].hex(), "--json")
    assert code == 1 and json.loads(out)["kept"][0]["block"] == hashes[1].hex()
    code, _, err = _run(capsys, *url, "evict", "ab" * 16)
    assert code == 4 and "is not cached" in err
    assert _run(capsys, *url, "unpin", hashes[1].hex())[0] == 0
    assert _run(capsys, *url, "evict", hashes[0].hex()) == (0, "evicted 2 blocks\n", "")


def test_common_mistakes_name_the_flag_and_the_file(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code, _, err = _run(capsys, "--url", "http://127.0.0.1:9", "lookup", "m", "--text", "hi",
                        "--tokenizer", "./missing.json")
    assert code == 2 and "--tokenizer ./missing.json: no such file or directory" in err
    code, _, err = _run(capsys, "--dir", str(tmp_path / "nope"), "stats")
    assert code == 2 and f"--dir {tmp_path / 'nope'} does not exist" in err
    (tmp_path / "file").write_text("")
    code, _, err = _run(capsys, "--dir", str(tmp_path / "file"), "stats")
    assert code == 2 and "is a file, not a directory" in err


def test_version(capsys: pytest.CaptureFixture[str]) -> None:
    from kvstore.version import version

    with pytest.raises(SystemExit) as e:
        main(["--version"])
    assert e.value.code == 0 and capsys.readouterr().out.strip() == f"kvctl {version()}"
