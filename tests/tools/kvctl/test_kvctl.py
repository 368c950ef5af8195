"""kvctl end to end: against a daemon (--url) and a store directory (--dir), with exit codes."""

from __future__ import annotations

import json
import socket
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from kvstore.client import connect
from kvstore.client.spawn import start_daemon as spawn_daemon
from kvstore.config import StoreConfig
from kvstore.events import EventsConfig
from kvstore.keys import KVLayout, LayerGroup, Namespace, hash_blocks
from kvstore.server.daemon import ThreadedDaemon
from kvstore.store import KVStore
from tests.conftest import BB, SMALL_NS, payload, small_tiers
from tests.kvstore.conftest import start_daemon  # noqa: F401  (the fixture)
from tools.kvctl.cli import main

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
        for _ in range(3):
            s.get_into(SMALL_NS, hashes[:2], np.empty(2 * BB, np.uint8))
    conf = _write(tmp_path / "kv.toml", "".join(  # the store's own tiers: --write opens them as configured
        f'[[tiers]]\nname = "{t.name}"\nkind = "{t.kind}"\n' + "".join(f"{k} = {v}\n" for k, v in t.options.items())
        for t in small_tiers()))
    d = ["--dir", str(root), "--config", str(conf)]
    code, out, err = _run(capsys, *d, "stats", "--json")
    assert code == 0 and json.loads(out)["blocks"] == 4 and err == ""
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


def test_help_documents_the_exit_codes(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as e:
        main(["--help"])
    out: Any = capsys.readouterr().out
    assert e.value.code == 0
    for line in ("0  ok", "2  usage", "3  the daemon cannot be reached", "4  not found", "5  busy"):
        assert line in out
