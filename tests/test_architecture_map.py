"""docs/architecture.md's map matches the tree: every package it names exists, every package in
the tree is named, and each package imports only the packages its row lists (function-level and
``TYPE_CHECKING`` imports included). A package is a folder of the repository, outside ``tests/``,
that holds Python or shell sources (build outputs and hidden folders left out)."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOC = ROOT / "docs" / "architecture.md"
OUTSIDE = {"tests", "docs", "deploy", "build", "dist"}  # and hidden folders (.venv, .git)
PACKAGE = re.compile(r"`([A-Za-z_][\w/]*/)`")


def map_rows(text: str) -> dict[str, set[str]]:
    """``{package: packages it may import}`` from the table under "## The map"."""
    section = text.split("## The map", 1)[1].split("\n## ", 1)[0]
    rows: dict[str, set[str]] = {}
    for line in section.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) != 3 or not line.startswith("| `"):
            continue
        names = PACKAGE.findall(cells[0])
        assert len(names) == 1, f"one package per row: {line}"
        rows[names[0].rstrip("/")] = {n.rstrip("/") for n in PACKAGE.findall(cells[2])}
    return rows


def tree_packages(root: Path) -> set[str]:
    found = set()
    for path in [*root.rglob("*.py"), *root.rglob("*.sh")]:
        rel = path.relative_to(root)
        if (
            len(rel.parts) < 2
            or rel.parts[0] in OUTSIDE
            or any(p.startswith(".") or p.endswith(".egg-info") for p in rel.parts)
        ):
            continue
        found.add(rel.parent.as_posix())
    return found


def package_of(module: str, packages: set[str]) -> str | None:
    """The longest package that holds ``module`` (``a.b.c`` → ``a/b`` when ``a/b`` is one)."""
    parts = module.split(".")
    for n in range(len(parts), 0, -1):
        if "/".join(parts[:n]) in packages:
            return "/".join(parts[:n])
    return None


def imported_packages(root: Path, package: str, packages: set[str]) -> dict[str, str]:
    """``{other package: "file:line"}`` of the first import of each other package."""
    out: dict[str, str] = {}
    for path in sorted((root / package).glob("*.py")):
        tree = ast.parse(path.read_text(), str(path))
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                modules = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    up = package.split("/")[: len(package.split("/")) - node.level + 1]
                    base = ".".join([*up, base] if base else up)
                modules = [base]
            else:
                continue
            for module in modules:
                target = package_of(module, packages)
                if target and target != package:
                    out.setdefault(target, f"{path.relative_to(root)}:{node.lineno}")
    return out


def test_every_package_in_the_map_exists_and_every_package_is_in_the_map() -> None:
    named = set(map_rows(DOC.read_text()))
    actual = tree_packages(ROOT)
    assert sorted(named - actual) == [], "named in docs/architecture.md but not in the tree"
    assert sorted(actual - named) == [], "in the tree but not in docs/architecture.md's map"


def test_each_package_imports_only_what_its_row_lists() -> None:
    rows = map_rows(DOC.read_text())
    packages = tree_packages(ROOT)
    unlisted = [
        f"{where}: {package} imports {other}"
        for package in sorted(rows)
        if package in packages
        for other, where in imported_packages(ROOT, package, packages).items()
        if other not in rows[package]
    ]
    assert unlisted == []


def test_the_checks_catch_a_stale_map(tmp_path: Path) -> None:
    for pkg in ("alpha", "alpha/beta", "gamma"):
        (tmp_path / pkg).mkdir(parents=True, exist_ok=True)
        (tmp_path / pkg / "__init__.py").write_text("")
    (tmp_path / "alpha" / "beta" / "m.py").write_text("def f():\n    from gamma import x\n")
    (tmp_path / "tests").mkdir()
    (tmp_path / "tests" / "test_x.py").write_text("")
    doc = (
        "# x\n\n## The map\n\n| package | what | imports |\n|---|---|---|\n"
        "| `alpha/` | a | — |\n| `alpha/beta/` | b | `alpha/` |\n| `delta/` | d | — |\n\n## Next\n"
    )
    rows = map_rows(doc)
    packages = tree_packages(tmp_path)
    assert packages == {"alpha", "alpha/beta", "gamma"}
    assert set(rows) - packages == {"delta"}
    assert packages - set(rows) == {"gamma"}
    assert rows["alpha/beta"] == {"alpha"}
    assert imported_packages(tmp_path, "alpha/beta", packages) == {"gamma": "alpha/beta/m.py:2"}


@pytest.mark.parametrize(
    "module, expected",
    [
        ("tools.bench.hash", "tools/bench"),
        ("kvstore.store.core", "kvstore/store"),
        ("kvstore.keys", "kvstore"),
        ("kvstore.ctl.cli", "kvstore/ctl"),
        ("engine.reference.batch", "engine/reference"),
        ("engine.client", "engine"),
        ("tools.lab.replay.bounds", "tools/lab/replay"),
        ("tools.replay.sim", "tools"),
        ("numpy", None),
    ],
)
def test_a_module_belongs_to_its_longest_package(module: str, expected: str | None) -> None:
    packages = {"kvstore", "kvstore/store", "kvstore/ctl", "engine", "engine/reference", "tools", "tools/bench",
                "tools/lab", "tools/lab/replay"}
    assert package_of(module, packages) == expected
