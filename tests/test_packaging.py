"""What the wheel installs: the packages ``[tool.setuptools.packages.find]`` selects, found with
setuptools' own discovery (what ``pip wheel .`` runs, without building). No top-level ``tools``
(benchmarks, the replay, the lab) and no lab code; every console script's module is inside an
installed package. ``tests/deploy/test_deploy.py`` builds the wheel itself (slow) and checks
its file list the same way."""

from __future__ import annotations

import tomllib
from pathlib import Path

import pytest
from setuptools import find_namespace_packages, find_packages

ROOT = Path(__file__).resolve().parents[1]
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())


def installed_packages(root: Path = ROOT, pyproject: dict | None = None) -> set[str]:
    """The dotted packages a wheel of ``root`` holds (setuptools' discovery, as configured)."""
    find = (pyproject or PYPROJECT)["tool"]["setuptools"]["packages"]["find"]
    finder = find_namespace_packages if find.get("namespaces", True) else find_packages
    found = finder(where=str(root), include=find.get("include", ["*"]), exclude=find.get("exclude", []))
    # a folder without Python sources (``__pycache__``) is a namespace package with nothing in it
    return {p for p in found if any((root / p.replace(".", "/")).glob("*.py"))}


def test_the_wheel_has_no_tools_and_no_lab() -> None:
    packages = installed_packages()
    assert {"kvstore", "kvstore.ctl", "kvstore.report", "engine", "engine.reference", "tiers", "eviction"} <= packages
    assert sorted(p for p in packages if p.split(".")[0] not in ("kvstore", "engine", "tiers", "eviction")) == []
    assert sorted(p for p in packages if "lab" in p.split(".")) == []


@pytest.mark.parametrize("script", sorted(PYPROJECT["project"]["scripts"]))
def test_every_console_script_is_in_an_installed_package(script: str) -> None:
    module, _, func = PYPROJECT["project"]["scripts"][script].partition(":")
    package = module.rpartition(".")[0]
    assert package in installed_packages(), f"{script} = {module}:{func}: {package} is not installed"
    source = ROOT / (module.replace(".", "/") + ".py")
    assert source.exists() and f"def {func}(" in source.read_text()


def test_the_check_catches_tools_in_the_wheel(tmp_path: Path) -> None:
    for pkg in ("kvstore", "tools", "tools/lab"):
        (tmp_path / pkg).mkdir(parents=True)
        (tmp_path / pkg / "__init__.py").write_text("")
    pyproject = {"tool": {"setuptools": {"packages": {"find": {"include": ["kvstore*", "tools*"]}}}}}
    assert installed_packages(tmp_path, pyproject) == {"kvstore", "tools", "tools.lab"}
