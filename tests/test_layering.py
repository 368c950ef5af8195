"""Imports flow one way (docs/architecture.md): ``tiers/`` and ``eviction/`` import only the
leaf modules of ``kvstore/``; ``kvstore/server``, ``kvstore/client``, ``engine/`` and ``tools/``
import only public names of other kvstore packages. Walks every module's imports with ``ast``
(function-level and ``TYPE_CHECKING`` imports included), so an upward import fails here."""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
LEAVES = {"keys", "block", "errors", "units", "clock", "buffers", "shm", "api"}
LOWER = ("tiers", "eviction")
CALLERS = ("kvstore/server", "kvstore/client", "engine", "tools")


def _modules(where: str) -> list[Path]:
    return sorted(p for p in (ROOT / where).rglob("*.py") if ".venv" not in p.parts)


def _package_of(path: Path) -> str:
    rel = path.relative_to(ROOT).with_suffix("")
    parts = rel.parts[:-1] if rel.name != "__init__" else rel.parts[:-1]
    return ".".join(parts)


def imports(path: Path) -> Iterator[tuple[int, str, str | None]]:
    """``(line, module, name)`` of every import in ``path`` (``name`` None for ``import m``),
    relative imports resolved against the module's package."""
    tree = ast.parse(path.read_text(), str(path))
    package = _package_of(path)
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                yield node.lineno, a.name, None
        elif isinstance(node, ast.ImportFrom):
            module = node.module or ""
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                module = ".".join([*base, module] if module else base)
            for a in node.names:
                yield node.lineno, module, a.name


def upward(path: Path) -> list[str]:
    """Imports of kvstore modules other than the leaves, from a tier or a policy."""
    out = []
    for line, module, name in imports(path):
        parts = module.split(".")
        if parts[0] != "kvstore":
            continue
        target = parts[1] if len(parts) > 1 else name
        if target not in LEAVES:
            out.append(f"{path.relative_to(ROOT)}:{line}: imports {module}{'.' + name if name and len(parts) == 1 else ''}")
    return out


def private(path: Path) -> list[str]:
    """Imports of underscore-private kvstore modules or names outside the importer's package."""
    own = _package_of(path)
    out = []
    for line, module, name in imports(path):
        parts = module.split(".")
        if parts[0] != "kvstore":
            continue
        full = [*parts, name] if name else parts
        for i, part in enumerate(full[1:], 1):
            if part.startswith("_") and not part.startswith("__") and ".".join(full[:i]) != own:
                out.append(f"{path.relative_to(ROOT)}:{line}: imports private {'.'.join(full[: i + 1])}")
                break
    return out


@pytest.mark.parametrize("where", LOWER)
def test_tiers_and_policies_import_only_leaf_modules_of_kvstore(where: str) -> None:
    assert [v for p in _modules(where) for v in upward(p)] == []


@pytest.mark.parametrize("where", CALLERS)
def test_callers_use_only_public_kvstore_names(where: str) -> None:
    assert [v for p in _modules(where) for v in private(p)] == []


def test_the_checks_catch_a_violation(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("tests.test_layering.ROOT", tmp_path)
    (tmp_path / "tiers").mkdir()
    bad = tmp_path / "tiers" / "bad.py"
    bad.write_text("from kvstore.keys import BlockHash\nfrom kvstore.store import KVStore\n"
                   "def f():\n    from kvstore import index\n")
    assert upward(bad) == ["tiers/bad.py:2: imports kvstore.store", "tiers/bad.py:4: imports kvstore.index"]
    (tmp_path / "engine").mkdir()
    caller = tmp_path / "engine" / "bad.py"
    caller.write_text("from kvstore.store import _dst_views\nfrom kvstore.store._common import LookupResult\n"
                      "from kvstore.api import KVCacheAPI\n")
    assert private(caller) == [
        "engine/bad.py:1: imports private kvstore.store._dst_views",
        "engine/bad.py:2: imports private kvstore.store._common",
    ]
