"""The commands the docs show, and the check that a tool's own argument parser accepts one.

``extract`` finds every command of ``docs/*.md``: each line of a fenced block with a shell info
string (``bash``, ``sh``, ``shell``; ``console``: its ``$ `` lines) or of a bare fence where a line starts with a
command, and every inline code span that starts with a command a user runs (``python -m ...``,
``kvctl``, ``kvreport``, ``kvstore serve``, ``make``, ``curl``, ``vllm``, ``pip``...). Usage
notation in a command (``[--opt X]``, ``{a,b}``, ``BLOCK...``) is expanded by ``variants``.

``parse`` runs a command's program in this process up to its argument parser and stops it there:
the command line is accepted or rejected by the tool itself (its choices, types and required
arguments), nothing is run. Programs are found by what the command names (``python -m MODULE``,
a console script of ``pyproject.toml``), so a module that moves keeps being found.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import importlib
import importlib.util
import io
import os
import re
import runpy
import shlex
import signal
import subprocess
import sys
import tomllib
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any
from unittest import mock

ROOT = Path(__file__).resolve().parents[2]
SHELL_FENCES = {"bash", "sh", "shell", "console"}

_ENV = r"(?:[A-Z_][A-Z0-9_]*=\S*\s+)*"
_BIN = r"(?:\.venv[\w-]*/bin/|/opt/kvstore/bin/)?"
_PROGRAM = (r"(?:python3?\s+-m\s+\S+|python3?\s+-c\s|kvctl|kvreport|kvstore-demo|kvstore|make|curl|vllm"
            r"|pip|zstdcat|docker|systemctl|export|for)")
COMMAND = re.compile(rf"^{_ENV}{_BIN}{_PROGRAM}(?:\s|$)")
_NAMES = {"kvctl", "kvreport", "kvstore", "kvstore-demo", "vllm", "make", "pip"}  # a bare name in prose is not a command


@dataclass(frozen=True, slots=True)
class DocCommand:
    doc: str  # "docs/operations.md"
    line: int
    text: str  # as written: continuation lines joined, a trailing comment dropped
    inline: bool

    def __str__(self) -> str:
        return f"{self.doc}:{self.line}: {self.text}"


def strip_comment(line: str) -> str:
    """``line`` without a shell comment (a ``#`` after whitespace, outside quotes)."""
    quote = ""
    for i, ch in enumerate(line):
        if quote:
            if ch == quote:
                quote = ""
        elif ch in "'\"":
            quote = ch
        elif ch == "#" and (i == 0 or line[i - 1].isspace()):
            return line[:i].rstrip()
    return line.rstrip()


def _complete(text: str) -> bool:
    """Whether ``text`` ends a shell command: no open quote, no trailing backslash."""
    if text.endswith("\\"):
        return False
    try:
        shlex.split(text)
    except ValueError:
        return False
    return True


def _block_commands(doc: str, start: int, lines: list[str]) -> Iterator[DocCommand]:
    buf: list[str] = []
    first = start
    for n, raw in enumerate(lines, start + 1):
        if not buf:
            if not raw.strip() or raw.lstrip().startswith("#"):
                continue
            first = n
        buf.append(raw)
        joined = "\n".join(buf)
        if _complete(strip_comment(joined)):
            text = strip_comment(joined)
            text = re.sub(r"\\\n\s*", "", text)  # a continued line reads as one
            yield DocCommand(doc, first, text.strip(), inline=False)
            buf = []
    assert not buf, f"{doc}:{first}: a command that never ends: {buf}"


def extract(root: Path = ROOT) -> list[DocCommand]:
    out: list[DocCommand] = []
    for path in sorted((root / "docs").glob("*.md")):
        doc = path.relative_to(root).as_posix()
        fence: tuple[int, str] | None = None
        body: list[str] = []
        prose: list[tuple[int, str]] = []
        for n, line in enumerate(path.read_text().splitlines(), 1):
            if line.startswith("```"):
                if fence is None:
                    fence, body = (n, line[3:].strip()), []
                    continue
                start, info = fence
                fence = None
                if info == "console":  # `$ command` lines; the rest is output
                    body = [b[2:] if b.startswith("$ ") else "" for b in body]
                commands = [b for b in body if b.strip() and not b.lstrip().startswith("#")]
                if info in SHELL_FENCES or (info == "" and any(COMMAND.match(c) for c in commands)):
                    out.extend(_block_commands(doc, start, body))
                continue
            if fence is not None:
                body.append(line)
                continue
            prose.append((n, line))
        out.extend(_inline_commands(doc, prose))
    return out


def _inline_commands(doc: str, prose: list[tuple[int, str]]) -> Iterator[DocCommand]:
    """Code spans outside fences that are commands; a span may run over one line break."""
    text = "\n".join(line for _, line in prose)
    starts = [0]
    for _, line in prose:
        starts.append(starts[-1] + len(line) + 1)
    for m in re.finditer(r"(?<!`)`([^`]+)`(?!`)", text):
        span = re.sub(r"\s+", " ", m.group(1)).strip()
        if m.group(1).count("\n") <= 1 and COMMAND.match(span) and span not in _NAMES:
            row = next(i for i, s in enumerate(starts) if s > m.start()) - 1
            yield DocCommand(doc, prose[row][0], span, inline=True)


def _value(pick: int, m: re.Match[str]) -> str:
    """Alternative ``pick`` of a value written ``A|B`` (the last one when there are fewer)."""
    alts = m.group(0).split("|")
    return alts[min(pick, len(alts) - 1)]


def variants(text: str) -> list[str]:
    """The concrete command lines a usage line stands for: ``{a,b}`` each; ``[X]`` without and
    with ``X``; alternatives (``[--a X|--b]``, a value ``NAME|all``) each in turn; ``X...`` and a
    lone ``...`` (more of the same) as one."""
    brace = re.search(r"(?<=\s)\{([\w,]+)\}", text)
    if brace:
        return [v for alt in brace.group(1).split(",")
                for v in variants(text[:brace.start()] + alt + text[brace.end():])]
    groups = list(re.finditer(r"(?<=\s)\[([^\[\]]*)\](?=\s|$)", text))
    values = re.findall(r"(?<=\s)[\w-]+(?:\|[\w-]+)+(?=\s|$)", text)  # NAME|all
    widest = max([len(g.group(1).split("|")) for g in groups] + [len(v.split("|")) for v in values], default=1)
    out: list[str] = []
    for pick in range(-1 if groups else 0, widest):
        s, last = "", 0
        for g in groups:
            alts = re.split(r"\|(?=-)", g.group(1))
            s += text[last:g.start()] + ("" if pick < 0 else alts[min(pick, len(alts) - 1)])
            last = g.end()
        s += text[last:]
        s = re.sub(r"(?<=\s)[\w-]+(?:\|[\w-]+)+(?=\s|$)", functools.partial(_value, max(pick, 0)), s)
        s = re.sub(r"(?<=[A-Z])\.\.\.(?=\s|$)", "", s)  # BLOCK... -> BLOCK
        s = re.sub(r"(?<=\s)\.\.\.(?=\s|$)", "", s)  # a lone ...
        out.append(s.strip() if "\n" in s else re.sub(r"\s+", " ", s).strip())
    return list(dict.fromkeys(out))


# --- the programs --------------------------------------------------------------------------

def scripts(root: Path = ROOT) -> dict[str, str]:
    """``pyproject.toml``'s console scripts: name -> ``module:function``."""
    with (root / "pyproject.toml").open("rb") as f:
        return dict(tomllib.load(f)["project"]["scripts"])


@dataclass(frozen=True, slots=True)
class Program:
    name: str  # "kvctl", "python -m tools.replay", "make", ...
    module: str | None  # what runs it in Python: a module run as __main__, or module:function
    args: list[str]


def program(argv: list[str]) -> Program:
    """The program of a split command line (environment assignments and a venv's bin/ dropped)."""
    while argv and re.fullmatch(r"[A-Z_][A-Z0-9_]*=.*", argv[0]):
        argv = argv[1:]
    head = re.sub(r"^(?:\.venv[\w-]*/bin/|/opt/kvstore/bin/)", "", argv[0])
    if head in ("python", "python3") and len(argv) > 2 and argv[1] == "-m":
        return Program(f"python -m {argv[2]}", argv[2] if _in_repo(argv[2]) else None, argv[3:])
    return Program(head, scripts().get(head), argv[1:])


def _in_repo(module: str) -> bool:
    """Whether ``module``'s top-level package is this repository's (vllm, sglang, venv, pytest
    are not), wherever in the tree it lives."""
    try:
        spec = importlib.util.find_spec(module.split(".")[0])
    except (ImportError, ValueError):
        return False
    where = [*(spec.submodule_search_locations or []), spec.origin or ""] if spec else []
    return any(Path(w).resolve().is_relative_to(ROOT) for w in where if w)


class _Accepted(Exception):
    def __init__(self, namespace: Any) -> None:
        super().__init__("accepted")
        self.namespace = namespace


@dataclass(frozen=True, slots=True)
class Parsed:
    ok: bool
    namespace: Any  # argparse.Namespace when accepted by a parser; None for --help/--version
    message: str  # what the tool printed when it refused
    missing: str | None = None  # a module the tool imports that is not installed here


def _stop_after_parsing() -> contextlib.AbstractContextManager[Any]:
    """Patch argparse so that the outermost ``parse_args``/``parse_known_args`` call raises
    ``_Accepted`` once it returns: the tool's parser ran in full, its ``main`` goes no further."""
    depth = [0]

    def wrap(orig: Callable[..., Any]) -> Callable[..., Any]:
        def parse(self: argparse.ArgumentParser, *a: Any, **kw: Any) -> Any:
            depth[0] += 1
            try:
                result = orig(self, *a, **kw)
            finally:
                depth[0] -= 1
            if depth[0] == 0:
                raise _Accepted(result[0] if isinstance(result, tuple) else result)
            return result
        return parse

    stack = contextlib.ExitStack()
    for name in ("parse_args", "parse_known_args"):
        stack.enter_context(mock.patch.object(argparse.ArgumentParser, name,
                                              wrap(getattr(argparse.ArgumentParser, name))))
    return stack


def _has_parser(origin: str) -> bool:
    """Whether a module (or the module its ``main`` comes from) parses with argparse: a tool
    without a parser would not stop at it, and runs."""
    source = Path(origin).read_text()
    if "argparse" in source:
        return True
    m = re.search(r"^from ([\w.]+) import main\b", source, flags=re.M)
    spec = importlib.util.find_spec(m.group(1)) if m else None
    return bool(spec and spec.origin and "argparse" in Path(spec.origin).read_text())


def parse(prog: Program) -> Parsed:
    """Run ``prog`` up to its argument parser; whether the parser accepted its arguments."""
    assert prog.module, f"{prog.name}: not a Python program of this repository"
    spec = importlib.util.find_spec(prog.module.split(":")[0])
    if spec and spec.submodule_search_locations:  # a package runs as its __main__
        spec = importlib.util.find_spec(prog.module + ".__main__")
    if spec is None or spec.origin is None:
        return Parsed(False, None, f"{prog.module}: no such module")
    if not _has_parser(spec.origin):
        return Parsed(False, None, f"{prog.module}: no argparse parser to check the arguments with")
    err, out = io.StringIO(), io.StringIO()
    argv = sys.argv
    try:
        with _stop_after_parsing(), contextlib.redirect_stderr(err), contextlib.redirect_stdout(out):
            if ":" in prog.module:
                sys.argv = [prog.name, *prog.args]
                mod, func = prog.module.split(":")
                getattr(importlib.import_module(mod), func)()
            else:
                sys.argv = [prog.module, *prog.args]
                runpy.run_module(prog.module, run_name="__main__", alter_sys=True)
    except _Accepted as a:
        return Parsed(True, a.namespace, "")
    except ModuleNotFoundError as e:  # an optional dependency (torch) this venv lacks: say which
        return Parsed(False, None, f"ModuleNotFoundError: {e}", missing=e.name)
    except Exception as e:  # the tool failed before or while parsing
        return Parsed(False, None, f"{type(e).__name__}: {e}\n{err.getvalue()}")
    except SystemExit as e:
        # --help and --version exit 0 from inside the parser; anything else is a refusal
        return Parsed(e.code in (0, None), None, err.getvalue() + out.getvalue())
    else:
        return Parsed(False, None, "the program returned without parsing any argument")
    finally:
        sys.argv = argv


def stop_gracefully(daemon: subprocess.Popen[str], log: IO[str]) -> None:
    """SIGTERM a daemon the docs started (its graceful stop writes the event log out), wait up to
    120 s, SIGKILL its process group if it is still running, and close its log and stdout."""
    daemon.send_signal(signal.SIGTERM)
    try:
        daemon.wait(timeout=120)
    finally:
        if daemon.poll() is None:
            os.killpg(daemon.pid, signal.SIGKILL)
            daemon.wait()
        log.close()
        if daemon.stdout is not None:
            daemon.stdout.close()
