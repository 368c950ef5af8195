"""The README's commands, run as written in one fresh directory, in the order a new user runs
them: the in-process example (it leaves ./kvstore-data), the daemon on it (`.venv/bin/kvstore
serve`, `curl .../healthz`), the client example, every `kvctl` and `kvreport` line (the daemon's,
then `kvctl --dir ./kvstore-data tiers`, a relative path, and the report once it stopped), and
the configuration example loaded. Placeholders (MODEL, BLOCK) are filled in; nothing else is
changed. `make docs-check` runs these tests alone."""

from __future__ import annotations

import os
import re
import shlex
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from kvstore.config import load_config
from tests.docs.doccommands import stop_gracefully

ROOT = Path(__file__).resolve().parents[2]
README = (ROOT / "README.md").read_text()
MODEL = "meta-llama/Llama-3.1-8B"  # the model the README's examples register


def _blocks(lang: str) -> list[str]:
    """The fenced blocks of the README whose info string is ``lang`` ("" for bare fences)."""
    out: list[str] = []
    current: list[str] | None = None
    kind = ""
    for line in README.splitlines():
        if line.startswith("```"):
            if current is None:
                current, kind = [], line[3:].strip()
            else:
                if kind == lang:
                    out.append("\n".join(current) + "\n")
                current = None
        elif current is not None:
            current.append(line)
    return out


def _block_with(needle: str, lang: str = "") -> str:
    (block,) = [b for b in _blocks(lang) if needle in b]
    return block


def _commands(block: str) -> list[str]:
    """Each line's command, without its trailing comment."""
    out = []
    for line in block.splitlines():
        cmd = re.split(r"\s{2,}#\s", line, maxsplit=1)[0].strip()
        if cmd:
            out.append(cmd)
    return out


def _port_free(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def _tokenizer(path: Path) -> None:
    """A tokenizer.json trained here (the README's `--tokenizer ./tokenizer.json`)."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE(unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.train_from_iterator(["the cache keeps the prefix computed once"] * 10,
                            trainers.BpeTrainer(vocab_size=60, special_tokens=["[UNK]"]))
    tok.save(str(path))


@pytest.mark.slow
def test_the_readme_commands_run_as_written(tmp_path: Path) -> None:
    if not (_port_free(7070) and _port_free(7071)):
        pytest.skip("the README's daemon listens on 7070/7071, which another process holds here")
    venv = Path(sys.executable).parent.parent
    (tmp_path / ".venv").symlink_to(venv)  # `.venv/bin/kvstore` as in the checkout's root
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVSTORE_")}
    env |= {"PATH": f"{venv / 'bin'}{os.pathsep}{env.get('PATH', '')}",
            "PYTHONPATH": os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH", "")) if p)}

    def run(cmd: str, timeout: float = 300) -> str:
        out = subprocess.run(["bash", "-c", cmd], cwd=tmp_path, env=env, capture_output=True, text=True,
                             timeout=timeout, check=False)
        assert out.returncode == 0, f"{cmd!r} exited {out.returncode}:\n{out.stdout[-2000:]}\n{out.stderr[-2000:]}"
        return out.stdout

    def python(code: str) -> str:
        return run(f"python -c {shlex.quote(code)}")

    # 1. The in-process example: ./kvstore-data with 16 blocks on NVMe.
    out = python(_block_with("KVStore(load_config", "python"))
    assert "0 of 16 blocks cached" in out and "num_blocks=16" in out

    # 2. The daemon on the same directory (the README's first line of its block), and its check.
    serve, _with_config, health = _commands(_block_with("kvstore serve"))
    assert serve == ".venv/bin/kvstore serve" and health.startswith("curl")
    log = (tmp_path / "daemon.log").open("w")
    daemon = subprocess.Popen(["bash", "-c", f"exec {serve}"], cwd=tmp_path, env=env, stdout=log,
                              stderr=subprocess.STDOUT, start_new_session=True)
    try:
        deadline = time.monotonic() + 120  # a hang, not a timing
        while True:
            assert daemon.poll() is None, (tmp_path / "daemon.log").read_text()
            try:
                with urllib.request.urlopen("http://127.0.0.1:7070/healthz", timeout=5):
                    break
            except (urllib.error.URLError, ConnectionError):
                assert time.monotonic() < deadline, (tmp_path / "daemon.log").read_text()
                time.sleep(0.2)
        assert run(health).strip() == '{"status":"ok"}'

        # 3. The client example: the same API through the daemon, shared memory on this node.
        out = python(_block_with("connect()", "python"))
        assert out.split() == ["shm", "64"]

        # 4. kvctl and kvreport, placeholders filled in.
        _tokenizer(tmp_path / "tokenizer.json")
        lines = _commands(_block_with("kvctl stats"))
        assert any(line == "kvctl --dir ./kvstore-data tiers" for line in lines)
        offline = [line for line in lines if "--dir" in line or line.startswith("kvreport")]
        top = run("kvctl top -n 1 --json")
        block = re.search(r'"hash": "([0-9a-f]{32})"', top)
        assert block, top
        for line in lines:
            if line in offline:
                continue
            out = run(line.replace("MODEL", MODEL).replace("BLOCK", block.group(1)))
        assert "pinned" in out  # the last daemon line: kvctl top ... && kvctl pin BLOCK
    finally:
        stop_gracefully(daemon, log)  # the graceful stop writes the event log out
    assert daemon.returncode == 0, (tmp_path / "daemon.log").read_text()

    # 5. Offline: the store directory by a relative path, and the report of its event log.
    for line in offline:
        out = run(line)
        if line.startswith("kvctl --dir"):
            nvme = re.search(r"(?m)^nvme .*?\b(\d+)\s+-\s+-\s*$", out)
            assert nvme and int(nvme.group(1)) >= 16, out  # the example's blocks, read offline
    assert (tmp_path / "report.html").read_text().startswith("<!doctype html>")


def test_the_readme_configuration_loads(tmp_path: Path) -> None:
    toml = _block_with("[[tiers]]", "toml")
    (tmp_path / "kvstore.toml").write_text(toml)
    cfg = load_config(tmp_path / "kvstore.toml", env={})
    assert [t.kind for t in cfg.tiers] == ["dram", "nvme", "object"]
    example = re.search(r"e\.g\. `(KVSTORE_TIER_DRAM_CAPACITY_BYTES=[^`]+)`, `(KVSTORE_DEFAULT_TTL=[^`]+)`", README)
    assert example, "the README's environment example moved"
    env = dict(kv.split("=", 1) for kv in example.groups())
    cfg = load_config(tmp_path / "kvstore.toml", env=env)
    assert cfg.default_ttl_s == 96 * 3600
